"""The sampler engine thread: in-flight weight swaps, drain, and cancellation."""

import itertools
import time

import numpy as np
import pytest

from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import publish as publish_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import sampling
from arl_jax.testing import tiny

PAD, EOS = 256, 258
PROMPT_LEN, NEW = 6, 8


class _Prompt:
  def __init__(self, i):
    self.prompt_id = i


class ScriptedPublisher:
  """Serves version 0 for the first `switch_after` calls of `latest()`, then version 1."""

  def __init__(self, v0, v1, switch_after):
    self._v0, self._v1, self._switch_after = v0, v1, switch_after
    self._calls = 0

  def latest(self):
    self._calls += 1
    return (0, self._v0) if self._calls <= self._switch_after or self._v1 is None else (1, self._v1)


def _published(meshes, sampler_shardings, params):
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
  publisher.publish(params, 0)
  return publisher.latest()[1]


def _engine(publisher, graphdef, meshes, weight_update, on_group, take_hook=None,
            prompt_tokens=4):
  cfg = dispatcher_lib.DispatchConfig(group_size=4, groups_per_batch=2, max_async_level=0,
                                      max_off_policy_steps=4)
  buffer = buffer_lib.RolloutBuffer(buffer_lib.BufferConfig())
  rng = np.random.default_rng(0)
  prompts = (_Prompt(i) for i in itertools.count())
  encode = lambda p: rng.integers(0, 256, prompt_tokens).tolist()
  dispatcher = dispatcher_lib.Dispatcher(cfg, prompts, encode, buffer)
  if take_hook is not None:
    original = dispatcher.take
    dispatcher.take = lambda *a, **k: take_hook(original(*a, **k))
  engine = engine_lib.SamplerEngine(
      cfg=engine_lib.EngineConfig(num_slots=8, group_size=4, prompt_len=PROMPT_LEN,
                                  max_new_tokens=NEW, weight_update=weight_update),
      settings=sampling.SamplingSettings(eos_id=EOS, pad_id=PAD), graphdef=graphdef,
      mesh=meshes.sampler, publisher=publisher, dispatcher=dispatcher, on_group_fn=on_group)
  return engine


def _run_until(engine, groups, count, timeout=60.0):
  engine.start()
  deadline = time.monotonic() + timeout
  while len(groups) < count and time.monotonic() < deadline:
    engine.raise_if_failed()
    time.sleep(0.05)
  engine.stop()
  assert len(groups) >= count, f"engine produced {len(groups)} groups, wanted {count}"


def _setup():
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(
      tiny.tiny_model_config(), meshes)
  params_v1 = tiny.perturb(params, 0.05, seed=3)
  return (meshes, graphdef, params, _published(meshes, sampler_shardings, params),
          _published(meshes, sampler_shardings, params_v1))


def _full_sequences(rollout):
  tokens = np.full((PROMPT_LEN + NEW,), PAD, np.int32)
  mask = np.zeros(tokens.shape, bool)
  p, c = len(rollout.prompt_ids), len(rollout.completion_ids)
  tokens[PROMPT_LEN - p:PROMPT_LEN] = rollout.prompt_ids
  tokens[PROMPT_LEN:PROMPT_LEN + c] = rollout.completion_ids
  mask[PROMPT_LEN - p:PROMPT_LEN + c] = True
  return tokens, mask


def test_in_flight_swap_between_decode_steps_records_exact_versions():
  meshes, graphdef, learner_params, v0, v1 = _setup()
  # latest() calls: 1 at the loop top, then 1 per decode step: steps 0 and 1
  # decode under v0, step 2 onwards under v1.
  publisher = ScriptedPublisher(v0, v1, switch_after=3)
  groups = []
  engine = _engine(publisher, graphdef, meshes, "in_flight", lambda req, rs: groups.append(rs))
  _run_until(engine, groups, 2)
  assert engine.stats.swaps >= 1
  rollouts = [r for g in groups[:2] for r in g]
  assert len(rollouts) == 8
  for r in rollouts:
    n = len(r.completion_ids)
    expected = np.array([0, 0, 0, 1, 1, 1, 1, 1][:n])
    np.testing.assert_array_equal(r.token_versions, expected)
    assert r.dispatch_version == 0
    if n > 3:
      assert r.version_span == (0, 1)
    # Tokens sampled under v0 (all of their prefix was v0 too) carry v0's probability.
    tokens, mask = _full_sequences(r)
    logp, _ = logprobs_lib.token_logprobs_and_entropy(graphdef, learner_params, tokens[None],
                                                      mask[None], 1.0)
    v0_cols = slice(PROMPT_LEN, PROMPT_LEN + min(n, 3))
    np.testing.assert_allclose(np.asarray(logp)[0, v0_cols], r.behaviour_logprobs[:min(n, 3)],
                               atol=1e-5)


def test_drain_finishes_the_wave_on_its_starting_version():
  meshes, graphdef, _, v0, v1 = _setup()
  publisher = ScriptedPublisher(v0, v1, switch_after=1)
  groups = []
  engine = _engine(publisher, graphdef, meshes, "drain", lambda req, rs: groups.append(rs))
  _run_until(engine, groups, 2)
  for r in (r for g in groups[:2] for r in g):
    assert np.all(r.token_versions == 0)


def test_cancelled_group_is_not_emitted_and_its_compute_is_saved():
  meshes, graphdef, _, v0, _ = _setup()
  publisher = ScriptedPublisher(v0, None, switch_after=0)
  groups, engine_box = [], {}

  def cancel_first(requests):
    if requests and requests[0].group_id == 0:
      engine_box["engine"].cancel([0])
    return requests

  engine = _engine(publisher, graphdef, meshes, "in_flight",
                   lambda req, rs: groups.append((req.group_id, rs)), take_hook=cancel_first)
  engine_box["engine"] = engine
  _run_until(engine, groups, 1)
  assert [gid for gid, _ in groups][:1] == [1]
  assert engine.stats.cancelled_rollouts == 4
  # Each cancelled row sampled only its prefill token before being stopped.
  assert engine.stats.cancelled_tokens == 4 * (NEW - 1)


def test_a_prompt_longer_than_the_bucket_fails_with_a_clear_error():
  meshes, graphdef, _, v0, _ = _setup()
  engine = _engine(ScriptedPublisher(v0, None, 0), graphdef, meshes, "in_flight",
                   lambda *_: None, prompt_tokens=PROMPT_LEN + 3)
  engine.start()
  deadline = time.monotonic() + 60
  with pytest.raises(RuntimeError, match="sampler engine failed") as info:
    while time.monotonic() < deadline:
      engine.raise_if_failed()
      time.sleep(0.02)
  engine.stop(raise_errors=False)
  assert "prompt has 9 tokens; the sampler takes 1 to sampler.prompt_len=6" in str(
      info.value.__cause__)
