"""A run with its sampling in two sampler processes on loopback: versions
advance, rollouts arrive from both, and killing one mid-run loses no prompt;
a restarted sampler joins and works."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from arl_jax.distributed import fleet as fleet_lib
from arl_jax.testing import tiny, xla_env
from arl_jax.training import rollouts, run_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_sampler(address: str, name: str, log_dir) -> subprocess.Popen:
  env = xla_env.subprocess_env(4)
  log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
  # A learner on a loaded machine (this suite, 2 cores) can take longer than
  # the default 30 s to answer a sampler that joins mid-run.
  return subprocess.Popen(
      [sys.executable, "-m", "arl_jax.distributed.sampler_worker", f"--learner={address}",
       f"--name={name}", "--connect_timeout_s=120"], cwd=REPO, env=env, stdout=log,
      stderr=subprocess.STDOUT)


def _sampler_named(fleet, name):
  with fleet._lock:
    return next((s for s in fleet._samplers.values() if s.name == name), None)


def _wait(condition, what, timeout_s=180.0):
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      raise TimeoutError(what)
    time.sleep(0.02)


def _drained(fleet, victim, witness, quiet_s, within_s) -> bool:
  """Whether the fleet handled `quiet_s` of `witness`'s messages after the
  last one from the (frozen) `victim`, waiting at most `within_s`."""
  deadline = time.monotonic() + within_s
  while time.monotonic() < deadline:
    with fleet._lock:
      if witness.last_seen - victim.last_seen >= quiet_s:
        return True
    time.sleep(0.02)
  return False


def test_killing_a_sampler_mid_run_loses_no_prompt(tmp_path, monkeypatch):
  fleets = []

  class RecordedFleet(fleet_lib.SamplerFleet):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      fleets.append(self)

  monkeypatch.setattr(rollouts.fleet_lib, "SamplerFleet", RecordedFleet)
  config = tiny.load_config("arith", "tiny")
  config.fleet = dict(remote=True, heartbeat_s=0.25, timeout_s=5.0)
  # Steps take ~50 ms here: enough of them that the kill comes well before the
  # end (the learner then waits for the lost groups, FIFO, until they are reassigned).
  config.num_steps = 40
  config.eval_every = 0
  config.warmup.steps = 0
  config.mesh.update(placement="disaggregated", learner_devices=4)  # samplers: 4 devices
  workdir = tmp_path / "run"
  workdir.mkdir()
  procs, problems, killed = {}, [], {}

  def drive():
    """Starts two samplers; once both delivered groups and the run is two
    versions in, kills `s0` while it holds groups; then starts a new one."""
    try:
      _wait(lambda: fleets, "the fleet never started")
      fleet = fleets[0]
      for name in ("s0", "s1"):
        procs[name] = _start_sampler(fleet.address, name, tmp_path)
      _wait(lambda: all((s := _sampler_named(fleet, n)) is not None and s.groups_delivered
                        for n in ("s0", "s1")), "both samplers delivering")
      _wait(lambda: fleet._orchestrator.live_version >= 2, "version 2")
      victim, witness = _sampler_named(fleet, "s0"), _sampler_named(fleet, "s1")
      deadline = time.monotonic() + 120
      while not killed:  # freeze s0 while it holds groups; kill it if it still does
        if time.monotonic() > deadline:
          raise AssertionError("s0 never held a group when frozen")
        with fleet._lock:
          holding = bool(victim.owned)
        if not holding:
          time.sleep(0.005)
          continue
        procs["s0"].send_signal(signal.SIGSTOP)
        # What s0 sent before freezing may still wait in the learner's socket
        # (its thread is slow on a loaded machine): groups delivered that way
        # are not lost. The socket serves its peers in turn, so once the fleet
        # has handled a second of s1's messages (heartbeats every 0.25 s) and
        # nothing from s0, nothing from s0 is left to handle.
        if _drained(fleet, victim, witness, quiet_s=1.0, within_s=3.0):
          with fleet._lock:
            held = sorted(victim.owned)
          if held:
            procs["s0"].kill()
            killed.update(held=held, sampler=victim.sampler_id)
            break
        procs["s0"].send_signal(signal.SIGCONT)
      procs["s0-restarted"] = _start_sampler(fleet.address, "s0-restarted", tmp_path)
    except BaseException as e:  # noqa: BLE001 - reported by the test thread
      problems.append(e)

  driver = threading.Thread(target=drive, daemon=True)
  driver.start()
  try:
    result = run_lib.run(config, str(workdir), print_fn=lambda line: None)
  finally:
    driver.join(timeout=5)
    codes = {}
    for name, proc in procs.items():  # the run's end tells samplers to exit
      try:
        codes[name] = proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        proc.kill()
        codes[name] = proc.wait()
  assert not problems, problems
  assert result.final_version == 40
  assert result.groups_trained == 40 * 8  # 32 rollouts per batch, groups of 4
  last = result.history[-1]
  assert last["fleet_samplers_lost"] == 1
  # Every group the killed sampler held started again elsewhere and trained.
  assert last["fleet_groups_reassigned"] >= len(killed["held"]) >= 1
  events = [json.loads(line) for line in open(workdir / "groups.jsonl")]
  trained = {e["group_id"] for e in events if e["event"] == "trained"}
  assert set(killed["held"]) <= trained
  assert not [e for e in events if e["event"].startswith("dropped")]
  assert last["dropped_stale"] == last["dropped_cancelled"] == 0
  # Groups came from both samplers and from the restarted one (which joined
  # as sampler 2, so it pulled weights first).
  by_sampler = last["fleet_groups_by_sampler"]
  assert sorted(by_sampler) == ["0", "1", "2"] and min(by_sampler.values()) > 0, by_sampler
  fleet_events = [json.loads(line) for line in open(workdir / "metrics.jsonl")
                  if '"phase": "fleet"' in line]
  lost = [e for e in fleet_events if e["event"] == "sampler_lost"]
  assert len(lost) == 1 and lost[0]["sampler"] == killed["sampler"]
  assert set(killed["held"]) <= set(lost[0]["reassigned"])
  # The surviving and restarted samplers were told the run ended, and exited cleanly.
  for name in ("s1", "s0-restarted"):
    assert codes[name] == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
