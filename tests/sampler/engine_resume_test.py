"""A checkpoint taken while segments are being sampled, and the engine that
resumes it: open segments continue from their recorded tokens."""

import itertools
import json
import time

import numpy as np
import pytest

from arl_jax.envs import env_api
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import orchestrator_config, work_record
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config, sampling
from arl_jax.testing import tiny
from tests.sampler import engine_test

PAD, EOS = 256, 258
NEW = 12


class _Publisher:
  def __init__(self, version, params):
    self.version, self.params = version, params

  def latest(self):
    return self.version, self.params


def _engine(setup, version, on_group, precompile=False, prefill_chunk=0):
  rng = np.random.default_rng(0)
  prompts = (env_api.TextPrompt(prompt_id=i, text="", answer="") for i in itertools.count())
  encode = lambda p: rng.integers(0, 256, 5).tolist()
  cfg = orchestrator_config.OrchestratorConfig(group_size=4, batch_size=8, max_async_level=0)
  dispatcher = dispatcher_lib.Dispatcher(cfg, prompts, encode, buffer_lib.RolloutBuffer(cfg))
  to_env = engine_test.single_turn_groups(on_group)

  def on_segment(episode):
    # As a run wires the engine (`rollouts.build`): the restart point first.
    dispatcher.work.at_env(episode)
    to_env(episode)

  engine = engine_lib.SamplerEngine(
      cfg=engine_config.EngineConfig(prompt_len=6, kv_cache="dense", decode_burst=1, num_slots=8,
                                     group_size=4, max_new_tokens=NEW, context_bucket=4,
                                     precompile=precompile, prefill_chunk=prefill_chunk),
      settings=sampling.SamplingSettings(eos_id=EOS, pad_id=PAD), graphdef=setup["graphdef"],
      model_cfg=setup["cfg"], mesh=setup["meshes"].sampler,
      publisher=_Publisher(version, setup["sampler_params"][version]), dispatcher=dispatcher,
      on_segment_fn=on_segment)
  return engine, dispatcher


def _wait(engine, condition, timeout=60.0):
  deadline = time.monotonic() + timeout
  while not condition() and time.monotonic() < deadline:
    engine.raise_if_failed()
    time.sleep(0.01)
  assert condition(), "the engine did not get there in time"


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


@pytest.fixture(scope="module")
def uninterrupted(setup):
  groups = {}
  engine, _ = _engine(setup, 0, lambda req, rs: groups.setdefault(req.group_id, rs))
  engine.start()
  _wait(engine, lambda: len(groups) >= 2)
  engine.stop()
  return groups


@pytest.fixture(scope="module")
def snapshot(setup):
  """Open work saved while the first two groups' segments are half sampled."""
  engine, dispatcher = _engine(setup, 0, lambda req, rs: None)
  engine.start()
  found = {}

  def half_sampled():
    with engine.paused():
      work = dispatcher.snapshot_work(engine.open_segments()).to_json()
    lengths = [len(e.get("open", {}).get("tokens", ())) for g in work["groups"]
               for e in g["episodes"]]
    if sum(2 <= n <= NEW - 3 for n in lengths) >= 4:
      found["work"] = work
    return "work" in found

  _wait(engine, half_sampled)
  engine.stop()
  return json.loads(json.dumps(found["work"]))


def _resume(setup, work, version, prefill_chunk=0):
  groups = {}
  on_group = lambda req, rs: groups.setdefault(req.group_id, rs)
  engine, dispatcher = _engine(setup, version, on_group, precompile=True,
                               prefill_chunk=prefill_chunk)
  restored = dispatcher.restore_work(work_record.WorkRecord.from_json(work))
  engine.restore([e for g in restored for e in g.to_sample])
  on_segment = engine_test.single_turn_groups(on_group)
  for episode in (e for g in restored for e in g.to_env):  # what an env runner would take
    on_segment(episode)
  engine.start()
  _wait(engine, lambda: {0, 1} <= set(groups))
  engine.stop()
  # Restored contexts (open segments) land in continuation buckets and come
  # in any number: the engine compiled those shapes too before admitting one.
  traces = engine.traces()
  assert sum(traces.values()) - traces["init"] == engine.stats.precompiled_programs, traces
  return groups


@pytest.mark.parametrize("prefill_chunk", [0, 4])
def test_open_segments_continue_into_the_uninterrupted_samples(setup, uninterrupted, snapshot,
                                                               prefill_chunk):
  """Same weights before and after: the resumed run samples what the
  uninterrupted one did (draws are keyed by the offset inside the segment),
  the restored contexts prefilled whole or in chunks of 4 columns (their open
  segments spanning chunks)."""
  resumed = _resume(setup, snapshot, version=0, prefill_chunk=prefill_chunk)
  for gid in (0, 1):
    for a, b in zip(uninterrupted[gid], resumed[gid]):
      np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
      np.testing.assert_array_equal(a.token_versions, b.token_versions)
      np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=1e-5)
      assert a.finish_reason == b.finish_reason


def test_the_rest_is_sampled_under_the_weights_live_at_resume(setup, snapshot):
  resumed = _resume(setup, snapshot, version=1)
  opened = 0
  for record in snapshot["groups"]:
    for index, saved in enumerate(record["episodes"]):
      if saved["stage"] != "sample":  # its segment had ended: nothing to continue
        continue
      rollout = resumed[record["group_id"]][index]
      kept = saved.get("open", {"tokens": [], "logprobs": [], "versions": []})
      k = len(kept["tokens"])
      opened += k > 0
      # The recorded start of the segment is kept as it was sampled...
      np.testing.assert_array_equal(rollout.completion_ids[:k], kept["tokens"])
      np.testing.assert_array_equal(rollout.token_versions[:k], kept["versions"])
      np.testing.assert_array_equal(rollout.behaviour_logprobs[:k],
                                    np.float32(kept["logprobs"]))
      # ...and the rest is version 1, whose log-probs the learner reproduces.
      assert set(rollout.token_versions[k:].tolist()) <= {1}
      want = engine_test.teacher_forced(setup, rollout, 1)[k:]
      np.testing.assert_allclose(rollout.behaviour_logprobs[k:], want, atol=1e-5)
  assert opened >= 4
