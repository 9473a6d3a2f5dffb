"""What running a program in the sandbox costs: executions per second of a
trivial program through a bare subprocess (the floor: one interpreter
start), the local sandbox without isolation (the jail process and limits)
and with it (namespaces, mounts, a second fork), one at a time and four at
once, side by side in interleaved rounds; then HumanEval's 164 canonical
solutions scored by their tests (`envs/humaneval_env.py`), eight at once.

  python benchmarks/sandbox.py [--quick] [--out=rows.jsonl]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl_jax.sandbox import api, local  # noqa: E402
from benchmarks import report  # noqa: E402

PROGRAM = "print(sum(range(1000)))"
LIMITS = api.Limits(wall_s=30.0)


def _bare(code: str) -> None:
  proc = subprocess.run([sys.executable, "-E", "-s", "-c", code], capture_output=True,
                        timeout=30)
  assert proc.returncode == 0 and proc.stdout == b"499500\n", proc


def _in(sandbox):
  def run(code: str) -> None:
    execution = sandbox.run(code, limits=LIMITS)
    assert execution.ok and execution.stdout == "499500\n", execution
  return run


def _rate(run_fn, count: int, concurrency: int) -> tuple[float, float]:
  """Executions per second and median seconds per execution."""
  latencies = []

  def timed(_):
    start = time.perf_counter()
    run_fn(PROGRAM)
    latencies.append(time.perf_counter() - start)

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    list(pool.map(timed, range(count)))
  return count / (time.perf_counter() - start), statistics.median(latencies)


def _execution_rows(rounds: int, count: int) -> list[dict]:
  backends = {"bare subprocess": _bare,
              "local, no isolation": _in(local.LocalSandbox(require_isolation=False, uid=None))}
  try:
    backends["local, isolated"] = _in(local.LocalSandbox(max_concurrent=8))
  except api.SandboxError as e:  # (a machine without namespaces: that row is left out)
    print(f"no isolated row: {e}")
  rates = {(name, c): [] for name in backends for c in (1, 4)}
  medians = {key: [] for key in rates}
  for _ in range(rounds):  # (interleaved: the machine's drift hits every row alike)
    for concurrency in (1, 4):
      for name, run_fn in backends.items():
        rate, median = _rate(run_fn, count, concurrency)
        rates[(name, concurrency)].append(rate)
        medians[(name, concurrency)].append(median)
  rows = []
  for (name, concurrency), values in rates.items():
    rate = statistics.median(values)
    bare = statistics.median(rates[("bare subprocess", concurrency)])
    median_ms = 1000 * statistics.median(medians[(name, concurrency)])
    bare_ms = 1000 * statistics.median(medians[("bare subprocess", concurrency)])
    rows.append({"benchmark": "sandbox", "part": "execution", "backend": name,
                 "concurrent": concurrency, "runs": rounds * count,
                 "executions_per_s": round(rate, 1), "median_ms": round(median_ms, 1),
                 "overhead_ms": round(median_ms - bare_ms, 1),
                 "rate_vs_bare": round(rate / bare, 2)})
  return rows


def _humaneval_rows(quick: bool) -> list[dict]:
  from arl_jax.envs import env_api  # noqa: PLC0415
  from arl_jax.envs import humaneval_env as he  # noqa: PLC0415
  from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: PLC0415

  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  env = he.HumanEvalEnv(he.HumanEvalConfig(prompt_format="completion"), tokenizer)
  problems = he.load_problems()[:16 if quick else None]
  prompts = [env_api.TextPrompt(prompt_id=i, text=p.prompt, answer=p.task_id)
             for i, p in enumerate(problems)]
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    scores = list(pool.map(lambda p: env.score(p, list(env.demonstration(p).completion_ids)),
                           prompts))
  seconds = time.perf_counter() - start
  return [{"benchmark": "sandbox", "part": "humaneval", "problems": len(problems),
           "concurrent": 8, "all_passed": sum(s.reward == 1.0 for s in scores),
           "seconds": round(seconds, 2), "scored_per_s": round(len(problems) / seconds, 1)}]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a few runs of each (the suite's)")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  quick = args.quick
  rows = _execution_rows(rounds=1 if quick else 3, count=4 if quick else 40)
  report.print_table(rows, "one trivial program a run")
  humaneval = _humaneval_rows(quick)
  report.print_table(humaneval, "HumanEval's canonical solutions scored by their tests")
  report.append_jsonl(rows + humaneval, args.out)


if __name__ == "__main__":
  main()
