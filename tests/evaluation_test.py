"""Greedy evaluation: environment faults end an episode with reward 0 and are counted."""

import collections

import pytest

from arl_jax import evaluation
from arl_jax.envs import env_api
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.sampler import engine_config
from arl_jax.testing import tiny

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
