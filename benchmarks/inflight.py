r"""Weight-update modes on long-tailed generation lengths: in-flight (keep),
in-flight (recompute), pinned and drain, side by side in one run.

Workload (`long_tail`): arith prompts whose completion budgets follow a
lognormal distribution (median `--median_len`, sigma `--sigma`, capped at
`--max_len`), assigned per prompt by a hash of its id, so every mode sees the
same lengths. The policy is untrained (no warm-up): it rarely samples EOS, so
completions run to their budget. This isolates what the modes differ in: how
the sampler spends its slots around a weight update.

- `in_flight`: swap between two decode steps; long completions continue under
  the new weights (`keep`: their KV cache as computed; `recompute`: the cache
  re-prefilled under the new weights at every swap).
- `pinned`: every sequence finishes on the version it started with; the
  engine decodes one pass per version held.
- `drain`: after a publish, admit nothing new until every active sequence has
  finished, then swap. The slots of the short completions stand idle while the
  longest one finishes: the cost the seed's INTELLECT-3 figure describes.

Columns: `s/update` (median learner step time, compilation steps excluded;
the learner waits for a full batch, so this is the pipeline's throughput),
`sampler occupancy` (mean fraction of slots holding a live sequence per
decode step), `sampler idle %` (share of the run's wall time the sampler
thread was not decoding, prefilling or swapping), `pause/swap ms` (the engine
thread's time per weight swap) and the mean lag of trained groups. Every mode
runs the arith model (~0.45M params), 64 slots, batches of 32 rollouts,
max_async_level=1, K=8 and FIFO assembly (all flags); the learner packs
rollouts into rows of up to `--pack_len` tokens (0: one padded row each, as
before packing). `learner busy %` is the share of the run the learner was not
waiting for a batch: near 100, the learner paces the run; low, the sampler.

  python benchmarks/inflight.py --out=/tmp/inflight.jsonl   # ~2 min
  python benchmarks/inflight.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
import zlib

import numpy as np

from arl_jax.envs import arith, registry
from arl_jax.testing import tiny
from arl_jax.training import run_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

MODES = {
    "in_flight (keep)": dict(weight_update="in_flight", kv_policy="keep"),
    "in_flight (recompute)": dict(weight_update="in_flight", kv_policy="recompute"),
    "pinned": dict(weight_update="pinned", kv_policy="keep"),
    "drain": dict(weight_update="drain", kv_policy="keep"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongTailConfig(arith.ArithConfig):
  """arith, plus the completion-length distribution (tokens)."""

  median_len: int = 64
  sigma: float = 0.8
  max_len: int = 256


class LongTailEnv(arith.ArithEnv):
  """arith prompts with a lognormal completion budget per prompt."""

  name = "long_tail"

  def __init__(self, cfg: LongTailConfig, tokenizer):
    super().__init__(tokenizer)
    self._cfg = cfg

  def max_new_tokens_for(self, prompt) -> int:
    # A per-prompt seed: the same prompt gets the same budget in every mode.
    rng = np.random.default_rng(zlib.crc32(f"long_tail:{prompt.prompt_id}".encode()))
    draw = rng.lognormal(np.log(self._cfg.median_len), self._cfg.sigma)
    return int(np.clip(round(draw), 2, self._cfg.max_len))


registry.ENVS["long_tail"] = registry.EnvEntry(
    LongTailConfig, lambda cfg, tok, for_eval=False: LongTailEnv(cfg, tok), arith.make_prompts)


def _config(mode: str, steps: int, args):
  # The arith model (~0.45M params): big enough that decoding, not Python
  # overhead, sets the sampler's pace, as it does for real models.
  config = tiny.load_config("arith", "tiny" if args.quick else None)
  config.unlock()
  config.num_steps = steps
  config.eval_every = 0
  config.log_every = 0
  config.warmup.steps = 0
  config.env = dict(name="long_tail", max_operand=99, operator="+", heldout_fraction=0.1,
                    num_workers=2, timeout_s=30.0, median_len=args.median_len,
                    sigma=args.sigma, max_len=args.max_len)
  config.sampler.update(prompt_len=8, max_new_tokens=args.max_len, num_slots=args.slots,
                        **MODES[mode])
  config.model.max_seq_len = config.sampler.prompt_len + args.max_len
  config.orchestrator.update(batch_size=args.batch, group_size=8,
                             max_async_level=args.max_async_level,
                             max_off_policy_steps=8, assembly="fifo")
  config.learner.pack_len = args.pack_len
  return config


def run_mode(mode: str, steps: int, args) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    start = time.monotonic()
    result = run_lib.run(_config(mode, steps, args), workdir, print_fn=lambda *_: None)
    wall = time.monotonic() - start
  history = result.history
  steady = history[min(3, len(history) - 1):]  # the first steps include compilation
  last = history[-1]
  swaps = max(last["sampler_swaps"], 1)
  return {
      "benchmark": "inflight", "mode": mode, "pack_len": args.pack_len,
      "updates": len(history),
      "s_per_update": round(float(np.median([r["step_seconds"] for r in steady])), 4),
      "sampler_occupancy": round(last["sampler_occupancy"], 3),
      "sampler_idle_pct": round(100 * (1 - last["sampler_busy_s"] / last["wall_s"]), 1),
      "learner_busy_pct": round(100 * last["learner_busy_fraction"], 1),
      "pause_per_swap_ms": round(1000 * last["sampler_swap_pause_s"] / swaps, 2),
      "swaps": last["sampler_swaps"],
      "lag_mean": round(float(np.mean([r["lag_mean"] for r in history])), 2),
      "versions_held_max": last["sampler_versions_held"],
      "wall_s": round(wall, 1),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--median_len", type=int, default=64)
  parser.add_argument("--sigma", type=float, default=0.8)
  parser.add_argument("--max_len", type=int, default=256)
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--max_async_level", type=int, default=1)
  parser.add_argument("--pack_len", type=int, default=512,
                      help="learner.pack_len (0: one padded row per rollout)")
  parser.add_argument("--quick", action="store_true", help="short lengths, few steps")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  if args.quick:
    args.steps, args.max_len, args.median_len, args.slots, args.batch = 4, 32, 6, 16, 8
  env_cfg = LongTailConfig(max_operand=99, median_len=args.median_len, sigma=args.sigma,
                           max_len=args.max_len)
  lengths = [LongTailEnv(env_cfg, None).max_new_tokens_for(p)
             for p in arith.make_prompts(env_cfg, "train")]
  print(f"completion budgets over the training prompts: median {np.median(lengths):.0f}, "
        f"mean {np.mean(lengths):.1f}, p90 {np.quantile(lengths, 0.9):.0f}, p99 "
        f"{np.quantile(lengths, 0.99):.0f}, max {max(lengths)} tokens")
  rows = [run_mode(mode, args.steps, args) for mode in MODES]
  drain = next(r for r in rows if r["mode"] == "drain")
  for r in rows:
    r["speedup_vs_drain"] = round(drain["s_per_update"] / r["s_per_update"], 2)
  report.print_table(rows, skip=("benchmark",))
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
