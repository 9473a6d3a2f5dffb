"""One process of a multi-process lockstep step on CPU (gloo): tests and the
data-plane benchmark run N of these on loopback.

Every process makes the same synthetic batch (`synthetic_groups`) and holds
the groups `placement` gives it. Then one step's batch reaches the learner
devices, twice (the first compiles), the second measured:

- `mode=plan` (today): process 0 plans from metadata (`shard_plan.make`),
  shares the plan (`lockstep.share`), each process builds its block
  (`shard_batch.local_batch`); the block is checked against the whole batch
  assembled in one place with the same layout;
- `mode=broadcast` (before issue 23): process 0 assembles the whole batch
  and every process receives all of it (`lockstep.broadcast`, a sum).

With `--lose=GROUP`, that group's holder acts as if it had lost it: every
process must raise (`shard_batch._fetch`) rather than wait in a collective.
With `--collect`, process 0 then collects the completions of the groups
held elsewhere as a checkpoint does (`shard_batch.collect_held`) and checks
them. Prints one JSON line: the bytes this process's TCP sockets received
during the measured step (gloo's included), the token bytes `local_batch`
says crossed into it, the batch's bytes, seconds, and the checks.

  python -m arl_jax.testing.lockstep_worker --process_id=0 --num_processes=2 --port=PORT
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np

PLACEMENTS = ("local", "spread", "process0")


def synthetic_groups(num_groups: int, group_size: int, num_processes: int, placement: str,
                     prompt_len: int, completion_len: int, seed: int = 0) -> tuple[list, list]:
  """`(groups, holders)`: full groups of random tokens and lengths, and the
  process holding each. `local`: group i on process i % N, the processes'
  length mixes alike (lengths follow i // N), so each block's groups are its
  own share and nothing needs to move; `spread`: the same processes, random
  lengths (balance may move a few); `process0`: all on process 0."""
  from arl_jax.core import rollout as rollout_lib  # noqa: PLC0415 - JAX after flags

  groups, holders = [], []
  for i in range(num_groups):
    key = i // num_processes if placement == "local" else i
    lengths = np.random.default_rng([seed, key])
    data = np.random.default_rng([seed, i, 1])
    rollouts = []
    for s in range(group_size):
      p = int(lengths.integers(prompt_len // 2, prompt_len + 1))
      c = int(lengths.integers(completion_len // 4, completion_len + 1))
      rollouts.append(rollout_lib.Rollout(
          group_id=i, sample_index=s, prompt_ids=data.integers(1, 1000, p).astype(np.int32),
          completion_ids=data.integers(1, 1000, c).astype(np.int32),
          loss_mask=np.ones(c, np.float32),
          behaviour_logprobs=-data.random(c).astype(np.float32),
          token_versions=np.full(c, 3, np.int32), dispatch_version=3, finish_reason="stop",
          reward=float(data.random())))
    groups.append(rollout_lib.Group(group_id=i, prompt_id=i, dispatch_version=3,
                                    rollouts=rollouts))
    holders.append(0 if placement == "process0" else i % num_processes)
  return groups, holders


def tcp_bytes_received() -> int:
  """Bytes received so far on this process's open TCP sockets (gloo's
  included): the kernel's `tcpi_bytes_received` of each (Linux `tcp_info`,
  offset 128)."""
  total = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
        continue
      sock = socket.socket(fileno=os.dup(int(fd)))
    except OSError:
      continue
    with sock:
      if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        total += struct.unpack_from("<Q", info, 128)[0]
  return total


def run(num_processes: int, timeout_s: float = 600, **flags) -> list[dict]:
  """Runs `num_processes` workers (one CPU device each) with `flags`
  (`--name=value`; True: `--name`) and returns their reports, by process."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # One CPU device per process (the last device-count flag wins), other flags kept.
  xla = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
  env = dict(os.environ, XLA_FLAGS=xla.strip(), JAX_PLATFORMS="cpu")
  argv = [f"--{k}" if v is True else f"--{k}={v}" for k, v in flags.items()]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "arl_jax.testing.lockstep_worker", f"--process_id={i}",
       f"--num_processes={num_processes}", f"--port={port}", *argv], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(num_processes)]
  reports = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout_s)
      if p.returncode:
        raise RuntimeError(f"lockstep worker failed ({p.returncode}): {err[-3000:]}")
      reports.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      p.kill()
  return reports


