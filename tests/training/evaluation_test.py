"""Evaluation: environment faults end an episode with reward 0 and are
counted; the sampled pass reports the unbiased pass@k of its samples."""

import collections
import math

import numpy as np
import pytest

from arl_jax.envs import env_api
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.metrics import pass_at_k
from arl_jax.sampler import engine_config
from arl_jax.testing import tiny
from arl_jax.training import evaluation

TOK = tokenizer_lib.ByteTokenizer()


class FaultyEnv(env_api.MultiTurnEnvironment):
  """Every token but EOS ends a segment, so each episode's first segment is
  one token and `step` is always called. Prompts 1 and 2 fault in `step`,
  prompt 3 answers an id outside the vocabulary, prompt 4 faults in `score`
  and prompt 5 scores NaN; the rest score 1. Even and odd prompt ids are two
  environments of a mixture."""

  name = "faulty"
  stop_ids = tuple(range(TOK.eos_id))

  def __init__(self):
    self.scored = []
    self.stepped = collections.Counter()

  def env_name_of(self, prompt):
    return "odd" if prompt.prompt_id % 2 else "even"

  def encode_prompt(self, prompt):
    return TOK.encode(prompt.text, add_bos=True)

  def step(self, prompt, completion_ids):
    self.stepped[prompt.prompt_id] += 1
    if prompt.prompt_id in (1, 2):
      raise RuntimeError("tool crashed")
    return [TOK.vocab_size + 7] if prompt.prompt_id == 3 else None

  def score(self, prompt, completion_ids):
    self.scored.append(prompt.prompt_id)
    if prompt.prompt_id == 4:
      raise RuntimeError("grader crashed")
    return float("nan") if prompt.prompt_id == 5 else 1.0


@pytest.fixture(scope="module")
def model():
  cfg = tiny.tiny_model_config()
  meshes = tiny.single_device_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  return cfg, meshes, graphdef, params


def test_environment_faults_are_counted_per_environment_and_score_zero(model):
  cfg, meshes, graphdef, params = model
  env = FaultyEnv()
  assert env.multi_turn
  prompts = [env_api.TextPrompt(prompt_id=i, text=f"p{i}", answer="") for i in range(8)]
  engine_cfg = engine_config.EngineConfig(prompt_len=8, kv_cache="dense", decode_burst=1,
                                          precompile=False, num_slots=8, group_size=1,
                                          max_new_tokens=4, multi_turn=True, context_bucket=4)
  evaluator = evaluation.Evaluator(graphdef=graphdef, model_cfg=cfg, env=env, tokenizer=TOK,
                                   prompts=prompts, mesh=meshes.learner, engine_cfg=engine_cfg)
  result = evaluator(params)
  assert set(env.stepped) == set(range(8))  # every episode reached the environment
  # Faults: even 2 (step), 4 (score); odd 1 (step), 3 (bad observation), 5 (NaN reward).
  assert result.env_errors == {"even": 2, "odd": 3}
  assert result.num_env_errors == 5
  # An episode a step fault ended is not scored; the rest are.
  assert sorted(env.scored) == [0, 4, 5, 6, 7]
  assert result.reward_by_env == {"even": 0.5, "odd": 0.25}  # 1 only for 0, 6 | 7
  assert result.reward == pytest.approx(3 / 8) and result.num_prompts == 8

  # Without faults the counters are there, at 0.
  clean_prompts = [p for p in prompts if p.prompt_id in (0, 6, 7)]
  clean = evaluation.Evaluator(graphdef=graphdef, model_cfg=cfg, env=FaultyEnv(), tokenizer=TOK,
                               prompts=clean_prompts, mesh=meshes.learner,
                               engine_cfg=engine_cfg)(params)
  assert clean.env_errors == {"even": 0, "odd": 0} and clean.num_env_errors == 0
  assert clean.reward == 1.0


class ParityEnv(env_api.Environment):
  """A completion is right when its first token is even; every score is kept."""

  name = "parity"

  def __init__(self):
    self.scores = collections.defaultdict(list)

  def encode_prompt(self, prompt):
    return TOK.encode(prompt.text, add_bos=True)

  def score(self, prompt, completion_ids):
    reward = float(completion_ids[0] % 2 == 0)
    self.scores[prompt.prompt_id].append(reward)
    return reward


