"""Every shape the engine can use is compiled before its first admission."""

import threading
import time

import jax
import numpy as np
import pytest

from arl_jax.core import group_request as group_request_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config, precompile, sampling
from arl_jax.testing import tiny
from tests.sampler.engine_test import ScriptedPublisher

PAD, EOS = 256, 258
PROMPT_LEN, NEW, SLOTS = 6, 8, 4
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_single_turn_groups_need_multiples_of_the_group_size_and_every_read():
  cfg = engine_config.EngineConfig(prompt_len=10, kv_cache="dense", decode_burst=1,
                                   precompile=False, num_slots=32, group_size=4,
                                   prompt_buckets=(6, 10), max_new_tokens=3, share_prompts=False)
  shapes = precompile.engine_shapes(cfg)
  assert shapes.insert == tuple((r, b) for b in (6, 10) for r in (4, 8, 16, 32))
  assert shapes.take_rows == (1, 2, 4, 8, 16, 32)
  assert not shapes.recompute and shapes.fork == ()
  assert shapes.num_programs == 8 + 6 + 1  # and decode


def test_shared_prompts_insert_a_row_per_group_and_fork_any_number():
  cfg = engine_config.EngineConfig(prompt_len=10, kv_cache="dense", decode_burst=1,
                                   precompile=False, num_slots=32, group_size=4,
                                   prompt_buckets=(6, 10), max_new_tokens=3)
  shapes = precompile.engine_shapes(cfg)
  # Up to 8 whole groups and the rest of one whose first rows came earlier.
  assert shapes.insert == tuple((r, b) for b in (6, 10) for r in (1, 2, 4, 8, 16))
  assert shapes.fork == (1, 2, 4, 8, 16, 32)
  assert shapes.num_programs == 10 + 6 + 6 + 1


def test_max_insert_rows_caps_the_insert_programs():
  """Admissions split into inserts of at most `max_insert_rows` (any number
  up to it): those row buckets, no wider; reads still take every slot."""
  cfg = engine_config.EngineConfig(prompt_len=10, kv_cache="dense", decode_burst=1,
                                   precompile=False, num_slots=32, group_size=4,
                                   prompt_buckets=(6, 10), max_new_tokens=3, share_prompts=False,
                                   max_insert_rows=6)
  shapes = precompile.engine_shapes(cfg)
  assert shapes.insert == tuple((r, b) for b in (6, 10) for r in (1, 2, 4, 6))
  assert shapes.take_rows == (1, 2, 4, 8, 16, 32)


def test_a_pool_that_can_preempt_prefills_longer_contexts_in_precompiled_chunks():
  """Preempted rows come back in any number with contexts of any length:
  those of a prompt bucket are inserted (every row count), longer ones are
  chunked (programs per row count, and per width unless attention reads
  blocks), so no length compiles mid-run."""
  full = engine_config.EngineConfig(prompt_len=16, decode_burst=1, precompile=False, num_slots=8,
                                    group_size=4, prompt_buckets=(6, 16), max_new_tokens=40,
                                    kv_cache="paged", page_size=8, attention_block=0)
  assert not full.can_preempt and full.chunk_columns == 0  # (every slot at full length)
  small = engine_config.EngineConfig(**{**full.__dict__, "kv_pages": 12})
  assert small.can_preempt and small.chunk_columns == 16
  assert not small.chunked(16) and small.chunked(17) and small.chunked(55)
  shapes = precompile.engine_shapes(small)
  assert shapes.insert == tuple((r, b) for b in (6, 16) for r in (1, 2, 4, 8))
  assert shapes.chunk == 16 and shapes.begin == (1, 2, 4, 8)
  assert {w for _, w in shapes.prefill} == {w for w in small.decode_widths if w >= 16}
  # Attention read in blocks: one chunk program per row count, whatever the width.
  blocks = engine_config.EngineConfig(**{**small.__dict__, "attention_block": 16})
  assert precompile.engine_shapes(blocks).prefill == tuple((r, None) for r in (1, 2, 4, 8))
  chunked = engine_config.EngineConfig(**{**small.__dict__, "prefill_chunk": 4})
  assert chunked.chunk_columns == 4  # (the configured chunk wins)


def test_restored_episodes_and_multi_turn_need_every_row_count_and_their_buckets():
  cfg = engine_config.EngineConfig(prompt_len=6, kv_cache="dense", decode_burst=1, precompile=False,
                                   num_slots=8, group_size=4, max_new_tokens=12, context_bucket=4,
                                   kv_policy="recompute")
  assert cfg.continuation_buckets == (6, 8, 12, 16, 20)
  # A checkpoint left contexts of 5 and 11 tokens: buckets 6 and 12.
  shapes = precompile.engine_shapes(cfg, restored_lengths=[5, 11])
  assert shapes.insert == tuple((r, b) for b in (6, 12) for r in (1, 2, 4, 8))
  # Inserts, reads, forks (shared prompts), decode and recompute.
  assert shapes.recompute and shapes.num_programs == 8 + 4 + 4 + 1 + 1
  multi = engine_config.EngineConfig(prompt_len=6, kv_cache="dense", decode_burst=1,
                                     precompile=False, num_slots=8, group_size=4, max_new_tokens=12,
                                     context_bucket=4, multi_turn=True)
  assert precompile.engine_shapes(multi).insert == tuple(
      (r, b) for b in (6, 8, 12, 16, 20) for r in (1, 2, 4, 8))


