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
- `cross_process_pull`: a sampler in another process (4 CPU devices of its
  own, mesh data=4) pulls the published version from a `WeightServer`
  (`arl_jax/distributed/weight_transfer.py`: ZeroMQ control message, then
  `jax.experimental.transfer` pull into its sampler shardings), timed in that
  process from its request to `block_until_ready`; it re-pulls the same
  version each repeat, and reports per-leaf float64 sums that must equal the
  published ones.
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
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from arl_jax.distributed import weight_transfer  # noqa: E402
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
  # jax.device_get caches the host copy on the array (docs/jax_notes.md), so each
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
  seconds, pulled_bytes = cross_process_pull(model, cfg, publishers["float32"], params, repeats)
  # The sampler process holds one replica per device (data=4), each pulled.
  rows.append(_row(model, cfg, "cross_process_pull", seconds, float_bytes, memcpy[float_bytes],
                   copies=pulled_bytes // float_bytes * meshes.sampler.shape["data"]))
  return rows


# The sampler process of `cross_process_pull`: prints the median pull seconds
# and per-leaf sums of what it pulled.
_PULLER = r"""
import json, os, statistics, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[4])
import jax, numpy as np
from jax.sharding import Mesh
import learner as learner_bench
from arl_jax.distributed import weight_transfer
from arl_jax.models import init_lib, model_config as model_config_lib
from arl_jax.sharding import rules as rules_lib
address, model, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = model_config_lib.ModelConfig(vocab_size=learner_bench.VOCAB, max_seq_len=int(sys.argv[5]),
                                   **learner_bench.MODELS[model])
mesh = Mesh(np.array(jax.devices()).reshape(4, 1), ("data", "tp"))
_, abstract = init_lib.abstract_model(cfg)
shardings = rules_lib.state_shardings(abstract, mesh, rules_lib.SAMPLER_RULES)
abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
client = weight_transfer.WeightClient(address, abstract, poll_interval_s=0.0)
times = []
for _ in range(repeats + 1):  # the first is a warm-up (connection set-up)
  client.version = None  # pull the same version again
  before = client.pull_seconds
  _, params = client.latest()
  times.append(client.pull_seconds - before)
print(json.dumps({"seconds": statistics.median(times[1:]),
                  "sums": [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(params)],
                  "bytes": sum(x.nbytes for x in jax.tree.leaves(params))}))
"""


def cross_process_pull(model: str, cfg, publisher: publish_lib.WeightPublisher, params,
                       repeats: int):
  """`(seconds, bytes)` of a pull by a sampler in another process (checked equal)."""
  publisher.publish(params, 10**6)
  want = [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(publisher.latest()[1])]
  server = weight_transfer.WeightServer(publisher)
  try:
    proc = subprocess.run(
        [sys.executable, "-c", _PULLER, server.address, model, str(repeats),
         os.path.dirname(os.path.abspath(__file__)), str(SEQ_LEN)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, XLA_FLAGS=""))
  finally:
    server.close()
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  if result["sums"] != want:
    raise AssertionError("the cross-process pull returned other values than were published")
  return result["seconds"], result["bytes"]


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
