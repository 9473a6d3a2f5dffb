r"""The accelerator kernels against the XLA paths: numerics and speed.

  python benchmarks/attention_kernels.py --out=/tmp/kernels.jsonl  # on a GPU: Pallas (Triton)
  python benchmarks/attention_kernels.py --quick         # anywhere: interpret mode, tiny shapes

(Not `kernels.py`: the benchmarks' folder is first on the path of a script
run from it, and a `kernels` module there hides the package of that name
that transformers imports.)

Parts (every number measured in this run, side by side):

- `paged_decode`: one decode step's attention over a paged KV pool
  (`models/paged_attention.decode_attention`, JAX's Pallas GPU paged
  attention) against the XLA path over every page gathered at once
  (`paged_attention="xla"` with `attention_block=0`; the engine's default
  reads blocks of 128 columns, `models/paged_blocks.py`, not timed here),
  for each head geometry, dtype, batch
  and context: the largest difference from a float32 reference, the median
  milliseconds of each and the KV bytes read per second.
- `segment_attention`: the learner's attention over packed rows
  (`models/segment_attention.attend`), the Pallas GPU flash kernel
  (`pallas_gpu`) against the XLA path (queries in blocks of 512), forward
  and forward + backward: the largest difference of the outputs and of the
  gradients from a float32 XLA reference, and the median milliseconds.

The float32 reference is the XLA path on float32 inputs at JAX's default
matmul precision on the platform. Geometries: SmolLM2-135M's heads (9 query
heads over 3 KV heads of 64) and a 7B-class model's (32 over 8 of 128).
Without an accelerator (`--quick`) the kernels run in Pallas interpret mode
at tiny shapes: the numerics only (an interpreted kernel's time means
nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from arl_jax.models import paged_attention
from arl_jax.models import segment_attention as segment_attention_lib
from arl_jax.testing import attention_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

# name: (query heads, KV heads, head_dim)
GEOMETRIES = {"smollm2": (9, 3, 64), "7b": (32, 8, 128)}
PAGE_SIZE = 16


def _median_ms(fn, *args, repeats):
  """Median milliseconds of `fn(*args)` after one compiling call."""
  return report.median_seconds(lambda: jax.block_until_ready(fn(*args)), repeats) * 1e3


def _max_diff(a, b) -> float:
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


# -- 1. Decode attention over a paged pool ------------------------------------------


def _paged_inputs(geometry, batch, context, dtype, seed=0):
  """Scaled queries, split pools with every row's pages scattered, page
  tables (pages past a row's length are the trash page 0) and lengths spread
  over [context / 2, context]."""
  heads, kv_heads, dh = GEOMETRIES[geometry]
  rng = np.random.default_rng(seed)
  pages = context // PAGE_SIZE
  num_pages = batch * pages + 1
  shape = (kv_heads, num_pages, PAGE_SIZE, dh)
  keys = jnp.asarray(rng.normal(size=shape), dtype)
  values = jnp.asarray(rng.normal(size=shape), dtype)
  q = jnp.asarray(rng.normal(size=(batch, heads, dh)) / np.sqrt(dh), dtype)
  table = rng.permutation(np.arange(1, num_pages)).reshape(batch, pages)
  lengths = rng.integers(context // 2, context + 1, batch)
  for row, n in enumerate(lengths):
    table[row, -(-n // PAGE_SIZE):] = 0
  return q, keys, values, jnp.asarray(table, jnp.int32), jnp.asarray(lengths, jnp.int32)


def paged_decode(geometry, batch, context, dtype, *, interpret, repeats):
  q, keys, values, table, lengths = _paged_inputs(geometry, batch, context, dtype)
  f32 = [x.astype(jnp.float32) for x in (q, keys, values)]
  want = jax.jit(attention_reference.paged_decode_attention)(*f32, table, lengths)
  xla = jax.jit(attention_reference.paged_decode_attention)
  kernel = jax.jit(lambda *a: paged_attention.decode_attention(*a, interpret=interpret))
  row = {"xla_err": _max_diff(xla(q, keys, values, table, lengths), want),
         "kernel_err": _max_diff(kernel(q, keys, values, table, lengths), want)}
  if not interpret:
    xla_ms = _median_ms(xla, q, keys, values, table, lengths, repeats=repeats)
    kernel_ms = _median_ms(kernel, q, keys, values, table, lengths, repeats=repeats)
    # Bytes a step must read: every live column's key and value in every KV head.
    kv_bytes = int(jnp.sum(lengths)) * 2 * keys.shape[0] * keys.shape[3] * keys.dtype.itemsize
    row.update(xla_ms=round(xla_ms, 3), kernel_ms=round(kernel_ms, 3),
               speedup=round(xla_ms / kernel_ms, 2),
               xla_gb_s=round(kv_bytes / xla_ms / 1e6, 1),
               kernel_gb_s=round(kv_bytes / kernel_ms / 1e6, 1))
  return row


# -- 2. Training attention over packed rows -----------------------------------------


def _packed_ids(rows, length, seed=0):
  """Rows of 1-4 segments of random lengths, then padding (segment 0)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((rows, length), np.int32)
  for r in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, length), rng.integers(1, 5), replace=False))
    used = int(rng.integers(length * 3 // 4, length + 1))
    for k, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, used]), start=1):
      ids[r, lo:max(lo, hi)] = k
  return jnp.asarray(ids)


