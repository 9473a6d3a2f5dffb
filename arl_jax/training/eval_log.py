"""Held-out evaluation as the run records it: a `metrics.jsonl` row, a progress
line and the run's evaluation history."""

from __future__ import annotations

import time


class EvalLog:
  """Calls an `evaluation.Evaluator` (or nothing, when evaluation is off) and
  records each result."""

  def __init__(self, evaluator, *, writer, print_fn, start_time: float):
    """Args:
      evaluator: `params -> evaluation.EvalResult`, or None (no evaluation).
      writer: the run's metric writer.
      print_fn: where the progress line goes.
      start_time: the run's start (`time.monotonic()`), for `wall_s`.
    """
    self._evaluator = evaluator
    self._writer = writer
    self._print = print_fn
    self._start_time = start_time
    self.rl_start: float | None = None  # set when RL starts (the step records' clock)
    self.history: list[dict] = []

  @property
  def enabled(self) -> bool:
    return self._evaluator is not None

  def __call__(self, params, step: int, phase: str) -> float | None:
    """Evaluates `params` as of `step` of `phase` (`warmup` or `rl`); returns
    the mean reward (None when evaluation is off)."""
    if self._evaluator is None:
      return None
    result = self._evaluator(params)
    now = time.monotonic()
    record = {"phase": phase, "step": step, "eval_reward": result.reward,
              "eval_reward_by_env": result.reward_by_env,
              # Faults of the environment's calls (those episodes scored 0).
              "eval_env_errors": result.env_errors, "wall_s": now - self._start_time}
    if result.samples:  # the sampled pass (JSON keys are strings)
      record.update({
          "eval_samples": result.samples, "eval_avg_at_n": result.avg_at_n,
          "eval_pass_at_k": {str(k): v for k, v in result.pass_at_k.items()},
          "eval_sampled_by_env": {
              env: {"avg_at_n": v["avg_at_n"],
                    "pass_at_k": {str(k): p for k, p in v["pass_at_k"].items()}}
              for env, v in result.sampled_by_env.items()}})
    if phase == "rl":  # on the RL clock of the step records (0 before the first update)
      record["rl_wall_s"] = now - self.rl_start if self.rl_start is not None else 0.0
    self.history.append(record)
    self._writer.write(record)
    sample = "; ".join(f"{p}{c!r}" for p, c in result.examples)
    sampled = ""
    if result.samples:
      n = result.samples
      sampled = (f", sampled: pass@1 {result.pass_at_k[1]:.3f} pass@{n} "
                 f"{result.pass_at_k[n]:.3f} avg@{n} {result.avg_at_n:.3f}")
    self._print(f"eval [{phase} step {step}] reward {result.reward:.3f}{sampled} on "
                f"{result.num_prompts} held-out prompts ({sample})")
    return result.reward
