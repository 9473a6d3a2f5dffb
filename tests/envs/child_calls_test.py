"""A function on hostile input in a child process: a result, an exception,
a call that never ends (killed at its timeout), one over the memory cap, a
child that exits: each an `Outcome` with its reason, the caller unharmed,
the next call served by a fresh child."""

import threading
import time

import pytest

from arl_jax.envs import child_calls


def test_results_exceptions_timeouts_memory_and_deaths_are_outcomes():
  pool = child_calls.ChildPool("math:factorial", workers=1, timeout_s=1.0,
                               memory_bytes=1 << 30)
  try:
    assert pool.call(10) == child_calls.Outcome(True, 3628800)
    bad = pool.call(-1)
    assert not bad.ok and bad.reason.startswith("exception: ValueError")
    start = time.monotonic()
    slow = pool.call(10 ** 9)  # (computes for minutes)
    assert slow.reason == "timeout after 1.0 s" and time.monotonic() - start < 5
    assert pool.call(5).value == 120  # (a new child)
    assert pool.counts == {"calls": 4, "timeouts": 1, "deaths": 0, "exceptions": 1}
  finally:
    pool.close()
  hog = child_calls.ChildPool("operator:mul", workers=1, timeout_s=10.0,
                              memory_bytes=512 << 20)
  try:
    assert "MemoryError" in hog.call("x", 2 << 30).reason  # (over the cap, refused in the child)
    assert hog.call("x", 3).value == "xxx"
    huge = hog.call("x", 4 << 20)  # (a 4 MiB reply: the parent reads 1 MiB at most)
    assert huge.reason == "child died: killed, reply over 1048576 bytes"
    assert hog.call("x", 2).value == "xx"
  finally:
    hog.close()
  dies = child_calls.ChildPool("os:_exit", workers=1, timeout_s=10.0)
  try:
    assert dies.call(3).reason.startswith("child died")
    assert dies.counts["deaths"] == 1
  finally:
    dies.close()


def test_threads_share_the_pool_up_to_its_children():
  pool = child_calls.ChildPool("math:gcd", workers=2, timeout_s=5.0)
  results = []
  try:
    threads = [threading.Thread(target=lambda i=i: results.append(pool.call(12 * i, 18).value))
               for i in range(1, 9)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert sorted(results) == sorted(__import__("math").gcd(12 * i, 18) for i in range(1, 9))
    assert len(pool._children) <= 2
  finally:
    pool.close()


def test_a_function_that_cannot_be_imported_fails_to_start():
  with pytest.raises(RuntimeError, match="did not start"):
    child_calls.ChildPool("no_such_module_here:f", workers=1, start_timeout_s=20).call(1)
