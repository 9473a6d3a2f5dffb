"""`config.compilation_cache`: where JAX's persistent cache goes, and a second
start of the same config reading every program instead of compiling it."""

import os
import re
import subprocess
import sys
import textwrap

from arl_jax.testing import xla_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each case in a fresh process: the cache folder is JAX's process-wide state.
_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp
    from arl_jax.core import compile_cache
    folder = compile_cache.enable(sys.argv[1])
    with compile_cache.ProgramCounter() as programs:
      jax.jit(lambda x: x * 3 + 1)(jnp.arange(4.0)).block_until_ready()
    print(json.dumps({"folder": folder, "programs": programs.programs,
                      "from_cache": programs.from_cache,
                      "described": compile_cache.describe(folder)}))
""")


def _run(setting: str, **env) -> dict:
  environ = {k: v for k, v in os.environ.items()
             if k not in ("JAX_COMPILATION_CACHE_DIR", "ARL_JAX_CACHE_DIR")}
  environ.update(env, XLA_FLAGS=xla_env.xla_flags())
  proc = subprocess.run([sys.executable, "-c", _SCRIPT, setting], cwd=REPO, env=environ,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  import json  # noqa: PLC0415

  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_auto_uses_the_user_cache_folder_and_a_second_process_reads_it(tmp_path):
  first = _run("auto", XDG_CACHE_HOME=str(tmp_path / "xdg"))
  assert first["folder"] == str(tmp_path / "xdg" / "arl_jax" / "jit")
  assert first["programs"] >= 1 and first["from_cache"] == 0
  second = _run("auto", XDG_CACHE_HOME=str(tmp_path / "xdg"))
  assert second["programs"] == second["from_cache"] == first["programs"]
  assert re.search(rf"\({first['programs']} programs, \d+ MB\)", second["described"])
  # ARL_JAX_CACHE_DIR names another folder; JAX's own setting wins over both.
  own = _run("auto", ARL_JAX_CACHE_DIR=str(tmp_path / "own"))
  assert own["folder"] == str(tmp_path / "own") and own["from_cache"] == 0
  jax_set = _run("auto", ARL_JAX_CACHE_DIR=str(tmp_path / "own"),
                 JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xdg" / "arl_jax" / "jit"))
  assert jax_set["folder"] == first["folder"] and jax_set["from_cache"] == first["programs"]


def test_off_writes_nothing_and_says_so(tmp_path):
  (tmp_path / "jax").mkdir()
  off = _run("", XDG_CACHE_HOME=str(tmp_path / "xdg"),
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax"))
  assert off["folder"] is None and off["from_cache"] == 0 and off["programs"] >= 1
  assert off["described"] == "compilation cache: off (config.compilation_cache='')"
  assert not (tmp_path / "xdg").exists() and not os.listdir(tmp_path / "jax")


def test_a_second_start_of_a_run_reads_every_program_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  lines = []
  for attempt in range(2):
    proc = subprocess.run(
        [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
         f"--workdir={tmp_path / f'run{attempt}'}", "--config.num_steps=1",
         "--config.eval_every=0", "--config.warmup.steps=0",
         f"--config.compilation_cache={cache}"],
        cwd=REPO, env=xla_env.subprocess_env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"compilation cache: {cache} (" in proc.stdout
    lines.append(next(line for line in proc.stdout.splitlines() if "startup" in line))
  counts = [tuple(map(int, re.search(r"; (\d+) programs \((\d+) from the cache\)", line).groups()))
            for line in lines]
  (first, first_hits), (second, second_hits) = counts
  assert first > 10 and first_hits < first, lines
  assert second == second_hits == first, lines
