"""Scoring a program by unit tests in a sandbox: how many of its tests pass.

A test file in HumanEval's form defines `check(candidate)`, whose body is a
run of statements, the asserting ones each a test (an `assert`, or a loop
of them). `instrument` rewrites that body (the test file is the task's,
trusted; the model's program is never parsed here) so each asserting
statement records whether it passed, and a statement that fails does not
stop the rest. The sandbox then runs a fixed harness (`HARNESS`): it reads
its settings from stdin, loads the model's program (`candidate.py`) and the
tests (`tests.py`) into one namespace (tests may call the program's helper
functions), runs `check`, and writes one result line.

The result line starts with a random nonce the harness reads from stdin
before the program is loaded and that no file holds, so a program that
prints a pass line of its own, or exits early with status 0, passes nothing.
(A program that searched the interpreter's frames for the nonce could still
forge one: the harness and the program share a process. So could one that
returns objects equal to everything: tests compare with `==`. Neither is
hidden from a reader of the rollouts, which keep the program.)
"""

from __future__ import annotations

import ast
import dataclasses
import json
import secrets
import threading

from arl_jax.sandbox import api

# Runs in the sandbox as main.py. Everything it keeps is local to `_main`.
HARNESS = '''\
import json, os, sys


def _main():
  settings = json.loads(sys.stdin.readline())
  sys.stdin.close()
  nonce, total, write = settings["nonce"], settings["total"], os.write

  def report(passed, loaded):
    write(1, ("\\n%s %d %d %d\\n" % (nonce, passed, total, loaded)).encode())

  namespace = {"__name__": "__candidate__"}
  try:
    with open("candidate.py", encoding="utf-8") as f:
      exec(compile(f.read(), "candidate.py", "exec"), namespace)
    candidate = namespace[settings["entry_point"]]
  except BaseException as e:
    write(2, ("the program did not load: %r\\n" % (e,)).encode("utf-8", "replace"))
    report(0, 0)
    return
  results = []
  try:
    with open("tests.py", encoding="utf-8") as f:
      exec(compile(f.read(), "tests.py", "exec"), namespace)
    namespace["check"](candidate, results)
  except BaseException as e:
    write(2, ("the tests stopped: %r\\n" % (e,)).encode("utf-8", "replace"))
  report(sum(1 for r in results if r is True), 1)


_main()
'''

_RESULTS = "__arl_results__"

# CPython 3.11's `ast.parse` is not thread-safe: the converter of a parse
# tree to Python objects counts its recursion depth in interpreter-wide
# state, so two threads converting at once can fail with "SystemError: AST
# constructor recursion depth mismatch" (python/cpython#106905; seen here
# scoring HumanEval's 164 test files from 8 threads, as a run's reward
# workers do). Every parse in arl_jax's environments takes this lock.
_PARSE_LOCK = threading.Lock()


def parse_python(source: str) -> ast.Module:
  """`ast.parse(source)`, one thread at a time (`_PARSE_LOCK`)."""
  with _PARSE_LOCK:
    return ast.parse(source)


class TestFileError(ValueError):
  """A test file this module cannot instrument (no `check`, no assert)."""


def instrument(test_source: str) -> tuple[str, int]:
  """`test_source` with `check(candidate)` rewritten to
  `check(candidate, __arl_results__)`, each asserting top-level statement of
  its body appending True when it completes and False when it raises; and
  the number of such statements (the tests)."""
  module = parse_python(test_source)
  check = next((node for node in module.body
                if isinstance(node, ast.FunctionDef) and node.name == "check"), None)
  if check is None:
    raise TestFileError("the test file defines no check(candidate) function")
  body, total = [], 0
  for statement in check.body:
    if not any(isinstance(node, ast.Assert) for node in ast.walk(statement)):
      body.append(statement)
      continue
    total += 1
    body.append(ast.Try(
        body=[statement],
        handlers=[ast.ExceptHandler(type=ast.Name("BaseException", ast.Load()), name=None,
                                    body=[_append(False)])],
        orelse=[_append(True)], finalbody=[]))
  if not total:
    raise TestFileError("check(candidate) asserts nothing")
  check.body = body
  check.args.args.append(ast.arg(_RESULTS))
  return ast.unparse(ast.fix_missing_locations(module)), total


def _append(value: bool) -> ast.stmt:
  return ast.Expr(ast.Call(func=ast.Attribute(ast.Name(_RESULTS, ast.Load()), "append",
                                              ast.Load()),
                           args=[ast.Constant(value)], keywords=[]))


@dataclasses.dataclass(frozen=True)
class TestResult:
  """How a program did on its tests.

  Attributes:
    passed: tests that passed.
    total: tests there are.
    outcome: `passed` (all of them), `failed_tests`, `did_not_load` (the
      program raised, or lacks the function), `no_result` (it ended without
      the harness's line: it exited early), or the execution's status
      (`timeout`, `cpu_limit`, `memory_limit`, `output_limit`).
    execution: what the sandbox said.
  """

  passed: int
  total: int
  outcome: str
  execution: api.Execution

  @property
  def fraction(self) -> float:
    return self.passed / self.total


def run_tests(sandbox: api.Sandbox, program: str, tests: tuple[str, int], entry_point: str,
              limits: api.Limits) -> TestResult:
  """Runs `program`'s function `entry_point` against `tests` (an `instrument`
  result) in `sandbox`. Raises `SandboxError` only when the sandbox fails."""
  source, total = tests
  nonce = secrets.token_hex(16)
  settings = json.dumps({"nonce": nonce, "total": total, "entry_point": entry_point})
  execution = sandbox.run(HARNESS, limits=limits, stdin=settings + "\n",
                          files={"candidate.py": program, "tests.py": source})
  passed, loaded = 0, None
  for line in reversed(execution.stdout.splitlines()):
    fields = line.split()
    if len(fields) == 4 and fields[0] == nonce and fields[2] == str(total):
      passed, loaded = int(fields[1]), fields[3] == "1"
      break
  if execution.status not in (api.OK, api.FAILED):
    outcome, passed = execution.status, 0  # (a program stopped by a limit passes nothing)
  elif loaded is None:
    outcome = "no_result"
  elif not loaded:
    outcome = "did_not_load"
  else:
    outcome = "passed" if passed == total else "failed_tests"
  return TestResult(passed=min(max(passed, 0), total), total=total, outcome=outcome,
                    execution=execution)
