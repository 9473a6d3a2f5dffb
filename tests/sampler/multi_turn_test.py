"""Multi-turn episodes through the real engine and env runner: an environment
appends observation tokens, the episode leaves its slot while the tool runs, and
is re-admitted (re-prefilled) under the weights live at that moment."""

import itertools
import threading
import time

import numpy as np
import pytest

from arl_jax.envs import env_api
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import env_runner as env_runner_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config, sampling
from arl_jax.testing import tiny
from tests.sampler.engine_test import ScriptedPublisher, teacher_forced

PAD, EOS = 256, 258
PROMPT_LEN, NEW, G = 6, 16, 4
OBSERVATION = [200, 201]
# Half of the byte values end a segment, so random weights end segments quickly.
STOPS = tuple(range(128))


class _Prompt:
  def __init__(self, i):
    self.prompt_id = i


class SlowToolEnv(env_api.MultiTurnEnvironment):
  """Answers every stop with OBSERVATION after `latency_s`, for up to `max_turns` segments."""

  name = "slow_tool"
  stop_ids = STOPS

  def __init__(self, latency_s, max_turns=3):
    self.latency_s, self.max_turns = latency_s, max_turns

  def encode_prompt(self, prompt):
    return [1, 2, 3]

  def step(self, prompt, completion_ids):
    time.sleep(self.latency_s)
    segments = 1 + sum(1 for i in range(len(completion_ids) - 1)
                       if completion_ids[i + 1] == OBSERVATION[0]
                       and completion_ids[i] in STOPS)
    return None if segments >= self.max_turns else list(OBSERVATION)

  def score(self, prompt, completion_ids):
    return float(len(completion_ids))


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


def _run(setup, publisher, weight_update, latency_s, num_groups, context_bucket=8,
         **engine_options):
  dispatch = orchestrator_config.OrchestratorConfig(group_size=G, batch_size=2 * G, max_async_level=0,
                                               max_off_policy_steps=4)
  buffer = buffer_lib.RolloutBuffer(dispatch)
  rng = np.random.default_rng(0)
  prompts = (_Prompt(i) for i in itertools.count())
  encode = lambda p: rng.integers(0, 256, rng.integers(2, PROMPT_LEN + 1)).tolist()
  dispatcher = dispatcher_lib.Dispatcher(dispatch, prompts, encode, buffer)
  groups, done = [], threading.Event()

  def on_group(group):
    groups.append(group)
    dispatcher.finished_generating(group.group_id)
    dispatcher.retire([group.group_id])
    if len(groups) >= num_groups:
      done.set()

  # Compiled lazily: these tests are about versions, and precompiling the 16
  # insert shapes (4 row buckets x 4 continuation buckets) costs ~25 s cold.
  cfg = engine_config.EngineConfig(prompt_len=PROMPT_LEN, num_slots=8, group_size=G,
                                   max_new_tokens=NEW, weight_update=weight_update, multi_turn=True,
                                   context_bucket=context_bucket, precompile=False,
                                   **{"kv_cache": "dense", "decode_burst": 1, **engine_options})
  runner = env_runner_lib.EnvRunner(SlowToolEnv(latency_s), on_group_fn=on_group,
                                    max_new_tokens=NEW, num_workers=8, timeout_s=10.0)
  engine = engine_lib.SamplerEngine(
      cfg=cfg, settings=sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, stop_ids=STOPS),
      graphdef=setup["graphdef"], model_cfg=setup["cfg"], mesh=setup["meshes"].sampler,
      publisher=publisher, dispatcher=dispatcher, on_segment_fn=runner.submit)
  runner.connect(engine.resume)
  engine.start()
  deadline = time.monotonic() + 120
  while not done.is_set() and time.monotonic() < deadline:
    engine.raise_if_failed()
    runner.raise_if_failed()
    time.sleep(0.02)
  dispatcher.close()
  engine.stop()
  runner.close()
  assert done.is_set(), "the episodes did not finish in time"
  return groups, engine, runner


