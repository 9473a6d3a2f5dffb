r"""How much policy lag does the arith task tolerate, and which loss holds up?

For each loss (`clipped_ratio`, `vtrace`, `m2po`, `cispo`, `gspo`), each K in (0, 1, 2, 4, 8)
and each seed, runs the arith config (its 200-step warm-up included) for a
fixed number of RL updates with `orchestrator.max_off_policy_steps = K` and
`orchestrator.max_async_level = K`. K = 0 is the synchronous baseline and uses
`sampler.weight_update = "drain"`, as `async_vs_sync.py` does; on-policy, the
token losses have the same gradient, so their K = 0 rows should agree (and
`cispo`'s: its weight is 1 on-policy); `gspo` runs as published, with
`aggregation="seq_mean_token_mean"` and its own clip range (3e-4, 4e-4), so
its K = 0 row is its own. (`gspo_token` equals `gspo` when a rollout's
advantage lies on all its tokens, as here: not run.)

How lag is forced: the dispatcher admits a new group only while at most
`(max_async_level + 1) * groups_per_batch` groups are started and not yet
retired (the AReaL capacity rule, `orchestrator/dispatcher.py`). When the
sampler produces batches faster than the learner consumes them it keeps that
capacity full, so K batches are always ahead of the learner and FIFO assembly
trains each group about K versions after it was dispatched; flow control
bounds the lag by K, so nothing should be dropped as stale (`dropped_stale`
checks it). The config's 128 sampler slots hold one batch, and one batch at a
time is not faster than the learner on 2 shared cores: measured lag was
1.6-1.9 at K = 4 and 8 alike. So each run gets `sampler.num_slots = (K + 1) *
batch_size` (at least the config's), room for the whole capacity in flight; a
wider decode step costs little more than a narrow one for this model, so the
sampler then runs ahead (measured steady-state lag: exactly K). Slots change
how many rollouts are generated at once, not what is sampled. Lag ramps up
over the first K updates (version v cannot train anything older than 0), so
`lag` (all steps) sits below K and `lag_tail` (last 20% of steps) is the
steady state; both are measured, not assumed.

Per run (one JSON row, `"part": "run"`):
- `lag`: the learner's `lag_mean` (versions between dispatch and training,
  per group), averaged over steps; `lag_tail` the same over the last 20% of
  steps; `lag_max` over the run;
- `eval_start`, `eval_final`: greedy exact-match reward on the 300 held-out
  pairs after the warm-up (identical across losses and K for one seed) and
  after the last update;
- `train_reward`: mean batch reward over the last 20% of updates (sampled at
  temperature 1 by the behaviour policies, i.e. up to K versions old, so it
  is noisier than the greedy evaluation and trails the current policy);
- `eval_vs_k0`, `train_vs_k0`: `eval_final` and `train_reward` minus those of
  the K = 0 run with the same loss and seed (paired, so the seeds' different
  starting points cancel; present when K = 0 is in the grid);
- learner ratio statistics of the policy at the start of each batch against
  the behaviour policy, averaged over steps (`update.staleness_metrics`):
  `ess` (E[rho]^2 / E[rho^2], 1 on-policy), `ratio_m2` (E[rho^2]),
  `abs_log_ratio` (E|log rho|), `kl_behaviour` (E[rho - 1 - log rho], an
  estimate of KL(mu || pi)); `clip_fraction` for clipped_ratio (tokens on the
  clipped branch) and vtrace (tokens with rho > rho_bar = 1: about half of
  them as soon as there is any lag, so not comparable with clipped_ratio's);
  for m2po `masked_fraction` (tokens masked by the second-moment rule) and
  `m2_kept` (E[(log rho)^2] over the kept tokens, the only second moment of
  the log-ratio the learner logs);
- `dropped_stale`, `dropped_cancelled`: rollouts dropped in the run.
One aggregate row per (loss, K) (`"part": "aggregate"`) holds the mean, std
(ddof=1; 0 with one seed), min and max over seeds of each of these; the
printed table shows mean+-std.

  python benchmarks/staleness.py --out=/tmp/staleness.jsonl    # ~10 min
  python benchmarks/staleness.py --quick                        # tiny model, < 40 s
  python benchmarks/staleness.py --losses=m2po --ks=0,8 --seeds=3 --steps=300
  python benchmarks/staleness.py --losses=clipped_ratio --ks=1,2,4,8,adaptive   # issue 57

`--ks=...,adaptive` adds the adaptive bound (`orchestrator.staleness.policy
= "adaptive"`, K in [1, 8] from the measured per-lag ESS, starting at 8, the
sampler allowed 8 batches ahead with admissions paced by the bound in
force): `k_mean` is the bound in force averaged over updates, `wall_s` the
run's time for the same updates, against the fixed bounds' rows;
`sampler_idle` the share of the RL phase the sampler spent without work
(1 - `sampler_busy_fraction`). `--async_level=N` lets the sampler of
every run run N batches ahead (a fixed K below it then drops what lags
beyond K, as a sampler that outruns its bound does). `--evals=N`
evaluates N times over RL (and at its start) and prints the held-out
curve against updates and RL wall seconds, mean over seeds (`part:
"curve"`).

Cost: the default grid is 3 losses x 5 K x 2 seeds = 30 runs of 100 updates
each (after the config's 200-step warm-up) on the ~0.43M-parameter arith
model: 558 s measured on the project's 2-core CPU machine while another
process loaded it (load average 3-5), 12-34 s per run. Each run pays the
warm-up (~5 s) and start-up; compilation is paid about once per process,
because a temporary persistent compilation cache lets every run reuse the
programs an earlier one compiled (without it each run recompiles the sampler,
evaluator, warm-up and update step: ~20 s more per run, measured). Each
evaluation has a binomial std of ~0.02 (300 pairs at reward ~0.15), and 100
updates move the held-out reward by only a few points, so read reward
differences against the seed spread; `--steps` and `--seeds` buy resolution
at linear cost. The ratio statistics are far less noisy.

Measured 2026-12-01 (the default run): steady-state lag was exactly K with no
stale drops; ESS fell with K for every loss, least for clipped_ratio (0.87 at
K = 8 against 0.70 vtrace, 0.74 m2po: its trust region moves the policy
less per version). The K = 0 rows of the three losses were identical, as
they should be. Held-out reward relative to K = 0 (paired): clipped_ratio
+0.01 to +0.03 at every K; vtrace and m2po fell with K to about -0.05 at
K = 8. Two seeds only: the direction is consistent, the size is not
resolved.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

from arl_jax.testing import tiny
from arl_jax.training import run_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

LOSSES = ("clipped_ratio", "vtrace", "m2po", "cispo", "gspo")
KS = (0, 1, 2, 4, 8)
# `--ks=...,adaptive`: the bound set from the measured per-lag ESS
# (`orchestrator.staleness.policy="adaptive"`) in [1, ADAPTIVE_K_MAX], starting
# at the top, the sampler allowed as far ahead (`max_async_level`) and its
# admissions paced by the bound in force.
ADAPTIVE = "adaptive"
ADAPTIVE_K_MAX = 8
# Learner metrics averaged over steps; a loss logs only some of them.
_STEP_MEANS = ("ess", "ratio_m2", "abs_log_ratio", "kl_behaviour", "clip_fraction",
               "masked_fraction", "m2_kept")
# Per-run numbers aggregated over seeds, in table order.
_SUMMARISED = ("lag", "lag_tail", "eval_start", "eval_final", "eval_vs_k0", "train_reward",
               "train_vs_k0", *_STEP_MEANS, "dropped_stale", "dropped_cancelled",
               "sampler_idle", "wall_s", "k_mean", "k_final")
# Printed as mean+-std; the rest of _SUMMARISED goes to JSON only.
_PRINTED = ("lag", "lag_tail", "eval_final", "eval_vs_k0", "train_reward", "train_vs_k0", "ess",
            "ratio_m2", "abs_log_ratio", "clip_fraction", "masked_fraction", "dropped_stale",
            "dropped_cancelled", "sampler_idle", "wall_s", "k_mean")


def _config(loss: str, k: int | str, seed: int, steps: int, quick: bool, evals: int = 1,
            async_level: int | None = None):
  config = tiny.load_config("arith", "tiny" if quick else None)
  config.seed = seed
  config.num_steps = steps
  # An evaluation at the start of RL and `evals` more, the last after the
  # last update.
  config.eval_every = max(1, steps // evals)
  config.log_every = 0
  config.learner.loss = loss
  if loss == "gspo":  # (the paper's objective: 1/G sum over sequences)
    config.learner.aggregation = "seq_mean_token_mean"
  if k == ADAPTIVE:
    config.orchestrator.staleness.update(policy=ADAPTIVE, k_min=1, k_max=ADAPTIVE_K_MAX)
    k = ADAPTIVE_K_MAX  # (the start, and how far ahead the sampler may run)
  config.orchestrator.max_off_policy_steps = k
  # (`--async_level`: a sampler allowed further ahead than a fixed K, which
  # then drops what lags beyond it)
  level = k if async_level is None else max(k, async_level)
  config.orchestrator.max_async_level = level
  # K = 0 must be truly on-policy: drain in-flight groups before a swap, so no
  # rollout mixes two versions.
  config.sampler.weight_update = "drain" if k == 0 else "in_flight"
  # Room for the whole admission capacity in flight (see the module docstring).
  config.sampler.num_slots = max(config.sampler.num_slots,
                                 (level + 1) * config.orchestrator.batch_size)
  return config


def run_one(loss: str, k: int | str, seed: int, steps: int, quick: bool,
            evals: int = 1, async_level: int | None = None) -> dict:
  """Trains one (loss, K, seed) cell and summarises it as one JSON row."""
  with tempfile.TemporaryDirectory() as workdir:
    result = run_lib.run(_config(loss, k, seed, steps, quick, evals, async_level), workdir,
                         print_fn=lambda *_: None)
  history = result.history
  rl_evals = [r["eval_reward"] for r in result.eval_history if r["phase"] == "rl"]
  tail = history[-max(1, len(history) // 5):]
  row = {
      "benchmark": "staleness", "part": "run",
      "workload": "arith" + ("_tiny" if quick else ""),
      "loss": loss, "K": k, "seed": seed, "updates": len(history),
      "async_level": async_level,
      "lag": float(np.mean([r["lag_mean"] for r in history])),
      "lag_tail": float(np.mean([r["lag_mean"] for r in tail])),
      "lag_max": int(max(r["lag_max"] for r in history)),
      "eval_start": rl_evals[0],
      "eval_final": history[-1]["eval_reward"],
      "train_reward": float(np.mean([r["reward_mean"] for r in tail])),
  }
  for name in _STEP_MEANS:
    if name in history[-1]:
      row[name] = float(np.mean([r[name] for r in history]))
  # Cumulative counters: the last record holds the run's totals.
  row["dropped_stale"] = history[-1]["dropped_stale"]
  row["dropped_cancelled"] = history[-1]["dropped_cancelled"]
  row["wall_s"] = result.wall_seconds
  # (the sampler's busy seconds over the RL phase's, cumulative: the last
  # record holds the run's)
  if "sampler_busy_fraction" in history[-1]:
    row["sampler_idle"] = 1.0 - history[-1]["sampler_busy_fraction"]
  # Held-out reward against updates and RL wall seconds: [update, s, reward].
  row["eval_curve"] = [[r["step"], round(r.get("rl_wall_s", 0.0), 2), r["eval_reward"]]
                       for r in result.eval_history if r["phase"] == "rl"]
  if "staleness_k" in history[-1]:  # (the bound in force at each update)
    row["k_mean"] = float(np.mean([r["staleness_k"] for r in history]))
    row["k_final"] = history[-1]["staleness_k"]
  return row


def add_paired_deltas(runs: list[dict]) -> None:
  """Adds `eval_vs_k0` and `train_vs_k0`: each run's final held-out and tail
  train reward minus those of the K = 0 run with the same loss and seed.

  Seeds differ by a few points already after the warm-up (their own subset
  and init), which inflates the per-cell spread; the paired difference
  cancels that offset, so it is the sharper test of whether lag hurts.
  """
  baselines = {(r["loss"], r["seed"]): r for r in runs if r["K"] == 0}
  for r in runs:
    base = baselines.get((r["loss"], r["seed"]))
    if base is not None:
      r["eval_vs_k0"] = r["eval_final"] - base["eval_final"]
      r["train_vs_k0"] = r["train_reward"] - base["train_reward"]


def aggregate(runs: list[dict]) -> dict:
  """One row for the runs of one (loss, K): mean, std, min and max over seeds."""
  row = {"benchmark": "staleness", "part": "aggregate", "workload": runs[0]["workload"],
         "loss": runs[0]["loss"], "K": runs[0]["K"], "seeds": len(runs),
         "updates": runs[0]["updates"]}
  for name in _SUMMARISED:
    values = [r[name] for r in runs if name in r]
    if not values:
      continue
    row[name] = float(np.mean(values))
    row[f"{name}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    row[f"{name}_min"] = float(np.min(values))
    row[f"{name}_max"] = float(np.max(values))
  return row


def curve_row(runs: list[dict]) -> dict:
  """The seeds' mean held-out reward at each evaluation of one (loss, K),
  with the mean RL wall time it came at."""
  row = {"benchmark": "staleness", "part": "curve", "loss": runs[0]["loss"], "K": runs[0]["K"]}
  for points in zip(*(r["eval_curve"] for r in runs)):
    update = points[0][0]
    row[f"u{update}"] = (f"{np.mean([p[2] for p in points]):.3f} "
                         f"({np.mean([p[1] for p in points]):.1f}s)")
  return row


def _table_row(agg: dict) -> dict:
  row = {"loss": agg["loss"], "K": agg["K"]}
  for name in _PRINTED:
    row[name] = (f"{agg[name]:.3f}+-{agg[name + '_std']:.3f}" if name in agg else "-")
  return row


def _ks(text: str) -> tuple[int | str, ...]:
  """K values: ints, or `adaptive`."""
  return tuple(x if x == ADAPTIVE else int(x) for x in text.split(",") if x)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny config, 1 seed, one loss, K = 2, 3 updates per run")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--seeds", type=int, default=None,
                      help="number of seeds (config.seed = 0..n-1); default 2, quick 1")
  parser.add_argument("--steps", type=int, default=None,
                      help="RL updates per run; default 100, quick 3")
  parser.add_argument("--losses", default=None,
                      help="comma-separated losses; default all, quick the first")
  parser.add_argument("--evals", type=int, default=1,
                      help="held-out evaluations over RL besides the one at its start, "
                           "every steps // N updates (the curve against updates and wall "
                           "time; default 1: the end)")
  parser.add_argument("--async_level", type=int, default=None,
                      help="max_async_level of every run (at least its K); default K "
                           "itself (the adaptive runs: 8), so a fixed K drops nothing")
  parser.add_argument("--ks", default=None,
                      help="comma-separated K values, `adaptive` among them; default "
                           "0,1,2,4,8, quick 2,adaptive")
  args = parser.parse_args()
  seeds = args.seeds or (1 if args.quick else 2)
  steps = args.steps or (3 if args.quick else 100)
  ks = _ks(args.ks) if args.ks else ((2, ADAPTIVE) if args.quick else KS)
  losses = (tuple(x for x in args.losses.split(",") if x) if args.losses else
            tuple(LOSSES)[:1] if args.quick else tuple(LOSSES))
  if args.evals < 1:
    parser.error(f"--evals must be >= 1, got {args.evals}")
  if args.async_level is not None and args.async_level < 0:
    parser.error(f"--async_level must be >= 0, got {args.async_level}")
  unknown = sorted(set(losses) - set(LOSSES))
  if unknown:
    parser.error(f"unknown loss(es) {unknown}; known: {list(LOSSES)}")

  start = time.monotonic()
  runs: list[dict] = []
  with tempfile.TemporaryDirectory() as cache_dir:
    # Every run_lib.run builds fresh jitted functions, so in-memory caches
    # never hit across runs; the persistent cache keys on the compiled program
    # and lets each run after the first skip compilation. A cache the caller
    # set up (JAX_COMPILATION_CACHE_DIR, e.g. the test session's) is kept.
    jax.config.update("jax_compilation_cache_dir",
                      os.environ.get("JAX_COMPILATION_CACHE_DIR") or cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # Seeds outermost, so a drift in machine load spreads over all cells.
    for seed in range(seeds):
      for loss in losses:
        for k in ks:
          row = run_one(loss, k, seed, steps, args.quick, args.evals, args.async_level)
          runs.append(row)
          print(f"seed {seed} {loss:<13s} K={k}: lag {row['lag']:.2f} (tail "
                f"{row['lag_tail']:.2f}) | eval "
                f"{row['eval_start']:.3f} -> {row['eval_final']:.3f} | train reward "
                f"{row['train_reward']:.3f} | ess {row['ess']:.3f} | stale drops "
                f"{row['dropped_stale']} | {row['wall_s']:.1f}s", flush=True)
  add_paired_deltas(runs)
  aggregates = [aggregate([r for r in runs if r["loss"] == loss and r["K"] == k])
                for loss in losses for k in ks]
  print()
  report.print_table([_table_row(a) for a in aggregates],
                     title=f"staleness: arith{'_tiny' if args.quick else ''}, {steps} updates "
                           f"per run, mean+-std over {seeds} seed(s)")
  if args.evals > 1:
    curves = [curve_row([r for r in runs if r["loss"] == loss and r["K"] == k])
              for loss in losses for k in ks]
    report.print_table([{key: value for key, value in c.items()
                         if key not in ("benchmark", "part")} for c in curves],
                       title="held-out reward (mean over seeds) at each evaluation: "
                             "reward @ update (mean RL wall s)")
    aggregates += curves
  print(f"held-out reward after warm-up (RL start) per seed: "
        f"{sorted({(r['seed'], round(r['eval_start'], 3)) for r in runs})}")
  print(f"total wall {time.monotonic() - start:.1f}s")
  report.append_jsonl(runs + aggregates, args.out)


if __name__ == "__main__":
  main()
