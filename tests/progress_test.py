"""What a person watching a run sees: a live bar in a terminal (with the
progress line's fields), full lines every `log_every` updates, and plain
lines only when the output is not a terminal."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest

from arl_jax.metrics import host_memory
from arl_jax.metrics import progress as progress_lib
from arl_jax.metrics import startup as startup_lib
from arl_jax.metrics import writer as writer_lib
from arl_jax.testing import xla_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(step, **extra):
  return {"step": step, "version": step + 1, "reward_mean": 0.25, "lag_mean": 0.5, "lag_max": 1,
          "lag_in_queue_mean": 0.1, "tokens_per_s": 1234.0, "drop_rate": 0.02,
          "dropped_stale": 1, "dropped_cancelled": 0, "dropped_env_error": 0,
          "dropped_truncated": 0, "loss": 0.1, "ratio_max": 1.2, "eta_s": 30.0, **extra}


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_off_a_terminal_lines_come_every_log_every_updates_the_last_and_evaluations():
  lines = []
  assert not progress_lib.wants_bar(lines.append, _Terminal())  # not the default printer
  assert not progress_lib.wants_bar(writer_lib.print_line, io.StringIO())  # not a TTY
  progress = progress_lib.Progress(total=30, initial=0, log_every=10, print_fn=lines.append,
                                   bar=False)
  for step in range(30):
    progress.update(_record(step, **({"eval_reward": 0.5} if step == 15 else {})))
  progress.close()
  assert [int(re.match(r"step +(\d+)", line).group(1)) for line in lines] == [0, 10, 15, 20, 29]
  assert "eval 0.500" in lines[2] and "eta 0m30s" in lines[0]
  silent = progress_lib.Progress(total=3, initial=0, log_every=0, print_fn=lines.append,
                                 bar=False)
  for step in range(3):
    silent.update(_record(step))
  assert len(lines) == 5  # log_every 0: no lines


def test_in_a_terminal_a_bar_counts_updates_and_lines_print_above_it(capsys):
  terminal = _Terminal()
  assert progress_lib.wants_bar(writer_lib.print_line, terminal)
  progress = progress_lib.Progress(total=20, initial=5, log_every=100,
                                   print_fn=writer_lib.print_line, bar=True, stream=terminal)
  for step in range(5, 8):
    progress.update(_record(step, **({"eval_reward": 0.75} if step == 6 else {})))
    writer_lib.print_line(f"a line at {step}")  # e.g. an evaluation's, above the bar
  shown = terminal.getvalue()
  assert "8/20" in shown and "reward 0.250" in shown and "1234 tok/s" in shown
  assert "eval 0.750" in shown and "drops 2.0%" in shown
  progress.close()
  out = capsys.readouterr().out
  assert "a line at 7" in out and "step    6" in out  # the evaluation's full line
  writer_lib.print_line("after")  # the bar is closed: a plain print
  assert capsys.readouterr().out == "after\n"


def test_a_run_in_a_pseudo_terminal_shows_the_bar(tmp_path):
  """`python -m arl_jax.launch` with stdout a terminal draws the bar (off a
  terminal `wants_bar` is False: the first test)."""
  main, child = pty.openpty()
  fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
  proc = subprocess.Popen(
      [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
       f"--workdir={tmp_path / 'tty'}", "--config.eval_every=0"], cwd=REPO, env=xla_env.subprocess_env(1),
      stdout=child, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
  os.close(child)
  output = b""
  while True:
    ready, _, _ = select.select([main], [], [], 300)
    if not ready:
      proc.kill()
      raise AssertionError(output[-3000:])
    try:
      chunk = os.read(main, 65536)
    except OSError:  # the child closed the terminal
      break
    if not chunk:
      break
    output += chunk
  assert proc.wait(timeout=60) == 0, output[-3000:]
  text = output.decode(errors="replace")
  assert re.search(r"4/4 \[.*update", text), text[-3000:]  # tqdm's count and rate
  assert "reward " in text and "done: 4 updates" in text
  # Where the whole run's host memory peaked: the first line's start-up phases
  # and the last line (Linux measures it).
  if os.path.exists("/proc/self/clear_refs"):
    assert re.search(r"startup [\d.]+ s: .*; \d+ programs \(\d+ from the cache\); "
                     r"host peak [\d.]+ GiB \([\w-]+\)", text), text[-3000:]
    assert re.search(r"tasks never trained; host peak [\d.]+ GiB", text), text[-3000:]


def test_the_first_update_s_line_says_where_the_startup_went_whatever_log_every_says():
  lines = []
  progress = progress_lib.Progress(total=300, initial=21, log_every=100, print_fn=lines.append,
                                   bar=False, first_line_suffix="startup 9.0 s: import 3.0")
  for step in range(21, 24):  # (a resumed run: 21 is no multiple of log_every)
    progress.update(_record(step))
  assert len(lines) == 1 and lines[0].startswith("step   21 ")
  assert lines[0].endswith(" | startup 9.0 s: import 3.0")


class _ScriptedPeaks:
  """Peak windows whose peaks (GiB) are given in order."""

  def __init__(self, gib):
    self._bytes = [None if g is None else int(g * 1024**3) for g in gib]

  def take(self):
    return self._bytes.pop(0)


def test_startup_phases_add_up_in_order_with_each_phase_s_host_memory_peak():
  now = [10.0]
  clock = startup_lib.StartupClock(started_at=7.5, clock=lambda: now[0],
                                   memory=_ScriptedPeaks([0.5, 1.0, 3.25, 1.5, 1.0, 2.0]))
  for phase, seconds in (("build", 1.0), ("warm-up", 20.0), ("build", 0.5), ("eval", 0.01),
                         ("compile", 12.2)):
    now[0] += seconds
    clock.mark(phase)
  assert clock.summary() == ("startup 36.2 s: import 2.5, build 1.5, warm-up 20.0, "
                             "compile 12.2; host peak 3.2 GiB (warm-up)")
  record = clock.record()
  assert record["startup_warmup_s"] == 20.0 and record["startup_eval_s"] == 0.01
  assert record["startup_s"] == 36.21
  # A phase that ends twice keeps the larger of its windows' peaks.
  assert record["startup_import_peak_gib"] == 0.5 and record["startup_build_peak_gib"] == 1.5
  assert record["startup_warmup_peak_gib"] == 3.25
  assert startup_lib.StartupClock(clock=lambda: 1.0,
                                  memory=_ScriptedPeaks([])).summary() == "startup 0.0 s: "
  # Where the platform measures no peak, the line and the row say nothing of it.
  blind = startup_lib.StartupClock(started_at=0.0, clock=lambda: 1.0,
                                   memory=_ScriptedPeaks([None, None]))
  blind.mark("build")
  assert blind.summary() == "startup 1.0 s: import 1.0" and "startup_build_peak_gib" not in (
      blind.record())


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak windows")
def test_a_peak_window_sees_memory_freed_before_it_ended_and_the_next_window_does_not():
  windows = host_memory.PeakWindows()
  assert windows.resettable
  windows.take()
  block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
  del block
  first, second = windows.take(), windows.take()
  assert first - second >= 250 * 2**20, (first, second)
  assert host_memory.resident_bytes() <= host_memory.peak_bytes()


def test_sampler_compiles_show_lines_off_a_terminal_and_a_bar_in_one():
  now = [0.0]
  lines = []
  compile_progress = progress_lib.CompileProgress(print_fn=lines.append, bar=False, every_s=10,
                                                  clock=lambda: now[0])
  compile_progress(0, 4, "decode steps=1")
  for done, label in enumerate(("decode steps=1", "insert rows=4 context=8", "fork rows=4",
                                "take_rows rows=4"), start=1):
    now[0] += 6.0
    compile_progress(done, 4, label)
  assert lines == [
      "compiling 4 sampler programs (first: decode steps=1)",
      "compiling sampler programs: 2/4 done, 12.0 s (last: insert rows=4 context=8)",
      "compiled 4 sampler programs in 24.0 s"]

  terminal = _Terminal()
  lines = []
  compile_progress = progress_lib.CompileProgress(print_fn=lines.append, bar=True,
                                                  stream=terminal)
  compile_progress(0, 2, "decode steps=1")
  compile_progress(1, 2, "decode steps=1")
  assert "1/2" in terminal.getvalue() and "compiling" in terminal.getvalue()
  compile_progress(2, 2, "take_rows rows=4")
  assert lines[0] == "compiling 2 sampler programs (first: decode steps=1)"
  assert lines[-1].startswith("compiled 2 sampler programs in ")
  writer_lib.print_line("after")  # (the bar is closed: nothing left active)


def test_the_line_shows_zero_variance_drops_and_the_sampled_pass_at_n():
  line = writer_lib.progress_line(_record(3))
  assert " z" not in line and "pass@" not in line
  line = writer_lib.progress_line(_record(3, dropped_zero_variance=12, eval_reward=0.5,
                                          eval_pass_at_k={"1": 0.25, "2": 0.4, "8": 0.75}))
  assert "t0 z12 |" in line and "eval 0.500 | pass@8 0.750" in line
