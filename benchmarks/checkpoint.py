r"""Checkpoint save and restore of the learner state: seconds and size on disk.

For the ~3M and ~50M decoders of `benchmarks/learner.py` (with AdamW state:
params + 2 moments, float32), sharded fsdp=4 over 4 of 8 fake CPU devices,
`arl_jax.learner.checkpointing.Checkpointer` as `run_lib` uses it:

- `save blocking s`: the time `save()` holds the learner (the device-to-host
  copy; orbax then writes in a background thread);
- `save total s`: until the checkpoint is complete on disk (`wait()`);
- `restore s`: reading it back onto the same layout (`restore`, sharded);
- `restore other mesh s`: onto a 2-device fsdp mesh (resharded on read);
- `MB on disk`: the checkpoint folder (tensorstore, compressed by default),
  against `MB state` of the arrays in memory (the state gets noise in every
  float leaf first: zero Adam moments would compress to nothing).

Median of `--repeats` (default 3) after one warm-up, into a fresh folder each
time; every restore is checked equal to the saved state.

  python benchmarks/checkpoint.py --out=/tmp/checkpoint.jsonl   # ~1 min
  python benchmarks/checkpoint.py --quick
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from arl_jax.learner import checkpointing  # noqa: E402
from arl_jax.learner import optim as optim_lib  # noqa: E402
from arl_jax.learner import train_state as train_state_lib  # noqa: E402
from arl_jax.models import init_lib  # noqa: E402
from arl_jax.models import model_config as model_config_lib  # noqa: E402
from arl_jax.sharding import mesh_lib  # noqa: E402
from arl_jax.sharding import rules as rules_lib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import learner as learner_bench  # noqa: E402  (the model table: same sizes as learner.py)
import report  # noqa: E402  (benchmarks/report.py, run as a script)


def _state(cfg, learner_devices: int):
  meshes = mesh_lib.make_role_meshes(
      mesh_lib.MeshConfig(placement="disaggregated", learner_devices=learner_devices),
      jax.devices()[:2 * learner_devices])
  _, params, _ = init_lib.init_params(cfg, meshes.learner, rules_lib.LEARNER_RULES, 0)
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-3))
  return train_state_lib.create(params, optimizer, meshes.learner)


def _trained_like(state):
  """The state with noise in every float leaf: Adam's moments start at zero,
  which compresses to nothing on disk; after training they do not."""
  leaves, treedef = jax.tree.flatten(state)
  noisy = [x + 1e-3 * jax.random.normal(jax.random.PRNGKey(i), x.shape, x.dtype)
           if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x
           for i, x in enumerate(leaves)]
  return jax.tree.unflatten(treedef, noisy)


def _disk_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, f))
             for root, _, files in os.walk(path) for f in files)


def _same(a, b) -> None:
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def measure(name: str, repeats: int) -> dict:
  cfg = model_config_lib.ModelConfig(vocab_size=learner_bench.VOCAB, max_seq_len=128,
                                     **learner_bench.MODELS[name])
  state, shardings = _state(cfg, learner_devices=4)
  state = _trained_like(state)
  other, other_shardings = _state(cfg, learner_devices=2)
  times = {"save_blocking": [], "save_total": [], "restore": [], "restore_other": []}
  disk = 0
  for i in range(repeats + 1):
    folder = tempfile.mkdtemp(prefix="arl_jax_ckpt_bench_")
    ckpt = checkpointing.Checkpointer(folder, checkpointing.CheckpointConfig(keep=1))
    start = time.perf_counter()
    ckpt.save(1, state, {"version": 1, "prompts_drawn": 0, "pending": {}})
    blocking = time.perf_counter() - start
    ckpt.wait()
    total = time.perf_counter() - start
    start = time.perf_counter()
    restored, _ = ckpt.restore(checkpointing.abstract_like(state, shardings))
    jax.block_until_ready(restored)
    restore = time.perf_counter() - start
    start = time.perf_counter()
    moved, _ = ckpt.restore(checkpointing.abstract_like(other, other_shardings))
    jax.block_until_ready(moved)
    restore_other = time.perf_counter() - start
    _same(state, restored)
    _same(state, moved)
    disk = _disk_bytes(folder)
    ckpt.close()
    shutil.rmtree(folder)
    if i:  # the first round compiles and warms the page cache
      for key, value in zip(times, (blocking, total, restore, restore_other)):
        times[key].append(value)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  return {
      "benchmark": "checkpoint", "model": name, "params": cfg.num_params,
      "MB_state": round(state_bytes / 1e6, 1), "MB_on_disk": round(disk / 1e6, 1),
      **{f"{key}_s": round(statistics.median(v), 3) for key, v in times.items()},
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true", help="tiny model, 1 repeat")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  logging.set_verbosity(logging.WARNING)  # orbax logs every step at INFO
  models, repeats = (["tiny"], 1) if args.quick else (["3M", "50M"], args.repeats)
  rows = [measure(name, repeats) for name in models]
  report.print_table(rows, title="learner checkpoint: fsdp=4 save, restore onto fsdp=4 and 2")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
