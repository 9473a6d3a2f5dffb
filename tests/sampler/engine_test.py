"""The sampler engine thread: continuous batching, weight-update modes, cancellation."""

import itertools
import time

import numpy as np
import pytest

from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config, sampling
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny

PAD, EOS = 256, 258
PROMPT_LEN, NEW = 6, 8


class _Prompt:
  def __init__(self, i):
    self.prompt_id = i


class ScriptedPublisher:
  """Serves version 0 for the first `switch_after` calls of `latest()`, then version 1.

  The engine calls `latest()` once per loop iteration (before inserting and
  decoding), which makes the moment of the swap deterministic.
  """

  def __init__(self, v0, v1, switch_after):
    self._v0, self._v1, self._switch_after = v0, v1, switch_after
    self.calls = 0

  def latest(self):
    self.calls += 1
    if self._v1 is None or self.calls <= self._switch_after:
      return 0, self._v0
    return 1, self._v1


def single_turn_groups(on_group_fn):
  """An `on_segment_fn` that ends every episode after one segment and calls
  `on_group_fn(request, rollouts)` once a group's G rollouts are in."""
  partial = {}

  def on_segment(episode):
    rollouts = partial.setdefault(episode.group_id, [])
    rollouts.append(episode.to_rollout(
        finish_reason="stop" if episode.last_stopped else "length"))
    if len(rollouts) == episode.request.group_size:
      del partial[episode.group_id]
      on_group_fn(episode.request, sorted(rollouts, key=lambda r: r.sample_index))

  return on_segment


# What a run leaves to auto or turns on for long runs, fixed for these tests
# (their waits count decode steps: one a call).
HAND_BUILT = dict(kv_cache="dense", decode_burst=1, precompile=False)


def _engine(publisher, setup, weight_update, on_group, *, kv_policy="keep", take_hook=None,
            prompt_tokens=(4, 4), max_async_level=0, budget_fn=None, top_logprobs=0,
            on_segment=None, **engine_options):
  """An engine over `setup`'s tiny model; `on_group(request, rollouts)` gets
  each finished group; `on_segment(episode)` (optional) sees each segment first."""
  meshes, graphdef, cfg = setup["meshes"], setup["graphdef"], setup["cfg"]
  dispatch = orchestrator_config.OrchestratorConfig(group_size=4, batch_size=8,
                                               max_async_level=max_async_level,
                                               max_off_policy_steps=4)
  buffer = buffer_lib.RolloutBuffer(dispatch)
  rng = np.random.default_rng(0)
  prompts = (_Prompt(i) for i in itertools.count())
  encode = lambda p: rng.integers(0, 256, rng.integers(prompt_tokens[0],
                                                       prompt_tokens[1] + 1)).tolist()
  dispatcher = dispatcher_lib.Dispatcher(dispatch, prompts, encode, buffer,
                                         budget_fn=budget_fn)
  if take_hook is not None:
    original = dispatcher.take
    dispatcher.take = lambda *a, **k: take_hook(original(*a, **k))
  return engine_lib.SamplerEngine(
      cfg=engine_config.EngineConfig(prompt_len=PROMPT_LEN, num_slots=8, group_size=4,
                                     max_new_tokens=NEW, weight_update=weight_update,
                                     kv_policy=kv_policy,
                                     **{**HAND_BUILT, **engine_options}),
      settings=sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, top_logprobs=top_logprobs),
      graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler, publisher=publisher,
      dispatcher=dispatcher, on_segment_fn=_watched(single_turn_groups(on_group), on_segment))


def _watched(on_segment_fn, watch):
  if watch is None:
    return on_segment_fn

  def both(episode):
    watch(episode)
    on_segment_fn(episode)
  return both


def _run_until(engine, condition, timeout=60.0):
  engine.start()
  deadline = time.monotonic() + timeout
  while not condition() and time.monotonic() < deadline:
    engine.raise_if_failed()
    time.sleep(0.02)
  engine.stop()
  assert condition(), "the engine did not get there in time"


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


def teacher_forced(setup, rollout, version):
  tokens = np.concatenate([rollout.prompt_ids, rollout.completion_ids])
  logp = slots_lib.teacher_forced_logprobs(setup["graphdef"], setup["params"][version], tokens,
                                           np.ones(tokens.shape, bool))[0]
  return logp[len(rollout.prompt_ids):]


