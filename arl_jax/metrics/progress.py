"""What a person watching a run sees: a live bar in a terminal, lines elsewhere.

In a terminal (stdout a TTY, the default printer) the RL phase shows a tqdm
bar over the updates with the progress line's headline fields (reward, lag,
tokens/s, drops, the last evaluation) and tqdm's own rate and ETA, and a full
progress line (`writer.progress_line`) every `log_every` updates, on the
last one and with every evaluation, printed above the bar. Off a terminal
(CI, a log file, a notebook's captured output, a test's `print_fn`) there is
no bar: only those lines. Every other line of the run goes through
`writer.print_line`, which prints above an open bar instead of through it.
`metrics.jsonl` is written as always; nothing here reads or changes it.
"""

from __future__ import annotations

import shutil
import sys
import time

import tqdm

from arl_jax.metrics import writer as writer_lib


def wants_bar(print_fn, stream=None) -> bool:
  """A bar only where a person reads a terminal: the default printer on a TTY."""
  stream = sys.stdout if stream is None else stream
  return print_fn is writer_lib.print_line and bool(getattr(stream, "isatty", lambda: False)())


class Progress:
  """The RL phase's progress: `update(record)` per update, `close()` at the end."""

  def __init__(self, *, total: int, initial: int, log_every: int, print_fn, bar: bool,
               stream=None, first_line_suffix=None):
    """Args:
      total: the run's updates (`num_steps`).
      initial: updates done before (a resumed run's version).
      log_every: a full line every N updates, on the last and with each
        evaluation (0: no lines; the bar still shows).
      print_fn: where lines go.
      bar: show the live bar (`wants_bar`).
      stream: the bar's stream (stdout).
      first_line_suffix: appended to the first update's line, which is
        printed whatever `log_every` says (the run's startup phases); a
        callable is called then for it.
    """
    self._log_every = log_every
    self._total = total
    self._print = print_fn
    self._bar = None
    self._last_eval = None
    self._first_suffix = first_line_suffix
    if bar:
      stream = sys.stdout if stream is None else stream
      # (A terminal that reports no width, e.g. a fresh pseudo-terminal,
      # would get an empty bar: 120 columns then.)
      width = shutil.get_terminal_size((0, 0)).columns
      self._bar = tqdm.tqdm(total=total, initial=initial, unit="update", file=stream,
                            dynamic_ncols=width > 0, ncols=None if width > 0 else 120,
                            mininterval=0, smoothing=0.1)
      writer_lib.set_active_bar(self._bar)

  def update(self, record: dict) -> None:
    """One update's `metrics.jsonl` row."""
    step = record["step"]
    if "eval_reward" in record:
      self._last_eval = record["eval_reward"]
    is_last = step == self._total - 1
    if self._first_suffix is not None:
      suffix = self._first_suffix() if callable(self._first_suffix) else self._first_suffix
      self._print(f"{writer_lib.progress_line(record)} | {suffix}")
      self._first_suffix = None
    elif self._log_every and (step % self._log_every == 0 or is_last or "eval_reward" in record):
      self._print(writer_lib.progress_line(record))
    if self._bar is not None:
      self._bar.set_postfix_str(self.postfix(record), refresh=False)
      self._bar.update(1)

  def postfix(self, record: dict) -> str:
    """The bar's fields: `reward 0.41 lag 0.9 1200 tok/s drops 3.1% eval 0.38`."""
    parts = [f"reward {record['reward_mean']:.3f}", f"lag {record['lag_mean']:.2f}",
             f"{record['tokens_per_s']:.0f} tok/s", f"drops {100 * record['drop_rate']:.1f}%"]
    if self._last_eval is not None:
      parts.append(f"eval {self._last_eval:.3f}")
    return " ".join(parts)

  def close(self) -> None:
    if self._bar is not None:
      writer_lib.set_active_bar(None)
      self._bar.close()
      self._bar = None


class CompileProgress:
  """How far along the sampler's ahead-of-time compile is (`precompile.py`),
  as `progress_fn(done, total, label)` calls: a bar over the programs in a
  terminal, lines elsewhere (the first, one every `every_s` seconds with
  the program being compiled, and the last with the time spent)."""

  def __init__(self, *, print_fn, bar: bool, what: str = "sampler programs",
               every_s: float = 10.0, stream=None, clock=time.monotonic):
    self._print = print_fn
    self._want_bar = bar
    self._what = what
    self._every_s = every_s
    self._stream = stream
    self._clock = clock
    self._bar = None
    self._start = self._last_line = 0.0

  def __call__(self, done: int, total: int, label: str) -> None:
    now = self._clock()
    if done == 0:
      self._start = self._last_line = now
      self._print(f"compiling {total} {self._what} (first: {label})")
      if self._want_bar and total:
        self._bar = tqdm.tqdm(total=total, unit="program", desc="compiling",
                              file=sys.stdout if self._stream is None else self._stream,
                              mininterval=0, leave=False)
        writer_lib.set_active_bar(self._bar)
      return
    if self._bar is not None:
      self._bar.set_postfix_str(label, refresh=False)
      self._bar.update(1)
    elif done < total and now - self._last_line >= self._every_s:
      self._last_line = now
      self._print(f"compiling {self._what}: {done}/{total} done, {now - self._start:.1f} s "
                  f"(last: {label})")
    if done == total:
      if self._bar is not None:
        writer_lib.set_active_bar(None)
        self._bar.close()
        self._bar = None
      self._print(f"compiled {total} {self._what} in {now - self._start:.1f} s")
