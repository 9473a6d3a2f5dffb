"""The repository passes its own lint settings (`[tool.ruff]` in pyproject.toml):
code, tests, benchmarks, launch scripts and the notebook."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
  proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
