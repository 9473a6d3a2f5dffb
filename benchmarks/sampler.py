r"""Sampler engine benchmarks: KV cache vs recompute, continuous vs static
batching, roofline fraction, the pause of an in-flight weight swap, the
engine's tokens/s with decode bursts (several steps per device call), and
what recording top log-probs costs (`--parts=top_logprobs`).

  python benchmarks/sampler.py --out=/tmp/sampler.jsonl          # ~10 min on 2 cores
  python benchmarks/sampler.py --quick                           # seconds, tiny model
  python benchmarks/sampler.py --parts=engine_burst              # some parts only

Every number is measured in this run, side by side, after a warm-up call that
compiles; timings are medians of repeats where cheap, else one timed run.
Rows are printed as a table and appended as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arl_jax.config import base_config
from arl_jax.learner import publish as publish_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import init_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config, sampling, slot_fns, token_draw
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_harness  # noqa: E402  (benchmarks/engine_harness.py)
import report  # noqa: E402  (benchmarks/report.py, run as a script)

PAD, EOS = 256, 258
MODELS = {
    "tiny": base_config.TINY_MODEL,
    "3M": dict(d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=768),
    "50M": dict(d_model=640, num_layers=10, num_heads=10, num_kv_heads=5, head_dim=64,
                mlp_dim=1920),
}
SETTINGS = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD)


def _model(name, max_seq_len, vocab_size=259):
  cfg = model_config_lib.ModelConfig(vocab_size=vocab_size, max_seq_len=max_seq_len,
                                     **MODELS[name])
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(), devices=jax.devices()[:1])
  graphdef, params, _ = init_lib.init_params(cfg, meshes.sampler, rules_lib.SAMPLER_RULES, 0)
  return cfg, meshes, graphdef, params


def _prompts(n, length, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (n, length)).astype(np.int32)


def _block(state):
  jax.block_until_ready(state.done)
  return state


# -- 1. KV-cache decode vs recomputing the full forward ---------------------------


def kv_cache_decode(fns, params, prompts, new_tokens):
  """Seconds to insert B prompts and sample `new_tokens` tokens each."""
  b = prompts.shape[0]
  args = (np.arange(b, dtype=np.int32), prompts, np.ones(prompts.shape, bool),
          token_draw.row_keys(0, np.arange(b), np.zeros(b)), np.full((b,), new_tokens, np.int32))
  rows, stop = np.ones((b,), bool), np.zeros((b,), bool)
  start = time.perf_counter()
  state = fns.insert(params, jnp.int32(0), fns.init(), *args)
  for _ in range(new_tokens - 1):
    state = fns.decode(params, jnp.int32(0), state, stop, rows)
  _block(state)
  return time.perf_counter() - start


def no_cache_decode(graphdef, params, prompts, new_tokens, bucket=16):
  """Seconds to sample the same tokens by a full forward per step (no KV cache).

  With `bucket < length` the sequence is cut to the next multiple of `bucket`
  columns each step, so the cost grows with the length like a careful no-cache
  loop (one compile per width, done before timing). With `bucket = None` every
  step runs the whole fixed-size buffer, as a simple loop with one compiled
  shape does (`examples/minimal_grpo.py`).
  """
  b, p = prompts.shape
  total = p + new_tokens
  bucket = total if bucket is None else bucket

  @jax.jit
  def step(params, tokens, mask, keys, column):
    model = nnx.merge(graphdef, params)
    logits, _ = model(tokens, decoder_lib.positions_from_mask(mask),
                      decoder_lib.causal_mask(mask))
    last = jnp.take_along_axis(logits, (column - 1)[None, None, None].repeat(b, 0), axis=1)[:, 0]
    return token_draw.sample_from_logits(last, keys, column - p, SETTINGS)

  keys = token_draw.row_keys(0, np.arange(b), np.zeros(b))
  tokens = np.full((b, total), PAD, np.int32)
  tokens[:, :p] = prompts
  mask = np.zeros((b, total), bool)
  mask[:, :p] = True
  width = lambda col: min(-(-(col + 1) // bucket) * bucket, total)
  for w in sorted({width(col) for col in range(p, total)}):  # compile every width
    jax.block_until_ready(step(params, tokens[:, :w], mask[:, :w], keys, jnp.int32(p)))
  start = time.perf_counter()
  for col in range(p, total):
    w = width(col)
    tok, *_ = step(params, tokens[:, :w], mask[:, :w], keys, jnp.int32(col))
    tokens[:, col] = np.asarray(tok)
    mask[:, col] = True
  return time.perf_counter() - start


# -- 2. Continuous vs static batching on heavy-tailed lengths ----------------------


def batching(fns, params, prompts, lengths, num_slots, continuous):
  """Generated tokens per second serving all requests with `num_slots` slots."""
  n = len(lengths)
  queue = collections.deque(range(n))
  slots = [None] * num_slots
  stop = np.zeros((num_slots,), bool)
  all_rows = np.ones((num_slots,), bool)
  state = fns.init()
  produced = 0
  start = time.perf_counter()

  def insert(free):
    nonlocal state
    items = [(s, queue.popleft()) for s in free[:len(queue)]]
    if not items:
      return
    r = 1 << (len(items) - 1).bit_length()
    items += [items[-1]] * (r - len(items))
    idx = np.array([q for _, q in items])
    state = fns.insert(params, jnp.int32(0), state, np.array([s for s, _ in items], np.int32),
                       prompts[idx], np.ones(prompts[idx].shape, bool),
                       token_draw.row_keys(0, idx, np.zeros(len(idx))), lengths[idx])
    for s, q in items:
      slots[s] = q

  while queue or any(s is not None for s in slots):
    free = [i for i, s in enumerate(slots) if s is None]
    if free and queue and (continuous or len(free) == num_slots):
      insert(free)
    state = fns.decode(params, jnp.int32(0), state, stop, all_rows)
    done = np.asarray(state.done)
    for i, q in enumerate(slots):
      if q is not None and done[i]:
        produced += int(lengths[q])
        slots[i] = None
  return produced / (time.perf_counter() - start)


# -- 3. Roofline --------------------------------------------------------------------


def machine_peaks(size=2048, mib=256):
  """Measured float32 matmul FLOP/s and memory bandwidth (bytes/s) of this machine."""
  a = jnp.ones((size, size), jnp.float32)
  mm = jax.jit(lambda x: x @ x)
  mm(a).block_until_ready()
  t = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(5))
  flops = 2 * size ** 3 / t
  # Read bandwidth (a reduction): a decode step mostly reads weights and cache.
  x = jnp.ones((mib * 2 ** 20 // 4,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  t = min(_timed(lambda: total(x).block_until_ready()) for _ in range(5))
  return flops, x.nbytes / t


def _timed(fn):
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def decode_step_roofline(cfg, num_slots, context, flops_peak, bytes_peak):
  """Lower bound in seconds of one decode step over `num_slots` slots."""
  matmul_params = cfg.num_params - cfg.vocab_size * cfg.d_model * (not cfg.tie_embeddings)
  flops = num_slots * (2 * (matmul_params + cfg.vocab_size * cfg.d_model)
                       + 4 * cfg.num_layers * context * cfg.num_heads * cfg.head_dim)
  kv_bytes = num_slots * cfg.num_layers * 2 * cfg.num_kv_heads * context * cfg.head_dim * 4
  param_bytes = cfg.num_params * 4
  return max(flops / flops_peak, (param_bytes + kv_bytes) / bytes_peak)


# -- 4. Pause per in-flight swap ------------------------------------------------------


def swap_pause(cfg, meshes, graphdef, params, num_slots, kv_policy, seconds, publish_every,
               quick=False):
  """Runs the engine while a thread publishes new versions; returns its stats."""
  _, abstract = init_lib.abstract_model(cfg)
  shardings = rules_lib.state_shardings(abstract, meshes.sampler, rules_lib.SAMPLER_RULES)
  publisher = publish_lib.WeightPublisher(meshes.learner, shardings)
  other = jax.tree.map(lambda x: x * 1.01, params)
  publisher.publish(params, 0)
  group = 4
  dispatch = orchestrator_config.OrchestratorConfig(
      group_size=group, batch_size=group * num_slots, max_async_level=10 ** 6,
      max_off_policy_steps=10 ** 6)
  prompts = iter(lambda: type("P", (), {"prompt_id": 0})(), None)
  rng = np.random.default_rng(0)
  dispatcher = dispatcher_lib.Dispatcher(dispatch, prompts,
                                         lambda p: rng.integers(0, 256, 16).tolist(),
                                         buffer_lib.RolloutBuffer(dispatch))
  engine = engine_lib.SamplerEngine(
      cfg=engine_config.EngineConfig(prompt_len=16, kv_cache="dense", decode_burst=1,
                                     precompile=False, num_slots=num_slots, group_size=group,
                                     max_new_tokens=128, kv_policy=kv_policy),
      settings=SETTINGS, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
      publisher=publisher, dispatcher=dispatcher, on_segment_fn=lambda _: None)
  stop = threading.Event()

  def publish_loop():
    version = 10 ** 6
    while not stop.wait(publish_every):
      version += 1
      publisher.publish(params if version % 2 else other, version)
      dispatcher.on_publish(version)

  engine.start()
  if quick:  # the same warm-up, waited for instead of slept through (seconds of a quick run)
    _wait_for(engine, lambda: engine.stats.steps > 0)  # insert/decode compiled
    publisher.publish(other, 10 ** 6)  # one swap outside the window (compiles a recompute)
    _wait_for(engine, lambda: engine.stats.swaps >= 1)
  else:
    time.sleep(2.0)  # compile insert/decode before the clock starts mattering
    publisher.publish(other, 10 ** 6)  # one swap outside the window (compiles a recompute)
    time.sleep(1.0)
  base = dataclasses_snapshot(engine.stats)
  thread = threading.Thread(target=publish_loop)
  thread.start()
  time.sleep(seconds)
  stop.set()
  thread.join()
  engine.stop()
  now = dataclasses_snapshot(engine.stats)
  return {k: now[k] - base[k] for k in now}


def _wait_for(engine, condition, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not condition():
    engine.raise_if_failed()
    if time.monotonic() > deadline:
      raise TimeoutError("the engine did not get there")
    time.sleep(0.01)


def dataclasses_snapshot(stats):
  return {"swaps": stats.swaps, "swap_seconds": stats.swap_seconds,
          "decode_seconds": stats.decode_seconds, "steps": stats.steps}


# -- 5. The engine with decode bursts --------------------------------------------------


def engine_bursts(cfg, meshes, graphdef, params, num_slots, budgets, bursts, prompt_len,
                  precompile=True):
  """The engine's sampling tokens/s (busy time: decode, prefill, swaps; the
  compiles before its first admission excluded) and device calls per token,
  at each `decode_burst`, on the same requests."""
  rows = []
  for burst in bursts:
    ecfg = engine_config.EngineConfig(prompt_len=prompt_len, kv_cache="dense", num_slots=num_slots,
                                      group_size=1, max_new_tokens=int(budgets.max()),
                                      precompile=precompile, decode_burst=burst)
    stats, _ = engine_harness.run_engine(cfg, meshes, graphdef, params, ecfg, budgets,
                                         prompt_len=prompt_len, pad_id=PAD)
    rows.append({"decode_burst": burst, "tokens": stats.sampled_tokens,
                 "tokens_per_s": round(stats.sampled_tokens / stats.busy_seconds, 1),
                 "decode_calls": stats.model_passes,
                 "steps_per_call": round(stats.steps / max(stats.model_passes, 1), 2),
                 "decode_s": round(stats.decode_seconds, 2),
                 "prefill_s": round(stats.prefill_seconds, 2),
                 "occupancy": round(stats.occupancy, 3)})
  return rows


# -- 6. Recording top log-probs -------------------------------------------------------


def engine_top_logprobs(cfg, meshes, graphdef, params, num_slots, budgets, ks, prompt_len):
  """The engine's sampling tokens/s recording K alternatives per token (a
  top-k over the vocabulary each step, `[B, L, K]` more state), each K on
  the same requests."""
  rows = []
  for k in ks:
    ecfg = engine_config.EngineConfig(prompt_len=prompt_len, kv_cache="dense", num_slots=num_slots,
                                      group_size=1, max_new_tokens=int(budgets.max()),
                                      precompile=True, decode_burst=4)
    stats, _ = engine_harness.run_engine(cfg, meshes, graphdef, params, ecfg, budgets,
                                         prompt_len=prompt_len, pad_id=PAD, top_logprobs=k)
    rows.append({"top_logprobs": k, "tokens": stats.sampled_tokens,
                 "tokens_per_s": round(stats.sampled_tokens / stats.busy_seconds, 1),
                 "decode_s": round(stats.decode_seconds, 2)})
  return rows


# -- main -----------------------------------------------------------------------------


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, small sizes")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--parts", default="kv_vs_no_cache,continuous_vs_static,engine_burst",
                      help="comma-separated parts (continuous_vs_static includes swap_pause)")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  rows = []
  emit = lambda row: (rows.append(row), print(json.dumps(row), flush=True))
  prompt_len, new_tokens = 16, (16 if args.quick else 128)
  sizes = ["tiny"] if args.quick else ["3M", "50M"]
  slot_counts = {"tiny": [4], "3M": [8, 32], "50M": [8, 32]}
  flops_peak, bytes_peak = machine_peaks(512 if args.quick else 2048, 16 if args.quick else 256)
  # The longest completion (and the slot buffers past the prompt): short in
  # --quick, where compiling every width is most of the time.
  max_len = 64 if args.quick else 256
  emit({"benchmark": "sampler", "part": "machine", "matmul_gflops": round(flops_peak / 1e9, 1),
        "read_gbps": round(bytes_peak / 1e9, 2)})
  for name in sizes:
    cfg, meshes, graphdef, params = _model(name, prompt_len + max_len)
    for b in slot_counts[name] if "kv_vs_no_cache" in parts else ():
      fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                        settings=SETTINGS, num_slots=b,
                                        length=prompt_len + new_tokens)
      prompts = _prompts(b, prompt_len)
      kv_cache_decode(fns, params, prompts, new_tokens)  # compile
      kv = min(kv_cache_decode(fns, params, prompts, new_tokens) for _ in range(2))
      row = {"benchmark": "sampler", "part": "kv_vs_no_cache", "model": name,
             "params_m": round(cfg.num_params / 1e6, 2), "slots": b, "new_tokens": new_tokens,
             "kv_tokens_per_s": round(b * new_tokens / kv, 1)}
      if name != "50M" or b == 8:  # the 50M no-cache loops at 32 slots take minutes
        grown = no_cache_decode(graphdef, params, prompts, new_tokens)
        full = no_cache_decode(graphdef, params, prompts, new_tokens, bucket=None)
        row.update(no_cache_tokens_per_s=round(b * new_tokens / grown, 1),
                   kv_speedup=round(grown / kv, 1),
                   full_width_no_cache_tokens_per_s=round(b * new_tokens / full, 1),
                   kv_speedup_vs_full_width=round(full / kv, 1))
      step = kv / new_tokens
      bound = decode_step_roofline(cfg, b, prompt_len + new_tokens // 2, flops_peak, bytes_peak)
      row.update(decode_step_ms=round(step * 1e3, 2), roofline_step_ms=round(bound * 1e3, 3),
                 roofline_fraction=round(bound / step, 3))
      emit(row)
    # Continuous vs static batching on lognormal completion lengths.
    b = slot_counts[name][-1]
    rng = np.random.default_rng(1)
    n = 4 * b if args.quick else 8 * b
    lengths = np.clip(rng.lognormal(np.log(16), 1.0, n), 2, max_len).astype(np.int32)
    fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                      settings=SETTINGS, num_slots=b,
                                      length=prompt_len + max_len)
    prompts = _prompts(n, prompt_len, seed=2)
    if name != "50M" and "continuous_vs_static" in parts:
      batching(fns, params, prompts, lengths, b, continuous=True)  # compile all inserts
      cont = batching(fns, params, prompts, lengths, b, continuous=True)
      static = batching(fns, params, prompts, lengths, b, continuous=False)
      emit({"benchmark": "sampler", "part": "continuous_vs_static", "model": name, "slots": b,
            "requests": n, "median_len": int(np.median(lengths)), "max_len": int(lengths.max()),
            "continuous_tokens_per_s": round(cont, 1), "static_tokens_per_s": round(static, 1),
            "speedup": round(cont / static, 2)})
      for policy in ("keep", "recompute"):
        stats = swap_pause(cfg, meshes, graphdef, params, b, policy,
                           seconds=1 if args.quick else 20, publish_every=0.5,
                           quick=args.quick)
        emit({"benchmark": "sampler", "part": "swap_pause", "model": name, "slots": b,
              "kv_policy": policy, "swaps": stats["swaps"],
              "pause_ms_per_swap": round(1e3 * stats["swap_seconds"] / max(stats["swaps"], 1), 3),
              "decode_ms_per_step": round(1e3 * stats["decode_seconds"] / max(stats["steps"], 1),
                                          3),
              "pause_fraction_of_decode": round(
                  stats["swap_seconds"] / max(stats["decode_seconds"], 1e-9), 4)})
  # The engine's own tokens/s with decode bursts (3.2M: the host's share of a
  # small model's step is largest).
  name = "tiny" if args.quick else "3M"
  cfg, meshes, graphdef, params = _model(name, prompt_len + max_len)
  rng = np.random.default_rng(5)
  n, slots = (8, 4) if args.quick else (256, 32)
  budgets = np.clip(rng.lognormal(np.log(64), 0.7, n), 8, max_len).astype(np.int32)
  first = None
  bursts = ((1, 4) if args.quick else (1, 4, 8)) if "engine_burst" in parts else ()
  # --quick: nothing precompiled (every row bucket's programs: most of a quick run); the
  # engines compile the shapes they use.
  for row in engine_bursts(cfg, meshes, graphdef, params, slots, budgets, bursts, prompt_len,
                           precompile=not args.quick):
    first = first or row
    emit({"benchmark": "sampler", "part": "engine_burst", "model": name, "slots": slots,
          "requests": n, "median_len": int(np.median(budgets)), **row,
          "vs_burst_1": round(row["tokens_per_s"] / first["tokens_per_s"], 2)})
  if "top_logprobs" in parts:
    # SmolLM2's vocabulary (49152), where the top-k over it weighs most against a small model.
    vocab = 1024 if args.quick else 49152
    cfg, meshes, graphdef, params = _model(name, prompt_len + max_len, vocab_size=vocab)
    first = None
    for row in engine_top_logprobs(cfg, meshes, graphdef, params, slots, budgets,
                                   (0, 5) if args.quick else (0, 5, 20, 0), prompt_len):
      first = first or row
      emit({"benchmark": "sampler", "part": "top_logprobs", "model": name, "vocab": vocab,
            "slots": slots, "requests": n, **row,
            "vs_none": round(row["tokens_per_s"] / first["tokens_per_s"], 3)})
  print()
  for part in dict.fromkeys(r["part"] for r in rows):
    report.print_table([r for r in rows if r["part"] == part], title=part)
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
