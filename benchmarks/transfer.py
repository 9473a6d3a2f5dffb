r"""Weight publish benchmark: seconds and GB/s to move the learner's params onto
the sampler mesh, for the ~3M and ~50M decoders of benchmarks/learner.py,
against a plain numpy memcpy of the same bytes measured in the same run.

  python benchmarks/transfer.py --out=/tmp/transfer.jsonl   # ~1 min on 2 cores
  python benchmarks/transfer.py --quick                     # tiny model, seconds

Paths, each the median of `--repeats` calls after one warm-up (which
compiles), timed up to `jax.block_until_ready` on the result:

- `device_to_device`: `WeightPublisher.publish` as `run_lib` runs it: a jitted
  reshard on the learner mesh (fsdp-sharded -> the sampler's per-shard layout,
  an all-gather plus a copy), then `jax.device_put` onto the sampler shardings.
  `:reshard` and `:put` time those two steps apart.
- `device_to_device_bf16`: the same with `dtype="bfloat16"` (the cast runs on
  the learner, so half the bytes move).
- `host_round_trip`: `jax.device_get` of the learner params to numpy, then
  `jax.device_put` onto the sampler shardings (the path the publisher avoids).
- `memcpy`: `np.copyto` of the same number of bytes into a preallocated buffer,
  single-threaded; every row carries the memcpy time of its own byte count.

`bytes` is one copy of the weights in the dtype that moves; GB_per_s = bytes /
seconds; vs_memcpy = GB_per_s / memcpy GB/s of the same byte count (> 1 is
faster than memcpy). `copies` counts the full copies the result holds in
distinct buffers: the sampler replicates weights over its `data` axis, so a
publish writes one per sampler device. On CPU, `jax.device_put` of a numpy
array aliases it on every device (zero-copy) when its data is 64-byte aligned,
which `device_get` leaves to chance (about 1 leaf in 4 here): `host_round_trip`
then moves only some of its leaves, and its time and copies (between 1 and 4)
vary from run to run; on an accelerator its `device_put` copies every leaf.

Meshes: the default disaggregated split of 8 fake CPU devices (`mesh_lib`,
as `configs/arith.py` runs): learner (fsdp=4, tp=1), sampler (data=4, tp=1).
On fake CPU devices "device to device" is a host memory copy between buffers
of one process, and all devices share the same cores: the numbers measure
the framework's overhead over memcpy (dispatch, the reshard program and its
in-process all-gather, per-shard copies), not an interconnect.
"""

from __future__ import annotations

import os

# Fake CPU devices for disjoint learner and sampler meshes; must be set before
# JAX initialises (a device count already in XLA_FLAGS is kept).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from arl_jax.learner import publish as publish_lib  # noqa: E402
from arl_jax.models import init_lib  # noqa: E402
from arl_jax.models import model_config as model_config_lib  # noqa: E402
from arl_jax.sharding import mesh_lib  # noqa: E402
from arl_jax.sharding import rules as rules_lib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import learner as learner_bench  # noqa: E402  (the model table: same sizes as learner.py)
import report  # noqa: E402  (benchmarks/report.py, run as a script)

SEQ_LEN = 128  # only sizes the RoPE tables, which are not parameters


def _median_seconds(fn, repeats: int, setup_fn=None):
  """`(median seconds, last output)` of `fn(setup_fn())` over `repeats` calls
  after one warm-up.

  `setup_fn` runs outside the timer; the warm-up absorbs compilation and first
  page faults, which a training run pays once, not per publish.
  """
  times = []
  for i in range(repeats + 1):
    arg = setup_fn() if setup_fn is not None else None
    start = time.perf_counter()
    out = jax.block_until_ready(fn(arg))
    if i:
      times.append(time.perf_counter() - start)
  return statistics.median(times), out


def memcpy_seconds(num_bytes: int, repeats: int) -> float:
  """Median seconds of `np.copyto` of `num_bytes` into a preallocated buffer."""
  # np.ones, not np.empty: untouched pages all map to the kernel's zero page,
  # which reads from cache and would flatter memcpy.
  src = np.ones(num_bytes, np.uint8)
  dst = np.empty_like(src)
  return _median_seconds(lambda _: np.copyto(dst, src), repeats)[0]


def _nbytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def _copies(tree) -> int:
  """Full copies of `tree` in distinct buffers: replicas that alias one buffer
  (a CPU `device_put` of an aligned numpy array does that) count once."""
  buffers = {(s.data.unsafe_buffer_pointer(), s.data.nbytes)
             for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards}
  return round(sum(n for _, n in buffers) / _nbytes(tree))