def _collect(groups, holders, here, mesh) -> bool:
  """Collects the groups held outside process 0 as a checkpoint does
  (`shard_batch.collect_held`); process 0 returns whether every completion
  arrived bit for bit."""
  import jax  # noqa: PLC0415

  from arl_jax.distributed import shard_batch  # noqa: PLC0415
  from arl_jax.orchestrator import work_record  # noqa: PLC0415

  elsewhere = [g for g in groups if holders[g.group_id] != 0]
  work = work_record.WorkRecord(
      prompts_drawn=0, stream_state=None, requeued=(), next_group_id=0,
      counters=work_record.WorkCounters(started=0, cancelled=0, requeued=0),
      groups=tuple(work_record.GroupRecord(
          group_id=g.group_id, prompt=None, prompt_ids=(), attempt=0, dispatch_version=0,
          arrival_version=None, episodes=tuple(work_record.EpisodeRecord(
              stage="done", held_by=holders[g.group_id], completion_length=r.completion_length,
              reward=r.reward, finish_reason=r.finish_reason, env_name=r.env_name)
              for r in g.rollouts)) for g in elsewhere))
  record = {"work": work}
  leader = jax.process_index() == 0
  shard_batch.collect_held(record if leader else None, here, mesh)
  return leader and all(
      list(e.completion_ids) == r.completion_ids.tolist()
      and list(e.logprobs) == r.behaviour_logprobs.tolist()
      and list(e.versions) == r.token_versions.tolist() and e.held_by is None
      for g, saved in zip(elsewhere, record["work"].groups)
      for r, e in zip(g.rollouts, saved.episodes))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--mode", choices=("plan", "broadcast"), default="plan")
  parser.add_argument("--placement", choices=PLACEMENTS, default="local")
  parser.add_argument("--groups", type=int, default=16)
  parser.add_argument("--group_size", type=int, default=4)
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--completion_len", type=int, default=448)
  parser.add_argument("--pack_len", type=int, default=512)
  parser.add_argument("--collect", action="store_true")
  parser.add_argument("--lose", type=int, default=-1,
                      help="the holder of this group id behaves as if it had lost it")
  args = parser.parse_args()

  import jax  # noqa: PLC0415
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                             num_processes=args.num_processes, process_id=args.process_id)
  from arl_jax.core import packing as packing_lib  # noqa: PLC0415
  from arl_jax.core import rollout as rollout_lib  # noqa: PLC0415
  from arl_jax.core import train_batch as train_batch_lib  # noqa: PLC0415
  from arl_jax.distributed import lockstep, shard_batch, shard_plan  # noqa: PLC0415

  me, leader = jax.process_index(), jax.process_index() == 0
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  groups, holders = synthetic_groups(args.groups, args.group_size, args.num_processes,
                                     args.placement, args.prompt_len, args.completion_len)
  packing = packing_lib.Packing(pack_len=args.pack_len, row_multiple=jax.device_count())
  settings = dict(prompt_len=args.prompt_len, max_new_tokens=args.completion_len,
                  advantage_estimator="grpo")
  by_id = {g.group_id: g for g in groups}

  def here(gid, s):
    if holders[int(gid)] != me or int(gid) == args.lose:
      raise KeyError(f"group {gid} is held by process {holders[int(gid)]}, not {me}")
    return by_id[int(gid)].rollouts[int(s)]

  def step() -> tuple[object, int]:
    if args.mode == "broadcast":
      batch = train_batch_lib.assemble(groups, pad_id=0, packing=packing, **settings)
      arrays = {n: getattr(batch, n).astype(np.uint8) if getattr(batch, n).dtype == bool
                else getattr(batch, n) for n in train_batch_lib.FIELDS}
      if not leader:
        arrays = {n: np.zeros_like(a) for n, a in arrays.items()}
      return lockstep.broadcast(arrays, mesh), 0
    plan = None
    if leader:  # process 0 sees the others' groups as metadata only
      seen = [g if holders[g.group_id] == 0 else rollout_lib.held_group(g, holders[g.group_id])
              for g in groups]
      plan = shard_plan.make(seen, blocks_of_process=shard_plan.row_blocks(mesh),
                             mask_truncated_completions=False, packing=packing, num_slices=1,
                             **settings)
    shared = lockstep.share(None if plan is None else lockstep.Step(lockstep.BATCH, plan=plan),
                            mesh).plan
    batch, moved = shard_batch.local_batch(shared, here, mesh, pad_id=0,
                                           blocks_of_process=shard_plan.row_blocks(mesh))
    jax.block_until_ready(batch)
    return (shared, batch), moved

  if args.lose >= 0:  # every process must fail, together, without hanging
    try:
      step()
    except RuntimeError as e:
      print(json.dumps({"process": me, "error": str(e)}), flush=True)
    jax.distributed.shutdown()
    return
  step()  # compiles
  before, start = tcp_bytes_received(), time.perf_counter()
  result, moved = step()
  seconds, received = time.perf_counter() - start, tcp_bytes_received() - before
  report = {"process": me, "received": received, "token_bytes_moved": moved,
            "seconds": seconds}
  if args.mode == "plan":
    plan, batch = result
    whole = train_batch_lib.empty_rows(plan.rows, plan.width, 0)
    train_batch_lib.fill(whole, plan.batch_plan(), dict(enumerate(
        r for g in groups for r in g.rollouts)))
    rows = slice(plan.rows_per_block * me, plan.rows_per_block * (me + 1))
    report["block_equal"] = all(
        np.array_equal(np.asarray(getattr(batch, n).addressable_data(0)), whole[n][rows])
        for n in train_batch_lib.FIELDS)
    report["batch_bytes"] = sum(a.nbytes for a in whole.values())
    report["moved_rollouts"] = int(plan.moved(shard_plan.row_blocks(mesh)).sum())
  else:
    report["batch_bytes"] = sum(a.nbytes for a in result.values())
  if args.collect:
    collected = _collect(groups, holders, here, mesh)
    if leader:
      report["collect_equal"] = collected
  print(json.dumps(report), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
