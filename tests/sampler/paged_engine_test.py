"""The sampler engine with a paged KV cache: the same rollouts as the dense
engine, exact behaviour log-probs in every weight-update mode, preemption
when the pool runs out, pages back at once on cancellation."""

import numpy as np
import pytest

from arl_jax.sampler import engine_config, kv_slots, segments
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny
from tests.sampler.engine_test import NEW, ScriptedPublisher, _engine, _run_until, teacher_forced

# Decode attention reads blocks of 8 columns (2 pages): 1 to 3 of them a step.
PAGED = dict(kv_cache="paged", page_size=4, attention_block=8)
# 8 slots x 6 pages of 4 columns (6 + 8 + 8 = 22 -> 24 columns) would need 49;
# 12 usable pages hold two full slots: the engine must preempt.
SMALL_POOL = dict(PAGED, kv_pages=13)


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


def _check_pages(engine):
  """Only occupied slots hold pages, and every page is free or held (by one
  slot, or by the samples sharing a prompt)."""
  engine.scheduler.check()  # (free slots hold no pages; `PagePool.check`)


def _groups(setup, publisher, mode="in_flight", n=4, **options):
  groups = {}
  engine = _engine(publisher, setup, mode, lambda req, rs: groups.setdefault(req.group_id, rs),
                   max_async_level=1, **options)
  _run_until(engine, lambda: len(groups) >= n)
  return groups, engine


def assert_same_samples(setup, reference, groups, n=4):
  """The first `n` groups of `groups` sampled the tokens of `reference`'s
  (`{group id: rollouts}` each), with log-probs within 1e-5 of theirs and of
  the learner's teacher-forced ones under version 0."""
  for gid in range(n):
    for a, b in zip(reference[gid], groups[gid]):
      np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
      np.testing.assert_allclose(b.behaviour_logprobs, a.behaviour_logprobs, atol=1e-5)
      np.testing.assert_allclose(teacher_forced(setup, b, 0), b.behaviour_logprobs, atol=1e-5)


def assert_exact_versions(setup, groups, kv_policy):
  """Every rollout of `groups` (`{group id: rollouts}`, sampled across a swap
  from v0 to v1) records rising versions, and log-probs of the params that
  ran: v0's for its v0 tokens, v1's for the rest when the keys and values
  were v1's too (recomputed, or a segment pinned to v1)."""
  for r in (r for rollouts in groups.values() for r in rollouts):
    versions = r.token_versions
    assert np.all(np.diff(versions) >= 0) and set(versions) <= {0, 1}
    n0 = int(np.sum(versions == 0))
    np.testing.assert_allclose(teacher_forced(setup, r, 0)[:n0], r.behaviour_logprobs[:n0],
                               atol=1e-5)
    if kv_policy == "recompute" or n0 == 0:
      np.testing.assert_allclose(teacher_forced(setup, r, 1)[n0:], r.behaviour_logprobs[n0:],
                                 atol=1e-5)


@pytest.mark.parametrize("attention_block", [8, 0])  # (0: a program per width)
def test_paged_engines_sample_what_the_dense_engine_samples(setup, attention_block):
  v0, _ = setup["sampler_params"]
  dense, _ = _groups(setup, ScriptedPublisher(v0, None, 0))
  small, tight = _groups(setup, ScriptedPublisher(v0, None, 0),
                         **dict(SMALL_POOL, attention_block=attention_block))
  assert tight.stats.preemptions > 0
  assert tight.stats.kv_pages_peak == tight.stats.kv_pages == 12
  _check_pages(tight)
  # The draws depend only on (group, sample, turn, offset), and the
  # log-probs agree to rounding: the same tokens, preempted or not.
  assert_same_samples(setup, dense, small)
  assert all(np.all(s.token_versions == 0) for gid in range(4) for s in small[gid])


@pytest.mark.parametrize("mode,kv_policy", [("in_flight", "recompute"), ("pinned", "keep")])
def test_weight_updates_record_exact_versions_with_a_small_pool(setup, mode, kv_policy):
  v0, v1 = setup["sampler_params"]
  groups, engine = _groups(setup, ScriptedPublisher(v0, v1, switch_after=3), mode, n=4,
                           kv_policy=kv_policy, **SMALL_POOL)
  assert engine.stats.swaps == 1 and engine.stats.preemptions > 0
  for gid, rollouts in groups.items():
    for r in rollouts:
      versions = r.token_versions
      assert np.all(np.diff(versions) >= 0) and set(versions) <= {0, 1}
      if mode == "pinned" and gid == 0:
        # Started before the swap; a preempted segment goes on under the live
        # version when it comes back (as a re-admitted turn does).
        assert versions[0] == 0
      n0 = int(np.sum(versions == 0))
      # Tokens sampled under v0 with an all-v0 prefix carry v0's probability;
      # after the swap, whatever mix of cached keys produced a token, its
      # recorded version and log-prob are those of the params that ran.
      np.testing.assert_allclose(teacher_forced(setup, r, 0)[:n0], r.behaviour_logprobs[:n0],
                                 atol=1e-5)
      if kv_policy == "recompute" or mode == "pinned":
        tail = teacher_forced(setup, r, 1)[n0:]
        np.testing.assert_allclose(tail, r.behaviour_logprobs[n0:], atol=1e-5)


