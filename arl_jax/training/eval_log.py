"""Held-out evaluation as the run records it: a `metrics.jsonl` row, a progress
line and the run's evaluation history.

The greedy pass runs where it is called, on the learner's params. The sampled
pass (`eval_samples`) of a published version runs beside training
(`sampled_eval.py`) when the run gives a background runner; its row follows
at the step it evaluated. Otherwise (the warm-up, the params before the first
publish, a multi-controller run) it runs right after the greedy pass, on the
params placed where it runs, and shares the greedy pass's row.
"""

from __future__ import annotations

import time

from arl_jax.training import sampled_eval as sampled_eval_lib


class EvalLog:
  """Calls an `evaluation.Evaluator` (or nothing, when evaluation is off) and
  records each result."""

  def __init__(self, evaluator, *, writer, print_fn, start_time: float,
               place_sampled=None, background: bool = False):
    """Args:
      evaluator: an `evaluation.Evaluator`, or None (no evaluation).
      writer: the run's metric writer.
      print_fn: where the progress line goes.
      start_time: the run's start (`time.monotonic()`), for `wall_s`.
      place_sampled: params -> those params where the sampled pass runs (the
        sampler mesh, in its dtype); None: as given.
      background: run the sampled pass of a published version beside
        training (`sampled_eval.BackgroundSampledEval`).
    """
    self._evaluator = evaluator
    self._writer = writer
    self._print = print_fn
    self._start_time = start_time
    self._place = place_sampled or (lambda params: params)
    self._background = (sampled_eval_lib.BackgroundSampledEval(evaluator.sampled)
                        if background and evaluator is not None and evaluator.samples else None)
    self._new_pass_at_k: dict | None = None  # for the next update's progress line
    self.rl_start: float | None = None  # set when RL starts (the step records' clock)
    self.history: list[dict] = []

  @property
  def enabled(self) -> bool:
    return self._evaluator is not None

  def __call__(self, params, step: int, phase: str, published=None) -> float | None:
    """Evaluates `params` as of `step` of `phase` (`warmup` or `rl`); returns
    the greedy mean reward (None when evaluation is off). `published`: the
    same version's published params (on the sampler mesh), which a
    background sampled pass evaluates."""
    if self._evaluator is None:
      return None
    result = self._evaluator.greedy(params)
    record = {"phase": phase, "step": step, "eval_reward": result.reward,
              "eval_reward_by_env": result.reward_by_env,
              # Faults of the environment's calls (those episodes scored 0).
              "eval_env_errors": result.env_errors}
    sampled = None
    if self._evaluator.samples:
      if self._background is not None and published is not None:
        self._background.submit(published, step, phase)
      else:
        if self._background is not None:  # (its generator is the one in flight's)
          self._background.wait()
        sampled = self._evaluator.sampled(self._place(params))
        for env, n in sampled.pop("env_errors").items():  # (both passes' faults)
          record["eval_env_errors"][env] += n
        record.update(_sampled_fields(sampled))
        self._new_pass_at_k = record["eval_pass_at_k"]
    self._record(self._timed(record, phase, time.monotonic()))
    sample = "; ".join(f"{p}{c!r}" for p, c in result.examples)
    self._print(f"eval [{phase} step {step}] reward {result.reward:.3f}"
                f"{_sampled_summary(sampled) if sampled else ''} on {result.num_prompts} "
                f"held-out prompts ({sample})")
    return result.reward

  def before_checkpoint(self, version: int) -> int | None:
    """Before a checkpoint of `version`: writes the sampled rows that
    finished, waits for one in flight of an older version (its row belongs
    before the checkpoint: its params are gone after it) and returns the
    step of one of `version` itself, which runs on (None: none). The
    checkpoint notes that step; a resume from it evaluates it again
    (`resume_sampled`), and its row, written after the checkpoint's lines,
    is set aside then."""
    if self._background is None:
      return None
    running = self._background.running_step
    self._write_finished(wait=running is not None and running < version)
    return self._background.running_step

  def resume_sampled(self, step: int, phase: str, published) -> None:
    """Evaluates again the sampled pass a checkpoint noted as running."""
    if self._background is not None:
      self._print(f"the sampled evaluation of step {step} was running at the checkpoint: "
                  "evaluating it again")
      self._background.submit(published, step, phase)

  def collect(self, wait: bool = False) -> dict | None:
    """Writes the rows of the background sampled evaluations that finished
    (after waiting for the one in flight, with `wait`); returns the newest
    sampled pass@k recorded since the last call (None: none), for a
    progress line."""
    self._write_finished(wait)
    pass_at_k, self._new_pass_at_k = self._new_pass_at_k, None
    return pass_at_k

  def _write_finished(self, wait: bool) -> None:
    if self._background is None:
      return
    if wait and self._background.running_step is not None:
      self._print(f"waiting for the sampled evaluation of step {self._background.running_step}")
      self._background.wait()
    for done in self._background.collect():
      self._record_sampled(done)

  def _record_sampled(self, done: sampled_eval_lib.Finished) -> None:
    sampled = dict(done.result)
    errors = sampled.pop("env_errors")
    record = self._timed({"phase": done.phase, "step": done.step, **_sampled_fields(sampled),
                          "eval_sampled_env_errors": errors,
                          # Its own time beside training, and how long the learner
                          # waited for the one before it to start it.
                          "eval_sampled_s": done.seconds, "eval_sampled_wait_s": done.waited},
                         done.phase, done.started + done.seconds)
    self._new_pass_at_k = record["eval_pass_at_k"]
    self._record(record)
    self._print(f"eval [{done.phase} step {done.step}] sampled{_sampled_summary(sampled)} "
                f"({done.seconds:.1f} s beside training)")

  def _timed(self, record: dict, phase: str, at: float) -> dict:
    record["wall_s"] = at - self._start_time
    if phase == "rl":  # on the RL clock of the step records (0 before the first update)
      record["rl_wall_s"] = at - self.rl_start if self.rl_start is not None else 0.0
    return record

  def _record(self, record: dict) -> None:
    self.history.append(record)
    self._writer.write(record)


def _sampled_fields(sampled: dict) -> dict:
  """An `Evaluator.sampled` result as record fields (JSON keys are strings)."""
  return {"eval_samples": sampled["samples"], "eval_avg_at_n": sampled["avg_at_n"],
          "eval_pass_at_k": {str(k): v for k, v in sampled["pass_at_k"].items()},
          "eval_sampled_by_env": {
              env: {"avg_at_n": v["avg_at_n"],
                    "pass_at_k": {str(k): p for k, p in v["pass_at_k"].items()}}
              for env, v in sampled["sampled_by_env"].items()}}


def _sampled_summary(sampled: dict) -> str:
  n = sampled["samples"]
  return (f", sampled: pass@1 {sampled['pass_at_k'][1]:.3f} pass@{n} "
          f"{sampled['pass_at_k'][n]:.3f} avg@{n} {sampled['avg_at_n']:.3f}")