class _Requests:
  """Hands out `total` one-rollout groups, as many as the engine has room
  for, with budgets of 1 to NEW tokens: slots free at different steps, so
  admissions and reads take 1, 2, 3 or 4 rows."""

  def __init__(self, total: int):
    self._budgets = np.random.default_rng(0).integers(1, NEW + 1, total)
    self._prompts = np.random.default_rng(1).integers(0, 256, (total, PROMPT_LEN))
    self._next = 0

  def take(self, max_groups, live_version, timeout):
    n = min(max_groups, len(self._budgets) - self._next)
    if n == 0:
      time.sleep(timeout)
    ids = range(self._next, self._next + n)
    self._next += n
    return [group_request_lib.GroupRequest(
        group_id=i, prompt=i, prompt_ids=tuple(int(t) for t in self._prompts[i]),
        dispatch_version=live_version, group_size=1, dispatch_time=time.monotonic(),
        max_new_tokens=int(self._budgets[i])) for i in ids]

  def note_sampling(self, group_id, version):
    pass


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


def _run(setup, precompile_shapes: bool, total: int = 24, **engine_options):
  """`(engine, late)`: an engine that sampled `total` segments, and the
  compiles its thread ran after its first admission."""
  done = []
  engine = engine_lib.SamplerEngine(
      cfg=engine_config.EngineConfig(prompt_len=PROMPT_LEN, num_slots=SLOTS, group_size=1,
                                     max_new_tokens=NEW, precompile=precompile_shapes,
                                     **{"kv_cache": "dense", "decode_burst": 1,
                                        **engine_options}),
      settings=sampling.SamplingSettings(eos_id=EOS, pad_id=PAD), graphdef=setup["graphdef"],
      model_cfg=setup["cfg"], mesh=setup["meshes"].sampler,
      publisher=ScriptedPublisher(setup["sampler_params"][0], None, 0),
      dispatcher=_Requests(total), on_segment_fn=done.append)
  late = []

  def on_compile(event, duration, **kwargs):
    del duration
    # `stats.inserts` counts admissions once their prefill ran: a compile
    # then is one a batch waited for, long after the engine started.
    if (event == COMPILE_EVENT and threading.current_thread().name == "sampler-engine"
        and engine.stats.inserts > 0):
      late.append(kwargs.get("fun_name"))

  jax.monitoring.register_event_duration_secs_listener(on_compile)
  try:
    engine.start()
    deadline = time.monotonic() + 120
    while len(done) < total and time.monotonic() < deadline:
      engine.raise_if_failed()
      time.sleep(0.01)
    engine.stop()
  finally:
    jax.monitoring.unregister_event_duration_listener(on_compile)
  assert len(done) == total, "the engine did not finish in time"
  return engine, late


def test_no_compile_after_the_first_admission(setup):
  # Without precompiling, the same work compiles row buckets as they first
  # come: the run below does go through several of them.
  lazy, late = _run(setup, precompile_shapes=False)
  assert lazy.traces()["insert"] >= 2 and lazy.traces()["take_rows"] >= 2, lazy.traces()
  assert late, "every shape was compiled before the first admission anyway"
  assert lazy.stats.precompiled_programs == 0

  engine, late = _run(setup, precompile_shapes=True)
  assert late == []
  shapes = precompile.engine_shapes(engine_config.EngineConfig(prompt_len=PROMPT_LEN,
                                                               kv_cache="dense", decode_burst=1,
                                                               precompile=False, num_slots=SLOTS,
                                                               group_size=1, max_new_tokens=NEW))
  assert engine.stats.precompiled_programs == shapes.num_programs == 3 + 3 + 3 + 1
  # Each program traced once, at the first publish: no call traced again.
  assert engine.traces() == {"init": 1, "insert": 3, "fork": 3, "prefill": 0,
                             "decode": 1, "recompute": 0, "set_pages": 0, "take_rows": 3}
  assert engine.metrics()["sampler_precompile_s"] > 0


@pytest.mark.parametrize("attention_block", [0, 8])
def test_a_paged_engine_compiles_every_width_and_the_page_table_up_front(setup,
                                                                         attention_block):
  options = dict(kv_cache="paged", page_size=4, kv_policy="recompute", decode_burst=2,
                 attention_block=attention_block)
  engine, late = _run(setup, precompile_shapes=True, total=12, **options)
  assert late == []
  cfg = engine_config.EngineConfig(prompt_len=PROMPT_LEN, num_slots=SLOTS, group_size=1,
                                   max_new_tokens=NEW, **options)
  assert cfg.decode_widths == (8, 16, 24)  # 6 + 8 + 8 columns -> 24, 6 pages
  shapes = precompile.engine_shapes(cfg)
  # decode_rows at 1, 2 and 4 rows x 1 or 2 steps (bursts), x 3 widths
  # unless its attention reads blocks of 8 columns (then one program reads
  # 1 to 3 blocks); recompute at each width.
  decode = 3 * 2 * (1 if attention_block else 3)
  assert engine.stats.precompiled_programs == shapes.num_programs == (
      3 + 3 + 3 + decode + 3 + 1)
  assert engine.traces() == {"init": 1, "insert": 3, "fork": 3, "prefill": 0,
                             "decode": decode, "recompute": 3, "set_pages": 1, "take_rows": 3}
