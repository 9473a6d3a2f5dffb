"""reasoning-gym's tasks as an environment: any task by name (a mistyped one
refused with the list), its own keys and checks, its own scorer as the
reward, a held-out split that never meets a training question, mixtures by
weight, and the config file's keys under `env.tasks.TASK`."""

import pytest

pytest.importorskip("reasoning_gym")

import arl_jax  # noqa: E402
from arl_jax.config import run_spec  # noqa: E402
from arl_jax.envs import reasoning_gym_env as rg_env  # noqa: E402
from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: E402

# One-digit sums of two terms: 190 distinct questions, so two seeds' draws overlap.
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _config(**overrides):
  fields = dict(tasks={"chain_sum": {"weight": 3.0, **SMALL}, "gcd": {}}, size=400,
                heldout_size=60)
  return rg_env.ReasoningGymConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def env():
  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  return rg_env.ReasoningGymEnv(_config(), tokenizer)


def _completion(env, text, ended=True):
  ids = env.tokenizer.encode(text)
  return ids + [env.tokenizer.end_of_turn_id] if ended else ids


@pytest.mark.parametrize("tasks, words", [
    ({"chain_summ": {}}, "did you mean chain_sum"),
    ({"no_such_task_at_all": {}}, "Tasks: ab, acre"),
    ({"chain_sum": {"bogus": 1}}, "unknown key(s) ['bogus']; chain_sum's keys"),
    ({"chain_sum": {"weight": -1}}, "weight must be a number >= 0"),
    ({"chain_sum": {"weight": 0}}, "every task has weight 0"),
    ({"chain_sum": {"min_terms": 5, "max_terms": 2}}, "max_terms must be >= min_terms"),
    ({}, "env.tasks is empty"),
])
def test_bad_tasks_are_refused_by_key(tasks, words):
  with pytest.raises(ValueError, match="env.tasks") as e:
    rg_env.ReasoningGymConfig(tasks=tasks)
  assert words in str(e.value)


def test_the_held_out_split_never_meets_a_training_question():
  cfg = _config()
  train, heldout = rg_env.make_prompts(cfg, "train"), rg_env.make_prompts(cfg, "heldout")
  assert not {p.text for p in train} & {p.text for p in heldout}
  # (the small task does repeat across seeds: some training draws were left out)
  drawn = cfg.sizes("train")
  assert drawn == {"chain_sum": 300, "gcd": 100}
  chain = [p for p in train if "arithmetic problem" in p.text]
  assert 0 < len(chain) < 300
  assert len(heldout) == 2 * 60
  assert len({p.prompt_id for p in train + heldout}) == len(train) + len(heldout)
  assert train == rg_env.make_prompts(cfg, "train")  # (deterministic)


def test_a_task_of_weight_zero_is_evaluated_and_never_trained_on():
  cfg = _config(tasks={"chain_sum": SMALL, "gcd": {"weight": 0}})
  assert cfg.trained_tasks == ["chain_sum"] and cfg.sizes("train")["gcd"] == 0
  train, heldout = rg_env.make_prompts(cfg, "train"), rg_env.make_prompts(cfg, "heldout")
  tasks_of = lambda prompts: {rg_env.decode_prompt_id(cfg, p.prompt_id)[0] for p in prompts}
  assert tasks_of(train) == {"chain_sum"} and tasks_of(heldout) == {"chain_sum", "gcd"}
  assert len(heldout) == 2 * 60


def test_the_task_s_own_scorer_is_the_reward(env):
  prompts = rg_env.make_prompts(env.cfg, "heldout")
  by_task = {env.env_name_of(p): p for p in prompts}
  assert set(by_task) == {"reasoning_gym/chain_sum", "reasoning_gym/gcd"}
  for prompt in by_task.values():
    right = _completion(env, f"Let me think. <answer>{prompt.answer}</answer>")
    assert env.score(prompt, right) == 1.0
    assert env.score(prompt, _completion(env, "<answer>banana</answer>")) == 0.0
    assert env.score(prompt, _completion(env, prompt.answer)) == 0.0  # (no tags)
    cut_off = _completion(env, f"<answer>{prompt.answer}</answer>", ended=False)
    assert env.score(prompt, cut_off) == 0.0
    demo = env.demonstration(prompt)
    assert env.score(prompt, list(demo.completion_ids)) == 1.0
  raw = rg_env.ReasoningGymEnv(_config(answer_format="raw"), env.tokenizer)
  prompt = rg_env.make_prompts(raw.cfg, "heldout")[0]
  assert "<answer>" not in prompt.text
  assert raw.score(prompt, _completion(raw, f" {prompt.answer} ")) == 1.0


def test_last_number_scores_the_last_number_a_completion_writes(env):
  """For a model that answers in a sentence (SmolLM2: "The final answer ...
  is 7."): the arithmetic is scored, not a tag format it never writes."""
  cfg = _config(answer_format="last_number")
  last = rg_env.ReasoningGymEnv(cfg, env.tokenizer)
  for prompt in rg_env.make_prompts(cfg, "heldout")[:20]:
    assert prompt.text.endswith("End your reply with the final answer.")
    answer = prompt.answer
    assert last.score(prompt, _completion(last, f"3 + 4 makes 7, so it is {answer}.")) == 1.0
    # (the task's scorer may give a wrong number partial credit, never full)
    assert last.score(prompt, _completion(last, f"It is {answer}, or maybe 100001.")) < 1.0
    assert last.score(prompt, _completion(last, "I cannot say.")) == 0.0
    assert last.score(prompt, _completion(last, f"It is {answer}", ended=False)) == 0.0
    assert last.score(prompt, list(last.demonstration(prompt).completion_ids)) == 1.0
  with pytest.raises(ValueError, match="letter_jumble's answers are not numbers"):
    rg_env.ReasoningGymConfig(tasks={"letter_jumble": {}}, answer_format="last_number")


def test_the_config_file_reaches_each_task_s_keys():
  config = arl_jax.load_config("reasoning_gym", "chain_sum,gcd:tiny")
  assert config.env.tasks.chain_sum.max_terms == 6  # (reasoning-gym's default)
  config.unlock()
  config.env.tasks.chain_sum.max_terms = 3
  config.env.tasks.gcd.weight = 0.5
  spec = run_spec.build(config)
  assert spec.env.options["chain_sum"]["max_terms"] == 3 and spec.env.weights["gcd"] == 0.5
  with pytest.raises(ValueError, match="needs the task names"):
    arl_jax.load_config("reasoning_gym", None)


def test_a_task_with_many_right_answers_shows_its_example_answer():
  """propositional_logic gives no answer (any valid conclusion scores): the
  demonstration is its metadata's example, which its scorer accepts."""
  cfg = rg_env.ReasoningGymConfig(tasks={"propositional_logic": {}}, size=20, heldout_size=5)
  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  env = rg_env.ReasoningGymEnv(cfg, tokenizer)
  prompts = rg_env.make_prompts(cfg, "train")
  assert all(p.answer and p.answer != "None" for p in prompts)
  scores = [env.score(p, list(env.demonstration(p).completion_ids)) for p in prompts]
  assert min(scores) > 0.0 and sum(scores) / len(scores) > 0.9
