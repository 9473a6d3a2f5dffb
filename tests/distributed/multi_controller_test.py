"""Multi-controller mode: the tiny config as 2 processes x 4 CPU devices (gloo
collectives, `python -m arl_jax.launch --coordinator_address=...`), stopped
after 2 updates and resumed from its checkpoint for 2 more, trains on the same
rollouts and ends with the same parameters as one process with 8 devices."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np

from arl_jax.config import run_spec
from arl_jax.learner import checkpointing
from arl_jax.models import init_lib
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import tiny, xla_env
from arl_jax.training import run_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Synchronous (on-policy, one batch in flight); a warm-up long enough that
# some answers are right, so the RL updates have a reward signal to follow.
_OVERRIDES = {"orchestrator.max_async_level": 0, "orchestrator.max_off_policy_steps": 0,
              "sampler.weight_update": "drain", "eval_every": 2, "eval_size": 8,
              "checkpoint.save_final": True,
              "warmup.steps": 20, "warmup.lr": 0.01,
              # Few slots: process 1 samples groups too (held there, `held_groups.py`).
              "sampler.num_slots": 8}


def _config():
  config = tiny.load_config("arith", "tiny")
  for key, value in _OVERRIDES.items():
    node = config
    *path, last = key.split(".")
    for name in path:
      node = node[name]
    node[last] = value
  return config


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two_processes(workdir, num_steps: int, cache: str | None = None) -> list[str]:
  port = _free_port()
  # (The resumed run compiles what the first one did: the cache keeps it.)
  env = xla_env.subprocess_env(4, compilation_cache=cache)
  flags = [f"--config.{k}={v}" for k, v in _OVERRIDES.items()]
  flags.append(f"--config.num_steps={num_steps}")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:tiny",
       f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
       f"--process_id={i}", *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for proc in procs:
    try:
      out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
    logs.append(out)
    assert proc.returncode == 0, out[-4000:]
  return logs


def _final_params(workdir, spec, meshes) -> dict:
  _, abstract = init_lib.abstract_model(spec.model)
  shardings = rules_lib.state_shardings(abstract, meshes.learner, rules_lib.LEARNER_RULES)
  reader = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"), spec.checkpoint)
  params = reader.restore_params(checkpointing.abstract_like(abstract, shardings))
  record = reader._check_format(reader.latest_step())  # noqa: SLF001 - the run record
  reader.close()
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  return flat, record


def _rl_records(workdir) -> list[dict]:
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in records if r.get("phase") == "rl" and "reward_mean" in r]


def test_two_processes_train_like_one(tmp_path):
  single, multi = tmp_path / "single", tmp_path / "multi"
  config = _config()
  result = run_lib.run(config, str(single), print_fn=lambda line: None)
  cache = str(tmp_path / "compilation_cache")
  logs = _run_two_processes(multi, num_steps=2, cache=cache)
  assert "[process 1] done: 2 updates (following process 0)" in logs[1], logs[1][-3000:]
  assert "fleet: sampler 0 joined (process 1)" in logs[0], logs[0][-3000:]
  logs = _run_two_processes(multi, num_steps=4, cache=cache)  # resumes from the checkpoint at 2
  for log in logs:
    assert "resumed from" in log and "at version 2" in log, log[-3000:]
  assert "[process 1] done: 4 updates (following process 0)" in logs[1], logs[1][-3000:]

  # The same rollouts, batch by batch: identical rewards (so identical
  # tokens); the loss agrees to float rounding.
  one, two = _rl_records(single), _rl_records(multi)
  assert [r["version"] for r in two] == [1, 2, 3, 4] == [r["version"] for r in one]
  assert [r["reward_mean"] for r in two] == [r["reward_mean"] for r in one]
  assert max(r["reward_mean"] for r in one) > 0  # the updates had a signal to follow
  np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], atol=1e-5)
  # Evaluation ran on both processes, in step (greedy: the same answers).
  assert [r["eval_reward"] for r in two if "eval_reward" in r] == [
      r["eval_reward"] for r in one if "eval_reward" in r]
  assert all("[process 1] eval [rl step 4]" in log for log in logs[1:])
  assert result.groups_trained == 32

  # The same parameters, to float rounding (the gradient sums run in another
  # order over gloo), while training moved them by far more. The checkpoint
  # was written by both processes (each its shards); its run record by process 0.
  spec = run_spec.build(config)
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  want, _ = _final_params(single, spec, meshes)
  got, record = _final_params(multi, spec, meshes)
  _, start, _ = init_lib.init_params(spec.model, meshes.learner, rules_lib.LEARNER_RULES,
                                     spec.run.seed)
  start = {jax.tree_util.keystr(k): np.asarray(v)
           for k, v in jax.tree_util.tree_flatten_with_path(start)[0]}
  assert set(got) == set(want) == set(start)
  diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
  moved = max(float(np.max(np.abs(want[k] - start[k]))) for k in want)
  assert diff < 2e-5 and moved > 1000 * diff, (diff, moved)
  assert record["version"] == 4 and "work" in record
