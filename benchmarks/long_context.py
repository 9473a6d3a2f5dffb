r"""Long contexts in the sampler: the dense KV cache against the paged one.

  python benchmarks/long_context.py --out=/tmp/long_context.jsonl   # ~15 min on 2 cores
  python benchmarks/long_context.py --quick                         # seconds, tiny model
  python benchmarks/long_context.py --parts=group_prefill           # some parts only

Parts (every number measured in this run, side by side):

- `decode_step`: one decode step of 32 slots holding ~64 live tokens each
  (a 32-token prompt and 32 sampled), at slot limits (context lengths) of
  256 to 16,384 columns: the dense engine attends over every column of its
  `[slots, limit]` cache; the paged engine over the pages its slots hold,
  read a block of 128 columns at a time (`attention` "blocks", the
  default: `models/paged_blocks.py`), or rounded up to one of its compiled
  power-of-two widths and gathered at once ("widths",
  `attention_block=0`). Median of timed steps after a
  compiling one; with the decode roofline (`benchmarks/sampler.py`) at the
  live context, as a fraction of the measured step.
- `long_tail`: the engine on lognormal completion lengths (CPU-sized: median
  128, p99 ~1k, cap 2,048; enough requests that most of the run is steady
  state) at one KV memory budget: the dense engine gets budget / limit
  slots, the paged one (blocks, and widths) 8x the slots sharing a pool of
  the same bytes (preempting when it runs out). Sampling tokens/s (engine busy time, the
  compiles before the first admission excluded) and mean live slots.
- `group_prefill`: admitting a group of 16 samples of one 1,024-token prompt
  (dense and paged): one prefill per sample (`share_prompts=False`), against
  one prefill that the other 15 start from (`sampling.fork`; paged, sharing
  the prompt's pages), against admitting a single prompt. Median of timed
  admissions after a compiling one; the forked samples' first tokens come
  with the next decode step, which runs for the group either way.
- `chunked_prefill`: slots decoding short prompts when one or four long
  prompts (4,096 tokens) arrive together, paged: prefilled in one call
  (`prefill_chunk=0`) or in chunks between decode steps, with no prefill
  budget or one (`max_prefill_tokens`: a prompt, or two chunks, an
  iteration). The longest wait of a decoding slot between two steps
  (`sampler_max_decode_gap_s`: the iteration's prefills), the last long
  prompt's time to its first token, and sampling tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from arl_jax.core import group_request as group_request_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import (
  engine_config,
  insert_batch,
  kv_slots,
  page_pool,
  sampling,
  slot_fns,
  token_draw,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_harness  # noqa: E402  (benchmarks/engine_harness.py)
import report  # noqa: E402  (benchmarks/report.py, run as a script)
import sampler as sampler_bench  # noqa: E402  (benchmarks/sampler.py: models, roofline)

SETTINGS = sampler_bench.SETTINGS
PROMPT = 32


ATTENTION = engine_harness.ATTENTION


def _engine_cfg(slots, limit, attention, kv_pages=0, page_size=16):
  """An engine config whose slots hold `limit` columns (a 32-token prompt
  bucket, and one spare column for continuations: `EngineConfig.length`),
  attending as `ATTENTION[attention]`."""
  return engine_config.EngineConfig(prompt_len=PROMPT, num_slots=slots, group_size=1,
                                    max_new_tokens=limit - PROMPT - 1, context_bucket=1,
                                    **ATTENTION[attention], page_size=page_size, kv_pages=kv_pages,
                                    decode_burst=1, precompile=False)


# -- 1. One decode step at growing slot limits ---------------------------------------


def decode_step(cfg, meshes, graphdef, params, ecfg, live, repeats):
  """Median seconds of one decode step of `ecfg.num_slots` slots that hold a
  32-token prompt and `live - 32` sampled tokens, and the columns it attends over."""
  b = ecfg.num_slots
  fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                  settings=SETTINGS, num_slots=b, length=ecfg.length,
                                  num_pages=ecfg.pool_pages, page_size=ecfg.page_size)
  state = fns.init()
  if ecfg.paged:
    pool = page_pool.PagePool(num_pages=ecfg.pool_pages, page_size=ecfg.page_size,
                              num_slots=b, length=ecfg.length)
    for slot in range(b):  # the pages of every column the timed steps write
      assert pool.take(slot, 0, live + repeats + 1)
    state = fns.set_pages(state, pool.table)
  prompts = sampler_bench._prompts(b, PROMPT)  # noqa: SLF001
  budget = np.full((b,), ecfg.max_new_tokens, np.int32)
  keys = token_draw.row_keys(0, np.arange(b), np.zeros(b))
  state = fns.insert(params, jnp.int32(0), state, np.arange(b, dtype=np.int32), prompts,
                     np.ones(prompts.shape, bool), keys, budget)
  rows, stop = np.ones((b,), bool), np.zeros((b,), bool)
  version = jnp.int32(0)
  times = []
  for i in range(live - PROMPT + repeats):
    # The columns an engine reads: the blocks, or the width, that hold every slot's last one.
    width = ecfg.decode_span(PROMPT + i)
    start = time.perf_counter()
    if ecfg.paged:  # as a paged engine decodes: slots that need one span in one call
      args, kwargs = ecfg.attention_args(width)
      state = fns.decode_rows(params, version, state, stop, np.arange(b, dtype=np.int32),
                              *args, **kwargs)
    else:
      state = fns.decode(params, version, state, stop, rows)
    jax.block_until_ready(state.done)
    if i >= live - PROMPT:
      times.append(time.perf_counter() - start)
  return float(np.median(times)), width or ecfg.length


# -- 2. Long-tailed completions at one KV memory budget ---------------------------------


def long_tail(cfg, meshes, graphdef, params, ecfg, budgets):
  """Runs the engine until every request is done; its stats and wall seconds."""
  return engine_harness.run_engine(cfg, meshes, graphdef, params, ecfg, budgets,
                                   prompt_len=PROMPT, pad_id=SETTINGS.pad_id)


# -- 3. A group's prefill ------------------------------------------------------------------


def group_prefill(cfg, meshes, graphdef, params, ecfg, group, how, repeats):
  """Median seconds to admit `group` samples of one prompt of the engine's
  prompt bucket: `how` is "one" (a single sample), "each" (a prefill per
  sample) or "shared" (one prefill, the rest forked from it), as the engine
  does, pages included."""
  fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                  settings=SETTINGS, num_slots=ecfg.num_slots,
                                  length=ecfg.length, num_pages=ecfg.pool_pages,
                                  page_size=ecfg.page_size)
  bucket = ecfg.prompt_buckets[-1]
  prompt = sampler_bench._prompts(1, bucket)  # noqa: SLF001
  rows = 1 if how != "each" else group
  slots = np.arange(rows, dtype=np.int32)
  budget = np.full((rows,), ecfg.max_new_tokens, np.int32)
  forks = np.arange(1, group, dtype=np.int32)
  fork = insert_batch.ForkBatch(
      src=np.zeros((group - 1,), np.int32), dst=forks,
      key_ids=token_draw.key_ids(np.zeros(group - 1), forks),
      max_new=np.full((group - 1,), ecfg.max_new_tokens, np.int32),
      stop_mask=np.ones((group - 1, 0), bool))
  base_key = np.asarray(jax.random.PRNGKey(0))
  times = []
  for _ in range(repeats + 1):
    state, kv = fns.init(), kv_slots.make(ecfg)
    jax.block_until_ready(state.done)
    start = time.perf_counter()
    for slot in slots:  # the host's page book, as the engine's admission keeps it
      assert kv.admit(int(slot), bucket)
    if how == "shared":
      for slot in forks:
        assert kv.admit_fork(int(slot), 0, bucket)
    table = kv.page_table()
    if table is not None:
      state = fns.set_pages(state, table)
    state = fns.insert_from_ids(
        params, jnp.int32(0), state, base_key, slots, np.repeat(prompt, rows, 0),
        np.ones((rows, bucket), bool), token_draw.key_ids(np.zeros(rows), slots), budget,
        np.ones((rows, 0), bool), np.zeros((rows,), np.int32),
        np.zeros((rows, bucket), np.float32), np.full((rows, bucket), -1, np.int32))
    if how == "shared":
      state = fns.fork(state, base_key, *fork.args())
    jax.block_until_ready(state.done)
    times.append(time.perf_counter() - start)
  return float(np.median(times[1:]))


# -- 4. A long prompt arriving while slots decode --------------------------------------


LONG_ID = 10 ** 6  # the long prompt's group id


class _LongPromptLater(engine_harness.Requests):
  """`Requests` whose last `count` requests (long prompts, one token of
  budget each) come together once the engine has taken `after_steps` decode
  steps."""

  def __init__(self, budgets, prompt_len, long_len, stats, after_steps, count=1):
    super().__init__(budgets, prompt_len)
    self._long = np.random.default_rng(5).integers(0, 256, (count, long_len))
    self._stats, self._after_steps = stats, after_steps
    self.sent = self.first_token = None

  def take(self, max_groups, live_version, timeout):
    requests = super().take(max_groups, live_version, timeout)
    if self.sent is None and self._stats().steps >= self._after_steps and max_groups >= len(
        requests) + len(self._long):
      self.sent = time.monotonic()
      requests += [group_request_lib.GroupRequest(
          group_id=LONG_ID + i, prompt=LONG_ID + i, prompt_ids=tuple(int(t) for t in long),
          dispatch_version=live_version, group_size=1, dispatch_time=self.sent,
          max_new_tokens=1) for i, long in enumerate(self._long)]
    return requests


def chunked_prefill(cfg, meshes, graphdef, params, ecfg, short, budget, long_len, count=1):
  """Runs `short` requests of `budget` tokens and, once they decode, `count`
  of `long_len` prompt tokens; the engine's stats, the seconds to the last
  long prompt's first token and the wall seconds."""
  engine_box = []
  requests = _LongPromptLater([budget] * short, PROMPT, long_len,
                              lambda: engine_box[0].stats, after_steps=8, count=count)
  done = []

  def on_segment(episode):
    if episode.group_id >= LONG_ID:
      requests.first_token = time.monotonic()
    done.append(episode)

  engine = engine_lib.SamplerEngine(
      cfg=ecfg, settings=sampling.SamplingSettings(eos_id=10 ** 6, pad_id=SETTINGS.pad_id),
      graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
      publisher=engine_harness.Params(params), dispatcher=requests, on_segment_fn=on_segment)
  engine_box.append(engine)
  start = time.perf_counter()
  engine.start()
  while len(done) < short + count:
    engine.raise_if_failed()
    time.sleep(0.01)
  seconds = time.perf_counter() - start
  engine.stop()
  return engine.stats, requests.first_token - requests.sent, seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, small sizes")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--parts", default="decode_step,long_tail,group_prefill,chunked_prefill",
                      help="comma-separated parts to run")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  rows = []
  emit = lambda row: (rows.append(row), print(json.dumps(row), flush=True))
  name = "tiny" if args.quick else "3M"
  # --quick: one limit (compiles dominate), past one attention block (128 columns).
  limits = (256,) if args.quick else (256, 1024, 4096, 16384)
  slots, live, repeats = (4, 36, 2) if args.quick else (32, 64, 5)
  cfg, meshes, graphdef, params = sampler_bench._model(name, limits[-1])  # noqa: SLF001
  flops_peak, bytes_peak = sampler_bench.machine_peaks(512 if args.quick else 2048,
                                                       16 if args.quick else 256)
  base = {}
  for limit in limits if "decode_step" in parts else ():
    for attention in ATTENTION:
      ecfg = _engine_cfg(slots, limit, attention, page_size=16)
      if ecfg.paged:  # a pool for the live work (and the trash page)
        ecfg = _engine_cfg(slots, limit, attention, page_size=16,
                           kv_pages=max(slots * ((live + repeats) // 16 + 1) + 1,
                                         ecfg.pages_per_slot + 1))
      seconds, width = decode_step(cfg, meshes, graphdef, params, ecfg, live, repeats)
      base.setdefault(attention, seconds)
      bound = sampler_bench.decode_step_roofline(cfg, slots, live, flops_peak, bytes_peak)
      emit({"benchmark": "long_context", "part": "decode_step", "model": name,
            "kv_cache": ecfg.kv_cache, "attention": attention, "slots": slots, "limit": limit,
            "live_tokens": live, "width": width, "step_ms": round(seconds * 1e3, 2),
            "vs_limit_256": round(seconds / base[attention], 2),
            "roofline_fraction": round(bound / seconds, 3)})
  if "long_tail" in parts:
    # Long tail at one KV budget: the dense engine's slots x limit columns.
    # --quick: few requests, short slots: fewer row buckets and widths to compile.
    limit = 64 if args.quick else 2048
    n = 4 if args.quick else 384
    median = 8 if args.quick else 128
    rng = np.random.default_rng(7)
    # sigma: p99 (z = 2.33) ~ 16x the median.
    budgets = np.clip(rng.lognormal(np.log(median), np.log(16) / 2.33, n), 1,
                      limit - PROMPT).astype(np.int32)
    dense_slots = 4 if args.quick else 8
    budget_columns = dense_slots * limit
    for attention in ATTENTION:
      num_slots = dense_slots if attention == "dense" else 8 * dense_slots
      ecfg = _engine_cfg(num_slots, limit, attention,
                         kv_pages=budget_columns // 16 + 1 if attention != "dense" else 0)
      # Compiled up front (but for --quick): the clock times sampling only.
      ecfg = engine_config.EngineConfig(**{**ecfg.__dict__, "precompile": not args.quick})
      stats, seconds = long_tail(cfg, meshes, graphdef, params, ecfg, budgets)
      emit({"benchmark": "long_context", "part": "long_tail", "model": name,
            "kv_cache": ecfg.kv_cache, "attention": attention, "slots": num_slots,
            "kv_columns": budget_columns, "requests": n,
            "median_len": int(np.median(budgets)), "p99_len": int(np.percentile(budgets, 99)),
            "max_len": int(budgets.max()), "tokens": stats.sampled_tokens,
            "tokens_per_s": round(stats.sampled_tokens / max(stats.busy_seconds, 1e-9), 1),
            "wall_s": round(seconds, 1), "mean_live_slots": round(stats.occupancy * num_slots, 2),
            "preemptions": stats.preemptions, "kv_pages_peak": stats.kv_pages_peak,
            "precompile_s": round(stats.precompile_seconds, 1),
            "programs": stats.precompiled_programs})
    tail = {r["attention"]: r for r in rows if r["part"] == "long_tail"}
    for attention in ("blocks", "widths"):
      emit({"benchmark": "long_context", "part": "long_tail_ratio", "attention": attention,
            "tokens_per_s_ratio": round(tail[attention]["tokens_per_s"]
                                        / tail["dense"]["tokens_per_s"], 2),
            "live_slots_ratio": round(tail[attention]["mean_live_slots"]
                                      / tail["dense"]["mean_live_slots"], 2)})
  if "group_prefill" in parts:
    # A group's prefill: 16 samples of a 1,024-token prompt.
    group, prompt_len = (4, 64) if args.quick else (16, 1024)
    for kv_cache in ("dense", "paged"):
      ecfg = engine_config.EngineConfig(prompt_len=prompt_len, decode_burst=1, precompile=False,
                                        num_slots=group, group_size=group, max_new_tokens=63,
                                        context_bucket=1, kv_cache=kv_cache, page_size=16)
      seconds = {how: group_prefill(cfg, meshes, graphdef, params, ecfg, group, how,
                                    repeats=1 if args.quick else 3)
                 for how in ("one", "each", "shared")}
      emit({"benchmark": "long_context", "part": "group_prefill", "model": name,
            "kv_cache": kv_cache, "group": group, "prompt_tokens": prompt_len,
            "one_prompt_ms": round(seconds["one"] * 1e3, 1),
            "prefill_each_ms": round(seconds["each"] * 1e3, 1),
            "shared_ms": round(seconds["shared"] * 1e3, 1),
            "each_vs_one": round(seconds["each"] / seconds["one"], 2),
            "shared_vs_one": round(seconds["shared"] / seconds["one"], 2)})
  if "chunked_prefill" in parts:
    long_len, short, budget = (128, 2, 16) if args.quick else (4096, 7, 256)
    # (prefill_chunk, long prompts arriving together, max_prefill_tokens)
    # --quick: an engine per case compiles its programs; (0, 4, 0) is left out (its
    # paths: one-call prefill, several long prompts at once, run in the others).
    cases = ([(0, 1, 0), (32, 1, 0), (0, 4, long_len)] if args.quick else
             [(0, 1, 0), (256, 1, 0), (1024, 1, 0), (0, 4, 0), (0, 4, long_len),
              (1024, 4, 0), (1024, 4, 2048)])
    for chunk, count, prefill_tokens in cases:
      ecfg = engine_config.EngineConfig(prompt_len=long_len, decode_burst=1,
                                        num_slots=short + count, group_size=1,
                                        prompt_buckets=(PROMPT, long_len), max_new_tokens=budget,
                                        context_bucket=1, kv_cache="paged", page_size=16,
                                        prefill_chunk=chunk, max_prefill_tokens=prefill_tokens,
                                        precompile=not args.quick)
      stats, first_token, seconds = chunked_prefill(cfg, meshes, graphdef, params, ecfg, short,
                                                    budget, long_len, count)
      emit({"benchmark": "long_context", "part": "chunked_prefill", "model": name,
            "prefill_chunk": chunk, "max_prefill_tokens": prefill_tokens,
            "decoding_slots": short, "long_prompts": count, "long_prompt": long_len,
            "max_decode_gap_ms": round(stats.max_decode_gap_seconds * 1e3, 1),
            "last_long_first_token_ms": round(first_token * 1e3, 1),
            "chunk_calls": stats.prefill_chunks,
            "tokens_per_s": round(stats.sampled_tokens / max(stats.busy_seconds, 1e-9), 1),
            "wall_s": round(seconds, 1)})
  print()
  for part in dict.fromkeys(r["part"] for r in rows):
    report.print_table([r for r in rows if r["part"] == part], title=part)
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
