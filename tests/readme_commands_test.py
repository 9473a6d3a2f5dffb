"""The README's commands keep working: every `python -m MODULE` and `python
benchmarks/SCRIPT.py` it names starts and prints its help, and every
`--config=` it names (and every variant of every built-in config) builds a
run spec. Issue 53 moved modules; this is what a user would notice first."""

import os
import re
import subprocess
import sys

import pytest

import arl_jax
from arl_jax.config import run_spec
from arl_jax.testing import xla_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
# Modules that take no --help of their own (the venv, pytest) or need a cluster.
_NOT_HERE = {"venv", "pytest"}


def _modules() -> list[str]:
  found = re.findall(r"python -m ([A-Za-z_][\w.]*)", README)
  return sorted(set(found) - _NOT_HERE)


def _scripts() -> list[str]:
  return sorted(set(re.findall(r"python (benchmarks/\w+\.py)", README)))


def test_every_command_the_readme_names_starts():
  assert "arl_jax.launch" in _modules() and "arl_jax.plot" in _modules()
  env = xla_env.subprocess_env()
  failed = []
  for command in [["-m", m] for m in _modules()] + [[s] for s in _scripts()]:
    proc = subprocess.run([sys.executable, *command, "--help"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    # (absl's --help exits 1 after printing; argparse's 0)
    said = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1) or "Traceback" in said or "--" not in said:
      failed.append(f"{' '.join(command)}: rc {proc.returncode}: {said[-800:]}")
  assert failed == []


def _readme_configs() -> list[tuple[str, str | None]]:
  """`(config, arg)` of each `--config=` the README names that needs no
  model folder (smollm2 and math_tpu: tests/models build them on a folder)."""
  found = set()
  for value in re.findall(r"--config=([\w./]+(?::[\w/.-]+)?)", README):
    path, _, arg = value.partition(":")
    if path in ("path",) or arg.startswith("/"):
      continue
    found.add((path, arg or None))
  return sorted(found, key=str)


@pytest.mark.parametrize("path, arg", _readme_configs())
def test_every_config_the_readme_names_builds(path, arg):
  spec = run_spec.build(arl_jax.load_config(path, arg))
  assert spec.run.num_steps > 0


@pytest.mark.parametrize("name, variants", [
    ("arith", ("", "sync", "tiny", "accelerator")), ("math_answer", ("", "sync", "tiny")),
    ("tool_agent", ("", "sync", "mixed", "tiny")), ("openai_agent", ("", "tiny")),
    ("reasoning_gym", ("chain_sum", "chain_sum,gcd:tiny")), ("humaneval", ("", "tiny")),
    ("skyrl_gym", ("gsm8k", "gsm8k_multi_turn:tiny"))])
def test_every_variant_of_every_built_in_config_builds(name, variants):
  assert {"arith", "math_answer", "tool_agent", "openai_agent", "smollm2", "math_tpu",
          "reasoning_gym", "humaneval", "skyrl_gym"} == set(
      arl_jax.config_names())
  for variant in variants:
    spec = run_spec.build(arl_jax.load_config(name, variant or None))
    assert spec.run.num_steps > 0, (name, variant)