def _check_equal(learner_params, sampler_params) -> None:
  """A transfer that returns wrong values would make its timing meaningless."""
  for a, b in zip(jax.tree.leaves(learner_params), jax.tree.leaves(sampler_params)):
    np.testing.assert_array_equal(np.asarray(a.astype(b.dtype)), np.asarray(b))


def _publish_fn(publisher: publish_lib.WeightPublisher, params):
  versions = itertools.count()  # publish refuses a version that is not newer

  def publish(_):
    publisher.publish(params, next(versions))
    return publisher.latest()[1]

  return publish


def bench(model: str, meshes: mesh_lib.RoleMeshes, repeats: int) -> list[dict]:
  """Rows for one model size: memcpy, then every path against the memcpy of its bytes."""
  cfg = model_config_lib.ModelConfig(vocab_size=learner_bench.VOCAB, max_seq_len=SEQ_LEN,
                                     **learner_bench.MODELS[model])
  _, params, learner_shardings = init_lib.init_params(cfg, meshes.learner,
                                                      rules_lib.LEARNER_RULES, 0)
  _, abstract = init_lib.abstract_model(cfg)
  sampler_shardings = rules_lib.state_shardings(abstract, meshes.sampler,
                                                rules_lib.SAMPLER_RULES)
  # The dtype strings as run_lib passes `spec.sampler_model.param_dtype`.
  publishers = {dtype: publish_lib.WeightPublisher(meshes.learner, sampler_shardings,
                                                   dtype=dtype)
                for dtype in ("float32", "bfloat16")}
  # The publisher's two steps timed apart, rebuilt from the same public rule
  # helpers publish.py uses: which one dominates decides what to optimise.
  bridge = rules_lib.with_mesh(rules_lib.specs_of(sampler_shardings), meshes.learner)
  reshard_fn = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=bridge)
  bridged = jax.block_until_ready(reshard_fn(params))
  # jax.device_get caches the host copy on the array (JAX_NOTES.md), so each
  # host round trip gets fresh learner arrays, copied outside the timer.
  copy_fn = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=learner_shardings)
  paths = {  # path -> (fn, setup_fn)
      "device_to_device": (_publish_fn(publishers["float32"], params), None),
      "device_to_device:reshard": (lambda _: reshard_fn(params), None),
      "device_to_device:put": (lambda _: jax.device_put(bridged, sampler_shardings), None),
      "device_to_device_bf16": (_publish_fn(publishers["bfloat16"], params), None),
      "host_round_trip": (lambda fresh: jax.device_put(jax.device_get(fresh), sampler_shardings),
                          lambda: jax.block_until_ready(copy_fn(params))),
  }
  float_bytes = _nbytes(params)
  memcpy = {n: memcpy_seconds(n, repeats) for n in (float_bytes, float_bytes // 2)}
  rows = [_row(model, cfg, "memcpy", memcpy[float_bytes], float_bytes, memcpy[float_bytes],
               copies=1)]
  for path, (fn, setup_fn) in paths.items():
    seconds, out = _median_seconds(fn, repeats, setup_fn)
    _check_equal(params, out)
    num_bytes = _nbytes(out)
    rows.append(_row(model, cfg, path, seconds, num_bytes, memcpy[num_bytes],
                     copies=_copies(out)))
  return rows


def _sig(x: float) -> float:
  """4 significant digits: the tiny model's times are microseconds."""
  return float(f"{x:.4g}")


def _row(model: str, cfg, path: str, seconds: float, num_bytes: int, memcpy: float,
         copies: int) -> dict:
  return {
      "benchmark": "transfer", "model": model, "params": cfg.num_params, "bytes": num_bytes,
      "path": path, "copies": copies, "seconds": _sig(seconds),
      "GB_per_s": _sig(num_bytes / seconds / 1e9), "memcpy_seconds": _sig(memcpy),
      "vs_memcpy": _sig(memcpy / seconds),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, 2 repeats")
  parser.add_argument("--repeats", type=int, default=10, help="timed publishes per row (median)")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  if jax.device_count() < 2:
    raise SystemExit(f"transfer.py needs >= 2 devices for disjoint meshes, found "
                     f"{jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(placement="disaggregated"))
  models = ("tiny",) if args.quick else ("3M", "50M")
  repeats = 2 if args.quick else args.repeats
  rows = [row for model in models for row in bench(model, meshes, repeats)]
  report.print_table(rows, title=f"weight publish, learner {dict(meshes.learner.shape)} -> "
                                 f"sampler {dict(meshes.sampler.shape)}")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