def test_cancellation_gives_the_pages_back_at_once(setup):
  v0, _ = setup["sampler_params"]
  box, applied = {}, []

  def cancel_first(requests):
    if requests and requests[0].group_id == 0:
      box["engine"].cancel([0])
    return requests

  groups = []
  engine = _engine(ScriptedPublisher(v0, None, 0), setup, "in_flight",
                   lambda req, rs: groups.append(req.group_id), take_hook=cancel_first,
                   max_async_level=1, **PAGED)
  box["engine"] = engine
  pages, original = engine.scheduler.pages, engine.scheduler.apply_cancellations

  def apply_and_count():
    before = pages.in_use
    original()
    if before != pages.in_use:
      applied.append((before, pages.in_use))

  engine.scheduler.apply_cancellations = apply_and_count
  _run_until(engine, lambda: len(groups) >= 2)
  assert 0 not in groups and engine.stats.cancelled_rollouts == 4
  # Group 0's first slot held 2 pages of 4 columns (its 4-token context in
  # columns 0-3, its first sample's in 4); the three forks of its prompt two
  # of their own each (a copy of the page of the prompt's last column, and
  # the next); the cancellation returned them before the next step.
  (before, after), = applied
  assert before - after == 2 + 3 * 2
  _check_pages(engine)


def test_a_preempted_row_keeps_its_open_segment_for_a_checkpoint(setup):
  """A preempted row waits with what it sampled; a snapshot then
  (`open_segments`) reads it as it reads an occupied slot's segment."""
  v0, _ = setup["sampler_params"]
  engine = _engine(ScriptedPublisher(v0, None, 0), setup, "in_flight", lambda *_: None,
                   max_async_level=1, **SMALL_POOL)
  for _ in range(200):  # driven an iteration at a time: it stops before the row is admitted again
    engine.iterate()
    if engine.stats.preemptions:
      break
  partials = engine.open_segments()
  preempted = [row.episode for row in engine.scheduler.waiting if row.episode.open_tokens]
  assert preempted
  for episode in preempted:
    tokens, logprobs, versions = partials[(episode.group_id, episode.sample_index)]
    assert 1 <= len(tokens) < NEW
    assert list(tokens) == episode.open_tokens and list(versions) == [0] * len(tokens)
    assert list(logprobs) == episode.open_logprobs


def test_alternatives_are_the_learner_s_top_k_and_survive_preemption(setup, monkeypatch):
  """With `top_logprobs=3` every sampled token records the 3 most likely
  tokens of the distribution it was drawn from (the learner's at lag 0), a
  segment preempted and prefilled again included: its open tokens' come from
  the episode, the rest from the slot."""
  v0, _ = setup["sampler_params"]
  preempted, ended = set(), []
  keep = kv_slots.keep_open_segment

  def keep_and_note(episode, segment):
    preempted.add((episode.group_id, episode.sample_index))
    return keep(episode, segment)

  monkeypatch.setattr(kv_slots, "keep_open_segment", keep_and_note)
  _, engine = _groups(setup, ScriptedPublisher(v0, None, 0), top_logprobs=3,
                      on_segment=ended.append, **SMALL_POOL)
  assert engine.stats.preemptions > 0
  assert preempted & {(e.group_id, e.sample_index) for e in ended}
  for episode in ended:
    ids, logps = episode.last_alternatives
    n = len(episode.completion_ids)
    assert ids.shape == logps.shape == (n, 3) and (ids != segments.NO_ALTERNATIVE).all()
    context = [*episode.prompt_ids, *episode.completion_ids]
    learner = slots_lib.teacher_forced_distributions(setup["graphdef"], setup["params"][0],
                                                     context)[len(episode.prompt_ids) - 1:-1]
    np.testing.assert_allclose(logps, -np.sort(-learner, axis=1)[:, :3], atol=1e-5)
    np.testing.assert_allclose(np.take_along_axis(learner, ids, axis=1), logps, atol=1e-5)
    for token, logprob, row_ids, row_logps in zip(episode.completion_ids, episode.logprobs,
                                                  ids, logps):
      if token in row_ids:
        assert logprob == pytest.approx(row_logps[list(row_ids).index(token)], abs=1e-6)


def test_config_checks():
  with pytest.raises(ValueError, match="kv_cache: must be one of"):
    engine_config.EngineConfig(prompt_len=6, decode_burst=1, precompile=False, num_slots=8,
                               group_size=4, max_new_tokens=8, kv_cache="ragged")
  with pytest.raises(ValueError, match=r"kv_pages: 6 pages cannot hold one sequence.*needs >= 7"):
    engine_config.EngineConfig(prompt_len=6, num_slots=8, group_size=4, max_new_tokens=8,
                               kv_pages=6, **PAGED)
  cfg = engine_config.EngineConfig(prompt_len=100, num_slots=8, group_size=4,
                                   prompt_buckets=(6, 100), max_new_tokens=1000, **PAGED)
  assert cfg.length == 1116 and cfg.pool_pages == 8 * 279 + 1
  assert cfg.decode_widths == (8, 16, 32, 64, 128, 256, 512, 1024, 1116)
  assert cfg.width_for(7) == 8 and cfg.width_for(8) == 16 and cfg.width_for(1115) == 1116
  dense = engine_config.EngineConfig(prompt_len=6, kv_cache="dense", decode_burst=1,
                                     precompile=False, num_slots=8, group_size=4, max_new_tokens=8)
  assert dense.decode_widths == (None,) and dense.pool_pages == 0 and dense.length == 22