def segment_attention(geometry, rows, length, dtype, *, interpret, repeats):
  heads, kv_heads, dh = GEOMETRIES[geometry]
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(rows, length, heads, dh)), dtype)
  k = jnp.asarray(rng.normal(size=(rows, kv_heads, length, dh)), dtype)
  v = jnp.asarray(rng.normal(size=(rows, kv_heads, length, dh)), dtype)
  ids = _packed_ids(rows, length)
  live = (ids > 0)[:, :, None, None]
  cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

  def make(kernel):
    segments = segment_attention_lib.Segments(ids, chunk=512 if kernel == "xla" else 0,
                                              kernel=kernel)
    forward = jax.jit(lambda q, k, v: segment_attention_lib.attend(q, k, v, segments))
    loss = lambda q, k, v: jnp.sum(jnp.where(live, forward(q, k, v) * cotangent, 0.0))
    return forward, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  kernel_name = "pallas_gpu_interpret" if interpret else "pallas_gpu"
  (ref_fwd, ref_grad), (xla_fwd, xla_grad), (ker_fwd, ker_grad) = (
      make("xla"), make("xla"), make(kernel_name))
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want, want_grads = ref_fwd(*f32), ref_grad(*f32)
  masked = lambda out: jnp.where(live, out, 0.0)
  grad_err = lambda grads: max(_max_diff(g, w) for g, w in zip(grads, want_grads))
  row = {"xla_err": _max_diff(masked(xla_fwd(q, k, v)), masked(want)),
         "kernel_err": _max_diff(masked(ker_fwd(q, k, v)), masked(want)),
         "xla_grad_err": grad_err(xla_grad(q, k, v)),
         "kernel_grad_err": grad_err(ker_grad(q, k, v)),
         "grad_scale": max(float(jnp.max(jnp.abs(g))) for g in want_grads)}
  if not interpret:
    times = {name: (_median_ms(fwd, q, k, v, repeats=repeats),
                    _median_ms(grad, q, k, v, repeats=repeats))
             for name, fwd, grad in (("xla", xla_fwd, xla_grad), ("kernel", ker_fwd, ker_grad))}
    row.update(xla_fwd_ms=round(times["xla"][0], 3), kernel_fwd_ms=round(times["kernel"][0], 3),
               xla_fwd_bwd_ms=round(times["xla"][1], 3),
               kernel_fwd_bwd_ms=round(times["kernel"][1], 3),
               fwd_bwd_speedup=round(times["xla"][1] / times["kernel"][1], 2))
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="interpret mode, tiny shapes: numerics only")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--parts", default="paged_decode,segment_attention",
                      help="comma-separated parts to run")
  parser.add_argument("--repeats", type=int, default=20, help="timed calls per row (median)")
  parser.add_argument("--geometries", default=",".join(GEOMETRIES),
                      help=f"comma-separated head geometries of {list(GEOMETRIES)}")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  platform = jax.devices()[0].platform
  interpret = args.quick or platform != "gpu"
  if interpret and not args.quick:
    print(f"no GPU ({platform}): the kernels run in interpret mode, numerics only")
  geometries = args.geometries.split(",")
  unknown = sorted(set(geometries) - set(GEOMETRIES))
  if unknown:
    parser.error(f"unknown geometries {unknown}; known: {list(GEOMETRIES)}")
  dtypes = ("float32", "bfloat16")
  decode_cases = ([("smollm2", 2, 64)] if interpret else
                  [(g, b, c) for g in geometries for b, c in ((32, 1024), (128, 4096))])
  train_cases = ([("smollm2", 2, 128)] if interpret else
                 [(g, r, t) for g in geometries for r, t in ((8, 1024), (2, 8192))])
  cases = ([("paged_decode", paged_decode, c) for c in decode_cases] * ("paged_decode" in parts)
           + [("segment_attention", segment_attention, c) for c in train_cases]
           * ("segment_attention" in parts))
  rows = []
  for part, fn, (geometry, batch, length) in cases:
    for dtype in dtypes:
      row = {"benchmark": "attention_kernels", "part": part, "platform": platform,
             "interpret": interpret, "geometry": geometry, "dtype": dtype,
             "rows": batch, "length": length}
      try:  # one case's failure (a kernel's limits) is a row, not the end of the run
        row.update(fn(geometry, batch, length, getattr(jnp, dtype), interpret=interpret,
                      repeats=args.repeats))
      except Exception as e:  # noqa: BLE001
        if args.quick:
          raise
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      rows.append(row)
      print(json.dumps(row), flush=True)
  for part in ("paged_decode", "segment_attention"):
    part_rows = [r for r in rows if r["part"] == part]
    if part_rows:
      report.print_table(part_rows, title=f"kernels: {part} ({jax.__version__})")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
