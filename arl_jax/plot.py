r"""PNG plots of one or more runs: `python -m arl_jax.plot WORKDIR [WORKDIR ...]`.

Reads each workdir's `metrics.jsonl` and writes, to `--out` (default
`<first workdir>/plots`), one figure per question, with every run overlaid
(labelled by its folder name, so `sync` against `async` reads directly):

- `reward.png`: batch reward (faint; solid: a trailing mean over 5% of the
  run) and held-out evaluations, against update step and against RL wall time;
- `lag.png`: how many versions old trained groups were (histogram over the
  run, as a share of groups);
- `ratio_by_lag.png`: mean |log pi/mu| of trained tokens by the lag of the
  token (the learner's staleness metrics, token-weighted over the run);
- `drops.png`: dropped rollouts by reason, and drop rate by completion length;
- `busy.png`: learner and sampler busy fractions, and sampler slot
  occupancy, over wall time.

  python -m arl_jax.plot /tmp/sync /tmp/async --out=/tmp/plots
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display needed (servers, CI, notebooks)
import matplotlib.pyplot as plt  # noqa: E402

from arl_jax.metrics import writer as writer_lib  # noqa: E402
from arl_jax.orchestrator import drop_ledger  # noqa: E402

FIGURES = ("reward", "lag", "ratio_by_lag", "drops", "busy")
DROP_REASONS = drop_ledger.REASONS


class Run:
  """One workdir's records: RL steps and held-out evaluations."""

  def __init__(self, workdir: str):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{workdir}: no metrics.jsonl (is this a run's --workdir?)")
    self.label = os.path.basename(os.path.normpath(workdir))
    self.steps, self.evals = [], []
    with open(path, encoding="utf-8") as f:
      for line_number, line in enumerate(f, 1):
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{line_number}: not JSON ({e})") from e
        if record.get("phase") == "rl" and "reward_mean" in record:
          self.steps.append(record)
        elif writer_lib.is_eval_record(record):
          self.evals.append(record)
    if not self.steps:
      raise ValueError(f"{path}: no RL step records to plot")

  def series(self, key: str, x: str = "step"):
    points = [(r[x], r[key]) for r in self.steps if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _save(fig, out_dir: str, name: str) -> str:
  path = os.path.join(out_dir, f"{name}.png")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_reward(runs: Sequence[Run], out_dir: str) -> str:
  fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
  for i, run in enumerate(runs):
    color = f"C{i}"
    for ax, x in ((by_step, "step"), (by_time, "wall_s")):
      xs, ys = run.series("reward_mean", x)
      ax.plot(xs, ys, color=color, alpha=0.2)
      ax.plot(xs, _smooth(ys), color=color, label=f"{run.label} batch (smoothed)")
    rl_evals = [e for e in run.evals if e.get("phase") == "rl"]
    greedy = [e for e in rl_evals if "eval_reward" in e]
    if greedy:
      by_step.plot([e["step"] for e in greedy], [e["eval_reward"] for e in greedy], "o--",
                   color=color, label=f"{run.label} held-out")
      timed = [e for e in greedy if "rl_wall_s" in e]  # older runs lack it
      by_time.plot([e["rl_wall_s"] for e in timed], [e["eval_reward"] for e in timed], "o--",
                   color=color)
      sampled = [e for e in rl_evals if "eval_pass_at_k" in e]
      if sampled:  # the sampled evaluation: pass@n and avg@n beside the greedy score
        n = str(sampled[-1]["eval_samples"])
        steps = [e["step"] for e in sampled]
        by_step.plot(steps, [e["eval_pass_at_k"][n] for e in sampled], "s:", color=color,
                     label=f"{run.label} held-out pass@{n}")
        by_step.plot(steps, [e["eval_avg_at_n"] for e in sampled], "^:", color=color,
                     label=f"{run.label} held-out avg@{n}")
  by_step.set(xlabel="update", ylabel="reward", title="reward by update")
  by_time.set(xlabel="RL wall time (s)", ylabel="reward", title="reward by wall time")
  by_step.legend(fontsize=8)
  return _save(fig, out_dir, "reward")


def _smooth(values: list[float]) -> list[float]:
  """Trailing mean over ~5% of the run (at least 1 point), to read trends."""
  window = max(1, len(values) // 20)
  return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
          for i in range(len(values))]


def plot_lag(runs: Sequence[Run], out_dir: str) -> str:
  fig, ax = plt.subplots(figsize=(6, 4))
  width = 0.8 / len(runs)
  for i, run in enumerate(runs):
    counts = collections.Counter()
    for r in run.steps:
      counts.update({int(k): v for k, v in r.get("lag_histogram", {}).items()})
    total = sum(counts.values()) or 1
    lags = sorted(counts)
    ax.bar([lag + i * width for lag in lags], [counts[lag] / total for lag in lags], width,
           label=run.label)
  ax.set(xlabel="lag (versions between dispatch and training)", ylabel="share of groups",
         title="policy lag of trained groups")
  ax.legend(fontsize=8)
  return _save(fig, out_dir, "lag")


def _lag_buckets(record: dict) -> list[str]:
  """`abs_log_ratio_lag<bucket>` keys in lag order (`0`, `1`, ..., `8`, `9+`; runs
  before 2026-12-08 logged `3_4` and `5_8`)."""
  buckets = [k[len("abs_log_ratio_lag"):] for k in record if k.startswith("abs_log_ratio_lag")]
  return sorted(buckets, key=lambda b: int(re.match(r"\d+", b).group()))


def plot_ratio_by_lag(runs: Sequence[Run], out_dir: str) -> str:
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, run in enumerate(runs):
    buckets = _lag_buckets(run.steps[-1])
    means = []
    for b in buckets:
      weighted = [(r.get(f"token_fraction_lag{b}", 0.0), r.get(f"abs_log_ratio_lag{b}", 0.0))
                  for r in run.steps]
      weight = sum(w for w, _ in weighted)
      means.append(sum(w * v for w, v in weighted) / weight if weight else float("nan"))
    ax.plot(buckets, means, "o-", color=f"C{i}", label=run.label)
  ax.set(xlabel="token lag (versions)", ylabel="mean |log pi/mu|", yscale="log",
         title="importance-ratio drift by lag")
  ax.legend(fontsize=8)
  return _save(fig, out_dir, "ratio_by_lag")


def plot_drops(runs: Sequence[Run], out_dir: str) -> str:
  fig, (by_reason, by_length) = plt.subplots(1, 2, figsize=(11, 4))
  width = 0.8 / len(runs)
  for i, run in enumerate(runs):
    last = run.steps[-1]
    by_reason.bar([j + i * width for j in range(len(DROP_REASONS))],
                  [last.get(f"dropped_{reason}", 0) for reason in DROP_REASONS], width,
                  label=run.label)
    rates = last.get("drop_rate_by_length", {})
    by_length.plot(list(rates), list(rates.values()), "o-", color=f"C{i}", label=run.label)
  by_reason.set_xticks([j + 0.4 - width / 2 for j in range(len(DROP_REASONS))], DROP_REASONS)
  by_reason.set(ylabel="rollouts dropped (whole run)", title="drops by reason")
  by_length.set(xlabel="completion length (tokens)", ylabel="drop rate",
                title="drop rate by completion length")
  by_reason.legend(fontsize=8)
  return _save(fig, out_dir, "drops")


def plot_busy(runs: Sequence[Run], out_dir: str) -> str:
  fig, ax = plt.subplots(figsize=(7, 4))
  for i, run in enumerate(runs):
    for key, style, name in (("learner_busy_fraction", "-", "learner busy"),
                             ("sampler_busy_fraction", "--", "sampler busy"),
                             ("sampler_occupancy", ":", "slot occupancy")):
      x, y = run.series(key, "wall_s")
      if x:
        ax.plot(x, y, style, color=f"C{i}", label=f"{run.label} {name}")
  ax.set(xlabel="RL wall time (s)", ylabel="fraction (cumulative)", ylim=(0, 1.05),
         title="who waits: busy fractions")
  ax.legend(fontsize=7)
  return _save(fig, out_dir, "busy")


def plot_all(workdirs: Sequence[str], out_dir: str | None = None) -> list[str]:
  """Writes every figure for `workdirs`; returns the PNG paths."""
  runs = [Run(w) for w in workdirs]
  out_dir = out_dir or os.path.join(workdirs[0], "plots")
  os.makedirs(out_dir, exist_ok=True)
  makers = {"reward": plot_reward, "lag": plot_lag, "ratio_by_lag": plot_ratio_by_lag,
            "drops": plot_drops, "busy": plot_busy}
  return [makers[name](runs, out_dir) for name in FIGURES]


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdirs", nargs="+", help="run folders holding metrics.jsonl")
  parser.add_argument("--out", default=None, help="folder for the PNGs")
  args = parser.parse_args(argv)
  try:
    paths = plot_all(args.workdirs, args.out)
  except (OSError, ValueError) as e:
    sys.exit(f"arl_jax.plot: {e}")
  print("\n".join(paths))


if __name__ == "__main__":
  main()