def test_a_prompt_with_its_own_budget_stops_there(setup):
  """`max_new_tokens_for` budgets (capped at the sampler's) end completions early."""
  v0, _ = setup["sampler_params"]
  groups = {}
  budgets = {0: 3, 1: 100, 2: 1}  # 100 is capped at NEW; other prompts get NEW
  engine = _engine(ScriptedPublisher(v0, None, 0), setup, "in_flight",
                   lambda req, rs: groups.setdefault(req.prompt.prompt_id, rs),
                   budget_fn=lambda p: budgets.get(p.prompt_id), max_async_level=1)
  _run_until(engine, lambda: len(groups) >= 4)
  for prompt_id in range(4):
    want = min(budgets.get(prompt_id, NEW), NEW)
    for r in groups[prompt_id]:
      assert len(r.completion_ids) <= want
      if r.finish_reason == "length":
        assert len(r.completion_ids) == want


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_in_flight_swap_between_decode_steps_records_exact_versions(setup, kv_policy):
  v0, v1 = setup["sampler_params"]
  # Iterations 1-3 decode under v0 (insert + 3 steps = 4 tokens), then v1;
  # a group's other samples start from its first one's prefill and sample
  # their first token in iteration 1 (3 tokens under v0).
  publisher = ScriptedPublisher(v0, v1, switch_after=3)
  groups = []
  engine = _engine(publisher, setup, "in_flight", lambda req, rs: groups.append(rs),
                   kv_policy=kv_policy)
  _run_until(engine, lambda: len(groups) >= 2)
  assert engine.stats.swaps == 1
  for r in (r for g in groups[:2] for r in g):
    n = len(r.completion_ids)
    under_v0 = 4 if r.sample_index == 0 else 3
    np.testing.assert_array_equal(r.token_versions, ([0] * under_v0 + [1] * 8)[:n])
    assert r.dispatch_version == 0 and (n <= under_v0 or r.version_span == (0, 1))
    before = min(n, under_v0)
    # Tokens sampled under v0 (their whole prefix was v0 too) carry v0's probability.
    np.testing.assert_allclose(teacher_forced(setup, r, 0)[:before],
                               r.behaviour_logprobs[:before], atol=1e-5)
    if kv_policy == "recompute" and n > 4:
      # After a recompute the cache is what a fresh prefill under v1 gives.
      np.testing.assert_allclose(teacher_forced(setup, r, 1)[4:], r.behaviour_logprobs[4:],
                                 atol=1e-5)


@pytest.mark.parametrize("mode", ["pinned", "in_flight"])
def test_pinned_rollouts_keep_their_start_version_and_later_ones_use_the_new(setup, mode):
  v0, v1 = setup["sampler_params"]
  publisher = ScriptedPublisher(v0, v1, switch_after=3)
  groups = {}
  engine = _engine(publisher, setup, mode, lambda req, rs: groups.setdefault(req.group_id, rs),
                   max_async_level=1)
  _run_until(engine, lambda: len(groups) >= 4)
  for gid in (0, 1):  # started before the swap
    for r in groups[gid]:
      if mode == "pinned":
        assert np.all(r.token_versions == 0)
        np.testing.assert_allclose(teacher_forced(setup, r, 0), r.behaviour_logprobs,
                                   atol=1e-5)
      else:
        assert r.version_span == (0, 1)
  for gid in (2, 3):  # started after it
    for r in groups[gid]:
      assert np.all(r.token_versions == 1)
      np.testing.assert_allclose(teacher_forced(setup, r, 1), r.behaviour_logprobs, atol=1e-5)


def test_drain_finishes_active_slots_on_their_version_then_swaps(setup):
  v0, v1 = setup["sampler_params"]
  publisher = ScriptedPublisher(v0, v1, switch_after=1)
  groups = {}
  engine = _engine(publisher, setup, "drain", lambda req, rs: groups.setdefault(req.group_id, rs),
                   max_async_level=1)
  _run_until(engine, lambda: len(groups) >= 4)
  for gid, rollouts in groups.items():
    want = 0 if gid < 2 else 1
    assert all(np.all(r.token_versions == want) for r in rollouts), gid
  assert engine.stats.swaps == 1


def test_cancellation_frees_slots_at_once(setup):
  v0, _ = setup["sampler_params"]
  groups, seen, box = [], {}, {}

  def cancel_first(requests):
    if requests and requests[0].group_id == 0:
      box["engine"].cancel([0])
    return requests

  def on_group(req, rollouts):
    groups.append(req.group_id)
    seen.setdefault(req.group_id, box["engine"].stats.inserts)

  engine = _engine(ScriptedPublisher(v0, None, 0), setup, "in_flight", on_group,
                   take_hook=cancel_first, max_async_level=1)
  box["engine"] = engine
  _run_until(engine, lambda: len(groups) >= 2)
  assert 0 not in groups
  assert engine.stats.cancelled_rollouts == 4
  # Group 0 was cancelled after its insert and one decode step: its first
  # sample had sampled two tokens, the three that share its prefill one.
  assert engine.stats.forked_rows >= 3
  assert engine.stats.cancelled_tokens == (NEW - 2) + 3 * (NEW - 1)
  # Its four slots were refilled (group 2) while group 1 was still decoding.
  assert seen[1] == 12


def test_mixed_prompt_lengths_in_one_bucket_compile_once(setup):
  v0, _ = setup["sampler_params"]
  groups = []
  engine = _engine(ScriptedPublisher(v0, None, 0), setup, "in_flight",
                   lambda req, rs: groups.append(rs), prompt_tokens=(1, PROMPT_LEN),
                   max_async_level=3)
  _run_until(engine, lambda: len(groups) >= 6)
  lengths = {len(r.prompt_ids) for g in groups for r in g}
  assert len(lengths) > 2
  traces = engine.traces()
  assert traces["decode"] == 1
  # One insert program per power-of-two row count at most (1, 2, 4, 8 rows).
  assert 1 <= traces["insert"] <= 4
  assert 0 < engine.stats.occupancy <= 1


def test_a_prompt_longer_than_the_bucket_fails_with_a_clear_error(setup):
  v0, _ = setup["sampler_params"]
  engine = _engine(ScriptedPublisher(v0, None, 0), setup, "in_flight", lambda *_: None,
                   prompt_tokens=(PROMPT_LEN + 3, PROMPT_LEN + 3))
  engine.start()
  deadline = time.monotonic() + 60
  with pytest.raises(RuntimeError, match="sampler engine failed") as info:
    while time.monotonic() < deadline:
      engine.raise_if_failed()
      time.sleep(0.02)
  engine.stop(raise_errors=False)
  assert "prompt has 9 tokens; the sampler takes 1 to 6" in str(info.value.__cause__)
