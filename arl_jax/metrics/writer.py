"""Metric sinks behind one interface (`write(record)`, `close()`): JSON lines
in the workdir (always: `python -m arl_jax.plot` and the sweep summaries read
them), TensorBoard event files (`config.writers="jsonl,tensorboard"`), and the
one-line progress print.

A record is a flat dict with a `phase` (`rl`, `warmup`, `data`, or an
evaluation's phase) and a `step`; TensorBoard gets every number in it as a
scalar `<phase>/<key>` (nested dicts such as `reward_by_env` flattened to
`<phase>/<key>/<name>`), evaluations as `eval/<key>`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping


def _jsonable(value):
  if hasattr(value, "item"):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


WRITERS = ("jsonl", "tensorboard")


def check_available(name: str) -> None:
  """Raises ImportError, with the install hint, if writer `name` cannot run."""
  if name == "tensorboard":
    try:
      import tensorboard  # noqa: F401, PLC0415 - optional dependency
    except ImportError as e:
      raise ImportError("the tensorboard writer needs the `tensorboard` package: "
                        "pip install -e '.[tensorboard]'") from e


class JsonlWriter:
  """Appends one JSON object per call to `<workdir>/metrics.jsonl`."""

  def __init__(self, workdir: str, filename: str = "metrics.jsonl"):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, filename)
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

  def write(self, record: Mapping) -> None:
    self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
    self._file.flush()

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
    phase = "eval" if "eval_reward" in record and "reward_mean" not in record else \
        record.get("phase", "run")
    values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
              for tag, value in _scalars(phase, {k: v for k, v in record.items()
                                                 if k not in ("phase", "step")})]
    if values:
      self._writer.add_event(self._event_pb2.Event(
          step=int(record["step"]), wall_time=time.time(),
          summary=self._summary_pb2.Summary(value=values)))

  def close(self) -> None:
    self._writer.close()


class MultiWriter:
  """Writes every record to each sink."""

  def __init__(self, writers):
    self.writers = list(writers)

  def write(self, record: Mapping) -> None:
    for w in self.writers:
      w.write(record)

  def close(self) -> None:
    for w in self.writers:
      w.close()


def make_writer(workdir: str, names=("jsonl",)) -> MultiWriter:
  """JSON lines always, plus the other named sinks."""
  writers = [JsonlWriter(workdir)]
  if "tensorboard" in names:
    writers.append(TensorBoardWriter(workdir))
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
      f"t{record['dropped_truncated']:d}",
      f"loss {record['loss']:+.4f}",
      f"ratio max {record['ratio_max']:.3f}",
  ]
  if "eval_reward" in record:
    parts.append(f"eval {record['eval_reward']:.3f}")
  if "eta_s" in record:
    minutes, seconds = divmod(int(round(record["eta_s"])), 60)
    parts.append(f"eta {minutes}m{seconds:02d}s")
  return " | ".join(parts)


def print_line(line: str) -> None:
  print(line, file=sys.stdout, flush=True)
