"""reasoning-gym's difficulty levels as a curriculum moved by the measured
reward: the rule moves each way as documented, the stream draws each task
at its level (never a held-out question) and resumes exactly, a level's
questions are scored by that level's dataset, bad settings are refused by
key, and a run's rewards move the levels, logged and checkpointed."""

import json

import numpy as np
import pytest

pytest.importorskip("reasoning_gym")

from arl_jax.envs import curriculum as curriculum_lib  # noqa: E402
from arl_jax.envs import mixture  # noqa: E402
from arl_jax.envs import reasoning_gym_curriculum as rgc  # noqa: E402
from arl_jax.envs import reasoning_gym_env as rg  # noqa: E402
from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: E402
from arl_jax.testing import tiny  # noqa: E402
from arl_jax.training import run_lib  # noqa: E402


def _rule(**overrides):
  cfg = curriculum_lib.CurriculumConfig(**{"enabled": True, "window": 4, **overrides})
  return curriculum_lib.Curriculum(cfg, {"a": 2, "b": 5})


def test_the_level_moves_up_on_success_and_down_on_failure_after_a_window():
  c = _rule()
  c.observe("a", 0, [1.0, 1.0, 1.0])
  assert c.level("a") == 0  # (the window is not full)
  c.observe("a", 0, [0.0])
  assert c.level("a") == 1  # (mean 0.75 >= 0.7)
  c.observe("a", 0, [1.0] * 8)
  assert c.level("a") == 1  # (rollouts of another level judge nothing)
  c.observe("a", 1, [1.0, 0.0, 1.0, 0.0])
  assert c.level("a") == 1  # (0.5: inside the band)
  c.observe("a", 1, [1.0] * 4)
  c.observe("a", 2, [1.0] * 4)
  assert c.level("a") == 2  # (the top)
  c.observe("a", 2, [0.0, 0.0, 0.0, 1.0])
  assert c.level("a") == 2  # (0.25: inside the band)
  c.observe("a", 2, [0.0, 0.0, 0.0, 0.0])
  assert c.level("a") == 1  # (0 <= 0.2)
  assert c.metrics() == {"curriculum_level": {"a": 1, "b": 0},
                         "curriculum_moves": {"a": {"up": 2, "down": 1},
                                              "b": {"up": 0, "down": 0}}}


def test_demotion_is_at_or_below_its_threshold_and_never_below_zero():
  c = _rule(demote_at=0.25)
  c.observe("b", 0, [0.0] * 4)
  assert c.level("b") == 0
  c2 = _rule(start_level=9, demote_at=0.25)
  assert c2.level("a") == 2 and c2.level("b") == 5  # (start clamped to each top)
  c2.observe("b", 5, [0.0, 0.0, 0.0, 1.0])
  assert c2.level("b") == 4
  c2.observe("b", 4, [0.0, 0.0, 1.0, 1.0])
  assert c2.level("b") == 4
  moves = c2.metrics()["curriculum_moves"]
  assert moves["b"] == {"up": 0, "down": 1}


def test_the_rule_s_state_round_trips():
  c = _rule()
  c.observe("a", 0, [1.0] * 4)
  c.observe("a", 1, [0.5, 0.5])
  restored = _rule()
  restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
  assert restored.state_dict() == c.state_dict()
  restored.observe("a", 1, [1.0, 1.0])
  assert restored.level("a") == 2  # (the saved half window counts: mean 0.75)


@pytest.mark.parametrize("fields, words", [
    ({"enabled": True, "bogus": 1}, "unknown key(s) ['bogus']"),
    ({"enabled": "yes"}, "enabled must be True or False"),
    ({"enabled": True, "window": 0}, "window must be an int >= 1"),
    ({"enabled": True, "promote_at": 0.2, "demote_at": 0.5}, "must be below promote_at"),
])
def test_bad_curriculum_settings_are_refused_by_key(fields, words):
  with pytest.raises(ValueError, match="env.curriculum") as e:
    rg.ReasoningGymConfig(tasks={"chain_sum": {}}, curriculum=fields)
  assert words in str(e.value)


def test_a_task_without_a_curriculum_or_a_curriculum_in_a_mixture_is_refused():
  from reasoning_gym import factory

  without = sorted(set(factory.DATASETS) - set(factory.CURRICULA))[0]
  with pytest.raises(ValueError, match=f"no curriculum for \\['{without}'\\]; tasks with one"):
    rg.ReasoningGymConfig(tasks={without: {}}, curriculum={"enabled": True})
  with pytest.raises(ValueError, match="cannot be mixed"):
    mixture.MixtureConfig(components={
        "reasoning_gym": {"weight": 1.0, "tasks": {"chain_sum": {}},
                          "curriculum": {"enabled": True}},
        "arith": {"weight": 1.0}})


def _stream(window=8, **fields):
  cfg = rg.ReasoningGymConfig(
      tasks={"chain_sum": {"weight": 3.0}, "gcd": {}}, size=300, heldout_size=40,
      curriculum={"enabled": True, "window": window, **fields})
  return cfg, rgc.make_stream(cfg, seed=0)