def _segments(rollout):
  """Column slices of each sampled segment of a rollout's completion."""
  sampled = rollout.loss_mask > 0
  edges = np.flatnonzero(np.diff(np.concatenate([[0], sampled.astype(int), [0]])))
  return [slice(a, b) for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("weight_update,prefill_chunk", [
    ("pinned", 0), ("drain", 0), ("pinned", 4)])
def test_readmitted_segments_are_sampled_under_the_weights_live_at_readmission(
    setup, weight_update, prefill_chunk):
  v0, v1 = setup["sampler_params"]
  # The swap lands while the first episodes wait for their tool (0.3 s).
  publisher = ScriptedPublisher(v0, v1, switch_after=6)
  # prefill_chunk: contexts longer than 4 tokens (most re-admissions) are prefilled
  # in chunks of 4 between decode steps, under the version they start on.
  groups, engine, runner = _run(setup, publisher, weight_update, latency_s=0.3, num_groups=2,
                                prefill_chunk=prefill_chunk)
  rollouts = [r for g in groups for r in g.rollouts]
  # (the runner may have handed back more than the engine admitted before it stopped)
  assert 0 < engine.stats.resumes <= runner.turns
  spans = set()
  for r in rollouts:
    assert len(r.completion_ids) <= NEW
    observed = r.loss_mask == 0
    assert np.all(r.token_versions[observed] == -1)
    assert np.all(r.behaviour_logprobs[observed] == 0)
    for cols in _segments(r):
      # A segment runs on one version in these modes, and a re-admission
      # re-prefills the whole context: its log-probs are a fresh prefill's.
      (version,) = set(r.token_versions[cols].tolist())
      np.testing.assert_allclose(r.behaviour_logprobs[cols],
                                 teacher_forced(setup, r, version)[cols], atol=1e-5)
    spans.add(r.version_span)
  assert (0, 1) in spans, spans  # some episodes span the swap
  # Re-admissions compile one insert per (context bucket, power-of-two row count) at most.
  buckets = engine_config.EngineConfig(prompt_len=PROMPT_LEN, kv_cache="dense", decode_burst=1,
                                       precompile=False, num_slots=8, group_size=G,
                                       max_new_tokens=NEW, multi_turn=True, context_bucket=8).continuation_buckets
  traces = engine.traces()
  assert 1 <= traces["insert"] <= len(buckets) * 4
  assert (engine.stats.prefill_chunks > 0) == bool(prefill_chunk)
  assert traces["decode"] == 1


def test_in_flight_versions_never_decrease_within_an_episode(setup):
  v0, v1 = setup["sampler_params"]
  publisher = ScriptedPublisher(v0, v1, switch_after=6)
  groups, _, _ = _run(setup, publisher, "in_flight", latency_s=0.2, num_groups=2)
  for r in (r for g in groups for r in g.rollouts):
    sampled = r.token_versions[r.loss_mask > 0]
    assert np.all(np.diff(sampled) >= 0)
    for cols in _segments(r):
      if np.all(r.token_versions[cols] == 1):  # admitted after the swap
        np.testing.assert_allclose(r.behaviour_logprobs[cols],
                                   teacher_forced(setup, r, 1)[cols], atol=1e-5)


def test_continuation_buckets_cover_every_context_without_eating_the_budget():
  cfg = engine_config.EngineConfig(prompt_len=8, kv_cache="dense", decode_burst=1, precompile=False,
                                   num_slots=4, group_size=2, prompt_buckets=(4, 8),
                                   max_new_tokens=20, multi_turn=True, context_bucket=6)
  assert cfg.continuation_buckets == (4, 8, 12, 18, 24, 30)
  for prompt in range(1, 9):
    for used in range(0, 20):
      n = prompt + used
      bucket = next(b for b in cfg.continuation_buckets if b >= n)
      assert bucket + (20 - used) <= cfg.length
