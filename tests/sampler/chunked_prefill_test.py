"""Chunked prefill (`EngineConfig.prefill_chunk`): contexts wider than a
chunk enter their slots a chunk per engine iteration, between the other
slots' decode steps, and sample what a prefill in one call samples, dense or
paged, shared prompts or not, preempted or not, in every weight-update mode.
(Multi-turn re-admissions: `multi_turn_test.py`; restored open segments:
`engine_resume_test.py`.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.core import rows as rows_lib
from arl_jax.sampler import (
  engine_config,
  precompile,
  sampling,
  slot_fns,
  token_draw,
)
from arl_jax.testing import tiny
from tests.sampler.engine_test import ScriptedPublisher, _engine, _run_until, teacher_forced
from tests.sampler.paged_engine_test import (
  PAGED,
  SMALL_POOL,
  _check_pages,
  _groups,
  assert_exact_versions,
  assert_same_samples,
)

PROMPTS = dict(prompt_tokens=(1, 6))  # 1 to 6 tokens: whole, or 2 to 3 chunks of 2


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


@pytest.fixture(scope="module")
def whole(setup):
  """Groups whose prompts were prefilled in one call each (the reference)."""
  groups, engine = _groups(setup, ScriptedPublisher(setup["sampler_params"][0], None, 0),
                           **PROMPTS)
  assert engine.stats.prefill_chunks == 0
  return groups


def test_chunks_are_right_aligned_to_the_end_of_the_context():
  assert engine_config.chunk_starts(4, 2) == [0, 2]
  assert engine_config.chunk_starts(5, 4) == [0, 1]  # clamped at 0: overlaps the next
  assert engine_config.chunk_starts(16, 4) == [0, 4, 8, 12]
  with pytest.raises(ValueError, match="chunk"):
    engine_config.chunk_starts(3, 4)
  cfg = engine_config.EngineConfig(prompt_len=8, kv_cache="dense", decode_burst=1, precompile=False,
                                   num_slots=4, group_size=1, prompt_buckets=(4, 8),
                                   max_new_tokens=8, prefill_chunk=4)
  assert cfg.chunked(5) and not cfg.chunked(4)
  # Contexts of 5-8 tokens are all chunked: bucket 8 needs no insert program.
  assert cfg.chunks_all(8) and not cfg.chunks_all(4)
  with pytest.raises(ValueError, match="prefill_chunk"):
    engine_config.EngineConfig(prompt_len=6, kv_cache="dense", decode_burst=1, precompile=False,
                               num_slots=4, group_size=1, max_new_tokens=8, prefill_chunk=-1)


@pytest.mark.parametrize("paged,block", [(False, 0), (True, 0), (True, 12)],
                         ids=["dense", "paged", "paged-blocks"])
def test_a_chunked_prefill_fills_the_cache_an_insert_fills(setup, paged, block):
  """Slot functions alone: begin + chunks (of 8, some clamped at column 0)
  leave the slots as one insert (of a bucket of 32) does: the same first
  tokens, positions and columns, and the same next 10 tokens; paged, the
  chunks attend over 32 columns gathered at once, or read 12 (3 pages) at
  a time, as many blocks as the chunk's last column needs."""
  slots, length, page_size, bucket, chunk = 4, 64, 4, 32, 8
  pages = dict(num_pages=slots * length // page_size + 1, page_size=page_size) if paged else {}
  fns = slot_fns.make_sampler_fns(graphdef=setup["graphdef"], model_cfg=setup["cfg"],
                                  mesh=setup["meshes"].sampler,
                                  settings=sampling.SamplingSettings(eos_id=258, pad_id=256),
                                  num_slots=slots, length=length, **pages)
  params, version = setup["sampler_params"][0], jnp.int32(0)

  def fresh():
    state = fns.init()
    if paged:  # slot i holds pages 1 + i * 16 ...
      table = np.arange(1, slots * length // page_size + 1, dtype=np.int32)
      state = fns.set_pages(state, table.reshape(slots, length // page_size))
    return state

  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, n).tolist() for n in (30, 17, 9, 32)]
  tokens, mask = rows_lib.left_pad(prompts, bucket, 256)
  base, rows = np.asarray(jax.random.PRNGKey(0)), np.arange(slots, dtype=np.int32)
  key_ids = token_draw.key_ids(list(range(slots)), [0] * slots, [0] * slots)
  budget, stops = np.full(slots, 20, np.int32), np.ones((slots, 0), bool)
  ref = fns.insert_from_ids(params, version, fresh(), base, rows, tokens, mask, key_ids, budget,
                            stops, np.zeros(slots, np.int32),
                            np.zeros((slots, bucket), np.float32),
                            np.full((slots, bucket), -1, np.int32))
  plans = [engine_config.chunk_starts(len(p), chunk) for p in prompts]
  row_tokens, row_mask = rows_lib.right_pad(prompts, length, 256)
  state = fns.begin_prefill(
      fresh(), base, rows, row_tokens, row_mask, np.zeros((slots, length), np.float32),
      np.full((slots, length), -1, np.int32), key_ids, budget, stops,
      np.array([len(p) for p in prompts], np.int32), np.zeros(slots, np.int32),
      np.array([p[0] for p in plans], np.int32))
  for k in range(max(map(len, plans))):
    live = [i for i in range(slots) if k < len(plans[i])]
    live += [live[-1]] * (engine_config.row_bucket(len(live), slots) - len(live))
    starts = np.array([plans[i][k] for i in live], np.int32)
    args = (params, version, state, np.array(live, np.int32), starts,
            np.array([k == len(plans[i]) - 1 for i in live]))
    if block:
      count = np.int32((starts.max() + chunk - 1) // block + 1)
      state = fns.prefill_chunk(*args, count, chunk=chunk, width=None, block=block)
    else:
      state = fns.prefill_chunk(*args, chunk=chunk, width=bucket if paged else None)
  for field in ("index", "positions", "prompt_end", "limit", "done"):
    np.testing.assert_array_equal(getattr(state, field), getattr(ref, field), err_msg=field)
  for _ in range(10):
    ref = fns.decode(params, version, ref, np.zeros(slots, bool), np.ones(slots, bool))
    state = fns.decode(params, version, state, np.zeros(slots, bool), np.ones(slots, bool))
  np.testing.assert_array_equal(state.tokens, ref.tokens)
  np.testing.assert_allclose(state.logprobs, ref.logprobs, atol=1e-5)


@pytest.mark.parametrize("options", [
    dict(prefill_chunk=2, share_prompts=False), dict(prefill_chunk=4, **SMALL_POOL),
    dict(prefill_chunk=2, max_prefill_tokens=4, share_prompts=False)],
    ids=["dense-unshared", "paged-preempting", "dense-unshared-budget"])
def test_chunked_prefills_sample_what_whole_prefills_sample(setup, whole, options):
  chunked, engine = _groups(setup, ScriptedPublisher(setup["sampler_params"][0], None, 0),
                            **PROMPTS, **options)
  assert engine.stats.prefill_chunks > 0
  assert (engine.stats.forked_rows > 0) == options.get("share_prompts", True)
  if options.get("kv_pages"):
    assert engine.stats.preemptions > 0
  assert_same_samples(setup, whole, chunked)
  if options.get("kv_cache"):
    _check_pages(engine)


@pytest.mark.parametrize("mode,kv_policy,cache", [
    ("in_flight", "keep", PAGED), ("in_flight", "recompute", PAGED), ("pinned", "keep", {}),
    ("drain", "keep", PAGED)])
def test_chunked_prefills_record_exact_versions_across_updates(setup, mode, kv_policy, cache):
  """A swap in the middle of a prefill: `recompute` prefills the chunks done
  again under the new version, `pinned` finishes under the row's own,
  `drain` waits for it; `keep` goes on under the new one with the earlier
  chunks' keys and values as they were (as it does for decoding rows)."""
  v0, v1 = setup["sampler_params"]
  # Prompts of 5-6 tokens are 3 chunks of 2; the first groups' prefills
  # begin in the engine's first iteration and the swap lands in its third.
  groups, engine = _groups(setup, ScriptedPublisher(v0, v1, switch_after=2), mode,
                           kv_policy=kv_policy, prefill_chunk=2, prompt_tokens=(5, 6), **cache)
  assert engine.stats.prefill_chunks > 0 and engine.stats.swaps == 1
  if kv_policy == "recompute" or mode != "in_flight":
    assert_exact_versions(setup, groups, kv_policy)
  else:  # first tokens under v1 over v0's keys: exact only for what v0 sampled
    rollouts = [r for rs in groups.values() for r in rs]
    assert any(r.token_versions[0] == 1 for r in rollouts)
    for r in rollouts:
      n0 = int(np.sum(r.token_versions == 0))
      np.testing.assert_allclose(teacher_forced(setup, r, 0)[:n0], r.behaviour_logprobs[:n0],
                                 atol=1e-5)
  if cache:
    _check_pages(engine)


def test_live_slots_decode_between_the_chunks_of_a_long_prefill(setup):
  """A prefill of 3 chunks does not hold up the slots already decoding: the
  engine takes a decode step after each chunk."""
  calls = []
  groups = {}
  engine = _engine(ScriptedPublisher(setup["sampler_params"][0], None, 0), setup, "in_flight",
                   lambda req, rs: groups.setdefault(req.group_id, rs), max_async_level=1,
                   prompt_tokens=(5, 6), prefill_chunk=2,
                   # Group 1 ends after 2 tokens: group 2 comes in while group 0 decodes.
                   budget_fn=lambda prompt: 2 if prompt.prompt_id == 1 else None)
  fns = engine.runner.fns  # (the engine's device calls, logged in order)
  logged = lambda name, fn: lambda *a, **k: calls.append(name) or fn(*a, **k)
  fns = dataclasses.replace(fns, decode=logged("decode", fns.decode),
                            prefill_chunk=logged("chunk", fns.prefill_chunk))
  engine.runner.fns = fns
  _run_until(engine, lambda: len(groups) >= 4)
  # Each group's prompt takes 3 chunks; a group admitted while another
  # decodes interleaves: chunk, decode, chunk, decode, chunk.
  pattern = "".join("c" if name == "chunk" else "d" for name in calls)
  assert "cdcdc" in pattern, pattern


def test_chunk_programs_are_compiled_up_front(setup):
  """Begin and chunk programs per row bucket (and per width that holds a
  chunk: paged, those of `decode_widths` from the chunk's up), whatever the
  context's length, compiled with the rest up front."""
  from tests.sampler.precompile_test import SLOTS, _run
  engine, late = _run(setup, precompile_shapes=True, total=12, prefill_chunk=4)
  assert late == [] and engine.stats.prefill_chunks > 0
  geometry = dict(num_slots=SLOTS, group_size=1, prompt_len=6, max_new_tokens=8,
                  prefill_chunk=4, decode_burst=1, precompile=False)
  widths = engine_config.EngineConfig(kv_cache="paged", page_size=4, attention_block=0,
                                      **geometry)
  assert widths.decode_widths == (8, 16, 24) and widths.prefill_widths == (8, 16, 24)
  assert len(precompile.engine_shapes(widths).prefill) == 3 * 3
  # Paged attention read in blocks: a chunk program per row bucket.
  blocks = engine_config.EngineConfig(kv_cache="paged", page_size=4, attention_block=8,
                                      **geometry)
  assert precompile.engine_shapes(blocks).prefill == ((1, None), (2, None), (4, None))
  shapes = precompile.engine_shapes(engine_config.EngineConfig(kv_cache="dense",
                                                                  **geometry))
  assert shapes.begin == (1, 2, 4) and shapes.prefill == ((1, None), (2, None), (4, None))
  assert engine.traces()["prefill"] == len(shapes.begin) + len(shapes.prefill)