def _terms(text: str) -> int:
  problem = text.split("problem:")[1].split("=")[0]
  return len([t for t in problem.replace("-", "+").split("+") if t.strip()])


def test_the_stream_draws_each_task_at_its_level_and_never_a_held_out_question():
  cfg, stream = _stream()
  heldout = {p.text for p in rg.make_prompts(cfg, "heldout")}
  first = [next(stream) for _ in range(40)]
  decoded = [rg.decode_prompt_id(cfg, p.prompt_id) for p in first]
  assert {(task, split, level) for task, split, _, level in decoded} == {
      ("chain_sum", "train", 0), ("gcd", "train", 0)}
  chain = [p for p, d in zip(first, decoded) if d[0] == "chain_sum"]
  assert 20 <= len(chain) <= 38  # (weights 3 : 1)
  assert {_terms(p.text) for p in chain} == {2}  # (level 0: two terms of one digit)
  stream.observe(chain[0].prompt_id, [1.0] * 8)  # (a window at level 0: up)
  assert stream.metrics()["curriculum_level"] == {"chain_sum": 1, "gcd": 0}
  later = [p for p in (next(stream) for _ in range(80))
           if rg.decode_prompt_id(cfg, p.prompt_id)[0] == "chain_sum"]
  assert {rg.decode_prompt_id(cfg, p.prompt_id)[3] for p in later} == {1}
  assert max(_terms(p.text) for p in later) == 3  # (level 1: two or three terms)
  assert not heldout & {p.text for p in first + later}


def test_a_held_out_only_task_needs_no_curriculum_and_is_never_drawn():
  from reasoning_gym import factory

  without = sorted(set(factory.DATASETS) - set(factory.CURRICULA))[0]
  cfg = rg.ReasoningGymConfig(tasks={"chain_sum": {}, without: {"weight": 0}}, size=100,
                              heldout_size=10, curriculum={"enabled": True})
  stream = rgc.make_stream(cfg, seed=0)
  assert {rg.decode_prompt_id(cfg, next(stream).prompt_id)[0] for _ in range(20)} == {
      "chain_sum"}
  assert set(stream.metrics()["curriculum_level"]) == {"chain_sum"}


def test_the_stream_resumes_where_it_stopped():
  _, stream = _stream()
  for _ in range(5):
    next(stream)
  stream.observe(next(stream).prompt_id, [1.0] * 4)
  state = json.loads(json.dumps(stream.get_state()))
  ahead = [next(stream).prompt_id for _ in range(30)]
  _, again = _stream()
  again.set_state(state)
  assert [next(again).prompt_id for _ in range(30)] == ahead
  assert again.get_state()["curriculum"] == stream.get_state()["curriculum"]


def test_a_level_s_question_is_scored_by_that_level_s_dataset():
  cfg, stream = _stream(window=1)
  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  env = rg.ReasoningGymEnv(cfg, tokenizer)
  for _ in range(3):  # (chain_sum up to level 3: questions of up to 4 terms, 3 digits)
    chain = next(p for p in stream if rg.decode_prompt_id(cfg, p.prompt_id)[0] == "chain_sum")
    stream.observe(chain.prompt_id, [1.0])
  scores = []
  for prompt in [next(stream) for _ in range(12)]:
    right = env.demonstration(prompt).completion_ids
    wrong = [*tokenizer.encode("<answer>nonsense</answer>"), tokenizer.end_of_turn_id]
    scores.append((env.score(prompt, right), env.score(prompt, wrong)))
    assert env.env_name_of(prompt) in ("reasoning_gym/chain_sum", "reasoning_gym/gcd")
  assert scores == [(1.0, 0.0)] * 12
  assert stream.metrics()["curriculum_level"]["chain_sum"] == 3


def test_a_run_s_rewards_move_the_levels_logged_and_checkpointed(tmp_path):
  """promote_at 0: every full window moves its task up, so the wiring (the
  orchestrator tells the stream each finished group's rewards; the levels
  join the step rows and the checkpoint) shows in a few updates."""
  config = tiny.load_config("reasoning_gym", "chain_sum:tiny")
  config.env.curriculum.update(enabled=True, window=4, promote_at=0.0, demote_at=-1.0)
  config.num_steps, config.eval_every = 3, 0
  config.checkpoint = {"every_steps": 3, "save_final": True}
  run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  levels = [r["curriculum_level"]["chain_sum"] for r in rows if "curriculum_level" in r]
  assert len(levels) == 3 and levels == sorted(levels) and levels[-1] >= 2, levels
  config.num_steps = 4
  run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  resumed = [r["curriculum_level"]["chain_sum"] for r in rows if "curriculum_level" in r]
  assert len(resumed) == 4 and resumed[3] >= levels[-1], resumed  # (not back to level 0)
  assert np.all(np.diff(resumed) >= 0)