def test_sampled_evaluation_reports_the_unbiased_pass_at_k_of_its_samples(model):
  cfg, meshes, graphdef, params = model
  env = ParityEnv()
  prompts = [env_api.TextPrompt(prompt_id=i, text=f"q{i}", answer="") for i in range(4)]
  engine_cfg = engine_config.EngineConfig(prompt_len=8, kv_cache="dense", decode_burst=1,
                                          precompile=False, num_slots=8, group_size=4,
                                          max_new_tokens=3, seed=5)
  evaluator = evaluation.Evaluator(graphdef=graphdef, model_cfg=cfg, env=env, tokenizer=TOK,
                                   prompts=prompts, mesh=meshes.learner, engine_cfg=engine_cfg,
                                   samples=4, temperature=1.5)
  result = evaluator(params)
  # Each prompt was scored once greedily, then 4 times sampled (8 slots: two
  # groups at a time, so the other two waited for slots).
  assert all(len(env.scores[i]) == 5 for i in range(4))
  solved = [int(sum(env.scores[i][1:])) for i in range(4)]
  assert 0 < sum(solved) < 16, "the test needs some right and some wrong samples"
  assert result.samples == 4 and sorted(result.pass_at_k) == [1, 2, 4]
  for k in (1, 2, 4):
    expected = sum(pass_at_k.pass_at_k(4, c, k) for c in solved) / 4
    assert result.pass_at_k[k] == pytest.approx(expected)
  assert result.avg_at_n == pytest.approx(sum(solved) / 16)
  assert result.reward == pytest.approx(sum(env.scores[i][0] for i in range(4)) / 4)
  assert result.sampled_by_env["parity"]["pass_at_k"] == result.pass_at_k
  # Common random numbers: the same params draw the same samples.
  again = evaluator(params)
  assert again.pass_at_k == result.pass_at_k and again.avg_at_n == result.avg_at_n


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 4, 1.0), (4, 0, 4, 0.0), (4, 4, 1, 1.0),
    (10, 3, 5, 1 - 21 / 252)])
def test_pass_at_k_matches_the_binomial_formula(n, c, k, expected):
  assert pass_at_k.pass_at_k(n, c, k) == pytest.approx(expected)
  assert pass_at_k.pass_at_k(n, c, k) == pytest.approx(
      1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_reports_powers_of_two_and_n():
  assert pass_at_k.ks(8) == (1, 2, 4, 8)
  assert pass_at_k.ks(6) == (1, 2, 4, 6)
  assert pass_at_k.ks(1) == (1,)
  summary = pass_at_k.summarise(np.array([[1, 0, 0, 0], [1, 1, 1, 1]], bool),
                                np.array([[1, 0, 0, 0], [1, 1, 1, 1]], float))
  assert summary == {"pass_at_k": {1: 0.625, 2: 0.75, 4: 1.0}, "avg_at_n": 0.625}
  with pytest.raises(ValueError, match="pass@k needs"):
    pass_at_k.pass_at_k(4, 5, 1)


def test_the_greedy_pass_pads_prompts_to_powers_of_two_unless_the_run_names_buckets():
  # (each prompt is prefilled on its own: padding a 50-token prompt to a
  # 256-token prompt_len made prefill most of a real model's evaluation)
  base = engine_config.EngineConfig(prompt_len=256, max_new_tokens=8, num_slots=4)
  assert evaluation.greedy_engine_config(base, 10).prompt_buckets == (32, 64, 128, 256)
  named = engine_config.EngineConfig(prompt_len=256, max_new_tokens=8, num_slots=4,
                                     prompt_buckets=(48,))
  assert evaluation.greedy_engine_config(named, 10).prompt_buckets == (48, 256)
  short = engine_config.EngineConfig(prompt_len=16, max_new_tokens=8, num_slots=4)
  assert evaluation.greedy_engine_config(short, 10).prompt_buckets == (16,)
  # (the cache is as long either way: the planned memory is unchanged)
  assert evaluation.greedy_engine_config(base, 10).length == base.length


class RecordingEnv(env_api.Environment):
  """Scores 1 and keeps every completion, by prompt."""

  name = "recording"

  def __init__(self):
    self.completions = {}

  def encode_prompt(self, prompt):
    return TOK.encode(prompt.text, add_bos=True)

  def score(self, prompt, completion_ids):
    self.completions[prompt.prompt_id] = list(completion_ids)
    return 1.0


def test_fewer_greedy_slots_than_prompts_give_the_same_answers(model):
  """`eval_slots`: the prompts wait for a free slot; each answer is what a
  slot of its own gave, and the cache is the smaller one."""
  cfg, meshes, graphdef, params = model
  prompts = [env_api.TextPrompt(prompt_id=i, text=f"q{i} " * (1 + i % 4), answer="")
             for i in range(10)]
  engine_cfg = engine_config.EngineConfig(prompt_len=16, kv_cache="dense", decode_burst=1,
                                          precompile=False, num_slots=8, group_size=1,
                                          max_new_tokens=6)
  answers, slot_counts = [], []
  for slots in (0, 3):
    env = RecordingEnv()
    evaluator = evaluation.Evaluator(graphdef=graphdef, model_cfg=cfg, env=env, tokenizer=TOK,
                                     prompts=prompts, mesh=meshes.learner,
                                     engine_cfg=engine_cfg, slots=slots)
    assert evaluator(params).num_prompts == 10
    answers.append(env.completions)
    slot_counts.append(evaluator._generator.cfg.num_slots)  # (the cache it holds)
  assert slot_counts == [10, 3]
  assert answers[0] == answers[1] and len(answers[0]) == 10
  # Answers that could not be mixed up between prompts unnoticed.
  assert all(answers[0].values()) and len({tuple(a) for a in answers[0].values()}) > 1
