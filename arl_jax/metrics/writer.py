"""Metric sinks behind one interface (`write(record)`, `close()`): JSON lines
in the workdir (always: `python -m arl_jax.plot` and the sweep summaries read
them), TensorBoard event files (`config.writers="jsonl,tensorboard"`),
Weights & Biases (`"jsonl,wandb"`, when `wandb` is installed; project from
`WANDB_PROJECT`, default `arl_jax`), and the one-line progress print.

A record is a flat dict with a `phase` (`rl`, `warmup`, `data`, or an
evaluation's phase) and a `step`; TensorBoard gets every number in it as a
scalar `<phase>/<key>` (nested dicts such as `reward_by_env` flattened to
`<phase>/<key>/<name>`), evaluations as `eval/<key>`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping


def _jsonable(value):
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


WRITERS = ("jsonl", "tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_available(name: str) -> None:
  """Raises ImportError, with the install hint, if writer `name` cannot run."""
  package = _PACKAGES.get(name)
  if package is not None and importlib.util.find_spec(package) is None:
    raise ImportError(f"the {name} writer needs the `{package}` package: pip install {package}")



def is_eval_record(record: Mapping) -> bool:
  """Whether a record is an evaluation's: the greedy pass's (`eval_reward`)
  or a sampled pass's written on its own (`eval_pass_at_k`), not an update's."""
  return ("eval_reward" in record or "eval_pass_at_k" in record) and "reward_mean" not in record

class JsonlWriter:
  """Appends one JSON object per call to `<workdir>/metrics.jsonl`.

  `lines` counts the file's lines (those already there included): a
  checkpoint records it, and a resume keeps exactly that many
  (`training/records.py`).
  """

  def __init__(self, workdir: str, filename: str = "metrics.jsonl"):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    self.lines = 0
    if os.path.exists(self.path):
      with open(self.path, "rb") as f:
        self.lines = sum(1 for _ in f)
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
    self._lock = threading.Lock()  # (the fleet's thread writes its events too)

  def write(self, record: Mapping) -> None:
    line = json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n"
    with self._lock:
      self._file.write(line)
      self._file.flush()
      self.lines += 1

  def close(self) -> None:
    self._file.close()


def _scalars(prefix: str, record: Mapping):
  """`(tag, value)` for every number in `record` (numpy scalars too), dicts flattened."""
  for key, value in record.items():
    if isinstance(value, Mapping):
      yield from _scalars(f"{prefix}/{key}", value)
      continue
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
      value = value.item()  # numpy and JAX scalars
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      yield f"{prefix}/{key}", float(value)


class TensorBoardWriter:
  """Scalars in TensorBoard event files under `<workdir>/tensorboard` (no TF needed)."""

  def __init__(self, workdir: str):
    check_available("tensorboard")
    from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: PLC0415
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: PLC0415

    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    self.logdir = os.path.join(workdir, "tensorboard")
    self._writer = EventFileWriter(self.logdir)

  def write(self, record: Mapping) -> None:
    if "step" not in record:
      return  # e.g. the data-skipping record: nothing to plot against
    phase = "eval" if is_eval_record(record) else record.get("phase", "run")
    values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
              for tag, value in _scalars(phase, {k: v for k, v in record.items()
                                                 if k not in ("phase", "step")})]
    if values:
      self._writer.add_event(self._event_pb2.Event(
          step=int(record["step"]), wall_time=time.time(),
          summary=self._summary_pb2.Summary(value=values)))

  def close(self) -> None:
    self._writer.close()


class WandbWriter:
  """Every number of every record logged to a Weights & Biases run."""

  def __init__(self, workdir: str, run_config: Mapping | None = None):
    check_available("wandb")
    import wandb  # noqa: PLC0415 - optional dependency

    self._wandb = wandb
    self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "arl_jax"), dir=workdir,
                           name=os.path.basename(os.path.normpath(workdir)),
                           config=dict(run_config or {}))

  def write(self, record: Mapping) -> None:
    if "step" not in record:
      return
    phase = "eval" if is_eval_record(record) else record.get("phase", "run")
    values = dict(_scalars(phase, {k: v for k, v in record.items() if k not in ("phase", "step")}))
    if values:
      self._run.log(values, step=int(record["step"]) if phase == "rl" else None)

  def close(self) -> None:
    self._run.finish()


class MultiWriter:
  """Writes every record to each sink."""

  def __init__(self, writers):
    self.writers = list(writers)

  @property
  def lines(self) -> int:
    """Lines of the JSON-lines file (the first sink)."""
    return self.writers[0].lines

  def write(self, record: Mapping) -> None:
    for w in self.writers:
      w.write(record)

  def close(self) -> None:
    for w in self.writers:
      w.close()


def make_writer(workdir: str, names=("jsonl",), run_config: Mapping | None = None) -> MultiWriter:
  """JSON lines always, plus the other named sinks (`run_config`: the resolved
  config, for sinks that record it)."""
  writers = [JsonlWriter(workdir)]
  if "tensorboard" in names:
    writers.append(TensorBoardWriter(workdir))
  if "wandb" in names:
    writers.append(WandbWriter(workdir, run_config))
  return MultiWriter(writers)


def progress_line(record: Mapping) -> str:
  """`step 12 | v12 | reward 0.410 | lag 0.92/1 (queue 0.10) | 1200 tok/s | drops 3.1%
  s24 c8 e0 t0 | ...`, plus eval. Drops are cumulative rollouts by reason: stale,
  cancelled in flight, env error, truncated (masked)."""
  parts = [
      f"step {record['step']:>4d}",
      f"v{record['version']}",
      f"reward {record['reward_mean']:.3f}",
      f"lag {record['lag_mean']:.2f}/{record['lag_max']:d} "
      f"(queue {record['lag_in_queue_mean']:.2f})",
      f"{record['tokens_per_s']:.0f} tok/s",
      f"drops {100 * record['drop_rate']:.1f}% s{record['dropped_stale']:d} "
      f"c{record['dropped_cancelled']:d} e{record['dropped_env_error']:d} "
      f"t{record['dropped_truncated']:d}"
      + (f" z{record['dropped_zero_variance']:d}" if record.get("dropped_zero_variance") else ""),
      f"loss {record['loss']:+.4f}",
      f"ratio max {record['ratio_max']:.3f}",
  ]
  if "eval_reward" in record:
    parts.append(f"eval {record['eval_reward']:.3f}")
  if "eval_pass_at_k" in record:  # the sampled evaluation: pass@n, n its samples
    n = max(record["eval_pass_at_k"], key=int)
    parts.append(f"pass@{n} {record['eval_pass_at_k'][n]:.3f}")
  if "eta_s" in record:
    minutes, seconds = divmod(int(round(record["eta_s"])), 60)
    parts.append(f"eta {minutes}m{seconds:02d}s")
  return " | ".join(parts)


_active_bar = None  # a live progress bar (`progress.Progress`) lines print above


def set_active_bar(bar) -> None:
  global _active_bar
  _active_bar = bar


def print_line(line: str) -> None:
  """The run's lines on stdout (above the progress bar, when one is open)."""
  if _active_bar is not None:
    _active_bar.write(line, file=sys.stdout)
  else:
    print(line, file=sys.stdout, flush=True)
