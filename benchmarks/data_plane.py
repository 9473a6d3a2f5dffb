r"""What it costs to move finished rollouts from sampler processes to the learner:
the binary wire format (`arl_jax/distributed/wire.py`) against the JSON text
it replaced, kept as the comparison row (`benchmarks/json_wire.py`).

Parts:

- `codec`: one group of G rollouts with P prompt and C completion tokens each
  (the per-token arrays: prompt and completion ids, loss mask, float32
  log-probs, versions), encoded into frames and decoded back into a `Group`;
  median of `repeats`. `MB/s` counts the group's array bytes (what a rollout
  is, whatever the format) over encode + decode time; `wire bytes` is what
  the frames hold.
- `ingest`: M sampler processes (plain Python + ZeroMQ) send pre-encoded
  groups over loopback TCP to one ZeroMQ ROUTER socket in this process, which
  parses each message the way the fleet's server thread does
  (`messages.from_frames`, then `group_from_wire` / the JSON codec): tokens per second
  this one thread absorbs, from the first message to the last; `held`: the
  metadata-only message of a group a multi-controller process keeps
  (tokens/s counts the tokens it stands for).
- `orchestrator`: the orchestrator's own cost per group (dispatch, arrival,
  sweep + cut, publish) in steady state with 1k-16k groups in flight
  (`bench_orchestrator`): microseconds per group, flat in the number in
  flight when no step scans everything in the system.
- `lockstep`: N processes (`jax.distributed`, gloo on loopback, one CPU
  device each) get one step's batch onto the learner devices
  (`arl_jax.testing.lockstep_worker`): today (`plan`) process 0 shares the
  step's plan and each process fills its own rows from the groups it holds
  (`local`: every process holds its share; `spread`: random lengths, so
  balance moves a few rollouts; `process0`: every group on process 0, as
  when sampler processes outside the job make them all); before (`broadcast`, the comparison row)
  process 0 assembled the batch and every process received all of it. The
  bytes each process's TCP sockets receive meanwhile (the kernel's count),
  against issue 23's target of at most 1.2x the batch / N.
- `plan`: process 0 planning a step's batch from metadata
  (`shard_plan.make`: which process trains each rollout, the layout, the
  advantages), 1,024 groups x 16 held by 8 or 64 processes: microseconds
  per rollout, and the plan's bytes (what every process receives).
- `assemble`: building a `TrainBatch` (packed rows) from finished groups in
  one process (process 0's whole batch before issue 23; each process's
  block today): seconds, bytes per token.

  python benchmarks/data_plane.py --out=/tmp/data_plane.jsonl   # ~2 min
  python benchmarks/data_plane.py --quick                      # seconds
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from arl_jax.core import packing as packing_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.distributed import messages, shard_plan, wire
from arl_jax.envs import env_api
from arl_jax.orchestrator import orchestrator as orchestrator_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.testing import lockstep_worker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import json_wire  # noqa: E402  (the JSON codec the wire format replaced)
import report  # noqa: E402  (benchmarks/report.py, run as a script)

CODECS = {
    "json": (lambda g: [json.dumps({"type": "group", "group": json_wire.group_to_json(g)},
                                   separators=(",", ":")).encode()],
             lambda frames: json_wire.group_from_json(json.loads(frames[0])["group"])),
    "binary": (lambda g: wire.encode(messages.to_wire(
                   messages.GroupDone(group=wire.group_to_wire(g)))),
               # The fleet's own parser (decode + the message's fields).
               lambda frames: wire.group_from_wire(
                   messages.from_frames(frames, messages.FROM_SAMPLER).group)),
    # A multi-controller process's finished group: metadata only, the arrays
    # stay with it (`held_groups.py`); what process 0 ingests today.
    "held": (lambda g: wire.encode(messages.to_wire(
                 messages.GroupDone(group=wire.group_to_wire(g, held_by=1)))),
             lambda frames: wire.group_from_wire(
                 messages.from_frames(frames, messages.FROM_SAMPLER).group)),
}


def make_group(group_size: int, prompt_len: int, completion_len: int, seed: int = 0):
  """A group as a sampler finishes it: random tokens, float32 log-probs."""
  rng = np.random.default_rng(seed)
  rollouts = [rollout_lib.Rollout(
      group_id=seed, sample_index=i,
      prompt_ids=rng.integers(0, 151_936, prompt_len).astype(np.int32),
      completion_ids=rng.integers(0, 151_936, completion_len).astype(np.int32),
      loss_mask=np.ones(completion_len, np.float32),
      behaviour_logprobs=-rng.exponential(size=completion_len).astype(np.float32),
      token_versions=np.full(completion_len, 3, np.int32), dispatch_version=3,
      finish_reason="stop", reward=1.0, env_name="math", timings={"sample_s": 1.5})
      for i in range(group_size)]
  return rollout_lib.Group(group_id=seed, prompt_id=seed, dispatch_version=3,
                           rollouts=rollouts)


def array_bytes(group: rollout_lib.Group) -> int:
  return sum(r.prompt_ids.nbytes + r.completion_ids.nbytes + r.loss_mask.nbytes
             + r.behaviour_logprobs.nbytes + r.token_versions.nbytes for r in group.rollouts)


def bench_codec(group, repeats: int) -> list[dict]:
  rows = []
  for name in ("json", "binary"):
    encode, decode = CODECS[name]
    encode_s, decode_s = [], []
    for _ in range(repeats):
      start = time.perf_counter()
      frames = [bytes(f) for f in encode(group)]  # what a socket would hold
      middle = time.perf_counter()
      got = decode(frames)
      encode_s.append(middle - start)
      decode_s.append(time.perf_counter() - middle)
    assert got.rollouts[-1].behaviour_logprobs.tobytes() == (
        group.rollouts[-1].behaviour_logprobs.tobytes())
    enc, dec = statistics.median(encode_s), statistics.median(decode_s)
    rows.append({"benchmark": "data_plane", "part": "codec", "codec": name,
                 "tokens": sum(len(r.prompt_ids) + len(r.completion_ids)
                               for r in group.rollouts),
                 "array MB": round(array_bytes(group) / 1e6, 2),
                 "wire MB": round(sum(len(f) for f in frames) / 1e6, 2),
                 "encode ms": round(enc * 1e3, 2), "decode ms": round(dec * 1e3, 2),
                 "MB/s": round(array_bytes(group) / 1e6 / (enc + dec), 1)})
  text, binary = rows
  binary["vs json"] = round(binary["MB/s"] / text["MB/s"], 1)
  return rows


# A fake sampler process: sends the messages of a file (written by `_write_messages`)
# when told to go. Plain Python and ZeroMQ only, so it starts in a fraction of a second.
_SENDER = """
import struct, sys, zmq
data = open(sys.argv[2], "rb").read()
messages, at = [], 0
while at < len(data):
  (n,) = struct.unpack_from("<I", data, at); at += 4
  frames = []
  for _ in range(n):
    (size,) = struct.unpack_from("<Q", data, at); at += 8
    frames.append(data[at:at + size]); at += size
  messages.append(frames)
socket = zmq.Context.instance().socket(zmq.DEALER)
socket.connect(sys.argv[1])
socket.send_multipart([b"ready"])
socket.recv()
for frames in messages:
  socket.send_multipart(frames)
socket.recv()
socket.close(linger=0)
"""


def _write_messages(path: str, messages: list[list[bytes]]) -> None:
  with open(path, "wb") as f:
    for frames in messages:
      f.write(struct.pack("<I", len(frames)))
      for frame in frames:
        f.write(struct.pack("<Q", len(frame)) + frame)


def bench_ingest(codec: str, senders: int, shape: tuple, count: int, tmp: str) -> dict:
  context = zmq.Context.instance()
  router = context.socket(zmq.ROUTER)
  router.linger = 0
  port = router.bind_to_random_port("tcp://127.0.0.1")
  encode, decode = CODECS[codec]
  procs = []
  for i in range(senders):  # each sender's groups encoded up front (not timed)
    path = os.path.join(tmp, f"{codec}_{i}.bin")
    _write_messages(path, [[bytes(f) for f in encode(make_group(*shape, seed=i * count + j))]
                           for j in range(count)])
    procs.append(subprocess.Popen([sys.executable, "-c", _SENDER, f"tcp://127.0.0.1:{port}",
                                   path]))
  identities = [router.recv_multipart()[0] for _ in procs]
  tokens = received = 0
  start = time.perf_counter()
  for identity in identities:
    router.send_multipart([identity, b"go"])
  while received < senders * count:
    _, *frames = router.recv_multipart()
    group = decode(frames)
    tokens += sum(r.prompt_length + r.completion_length for r in group.rollouts)
    received += 1
  seconds = time.perf_counter() - start
  for identity in identities:
    router.send_multipart([identity, b"done"])
  for p in procs:
    p.wait(timeout=60)
  router.close()
  return {"benchmark": "data_plane", "part": "ingest", "codec": codec, "samplers": senders,
          "groups": received, "tokens": tokens, "seconds": round(seconds, 3),
          "tokens/s": round(tokens / seconds), "groups/s": round(received / seconds, 1)}


def bench_orchestrator(in_flight: int, groups_per_batch: int, assembly: str, reference: str,
                       steps: int, regime: str = "learner-bound", collect: bool = True) -> dict:
  """Microseconds of the orchestrator's own work per group in steady state,
  with `in_flight` groups in the system: `take` (dispatch; under
  `oldest_token` with the sampler's first `note_sampling`), `group_finished`
  (into the buffer), `try_cut` (sweep + assembly) and `publish` (the
  cancellation scan + retirement). `regime`: learner-bound, the buffer holds
  all but one batch of them, finished; sampler-bound, all but one batch are
  generating. Each step one batch finishes (in a shuffled order); K is the
  async level + 2, so nothing is dropped."""
  level = in_flight // groups_per_batch - 1
  k = level + 2
  # (groups of 2, the smallest a config allows: 1 before issue 53)
  orch = orchestrator_lib.Orchestrator(
      orchestrator_config.OrchestratorConfig(
          group_size=2, batch_size=2 * groups_per_batch, max_async_level=level,
          max_off_policy_steps=k, staleness_reference=reference, assembly=assembly,
          window_fraction=0.25),
      prompts=(env_api.TextPrompt(prompt_id=i, text="", answer="") for i in itertools.count()),
      encode_fn=lambda p: (1, 2), env_name_of=lambda p: "x", max_new_tokens=8)
  rng = np.random.default_rng(0)
  pending = collections.deque()
  seconds = collections.Counter()
  version = 0

  def timed(name, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    seconds[name] += time.perf_counter() - start
    return out

  def dispatch():
    def take():
      requests = orch.dispatcher.take(in_flight, version, 0.0)
      for r in requests:
        orch.dispatcher.note_sampling(r.group_id, version)
      return requests
    pending.extend(timed("take", take))

  def finish(requests):
    for i in rng.permutation(len(requests)):
      r = requests[i]
      group = rollout_lib.Group(group_id=r.group_id, prompt_id=r.prompt.prompt_id,
                                dispatch_version=r.dispatch_version, rollouts=[
          rollout_lib.Rollout(group_id=r.group_id, sample_index=s,
                              prompt_ids=np.asarray(r.prompt_ids, np.int32),
                              completion_ids=np.ones(1, np.int32),
                              loss_mask=np.ones(1, np.float32),
                              behaviour_logprobs=np.zeros(1, np.float32),
                              token_versions=np.full(1, version, np.int32),
                              dispatch_version=r.dispatch_version, finish_reason="stop",
                              reward=float(s), env_name="x") for s in range(2)])
      timed("finish", orch.group_finished, group)

  # The learner-bound steady state: all but one batch of the groups in flight
  # wait finished in the buffer; each step the generating batch finishes, the
  # oldest batch is cut, trained and published, and a new batch starts.
  dispatch()
  if regime == "learner-bound":
    finish([pending.popleft() for _ in range(in_flight - groups_per_batch)])
  for step in range(level + 2 + steps):
    if step == level + 2:
      seconds.clear()
    if collect or step == level + 2:
      # (between steps, untimed: a collection inside one call is noise; without
      # `collect`, once, before the timed steps)
      gc.collect()
    finish([pending.popleft() for _ in range(groups_per_batch)])
    batch = timed("cut", orch.try_cut, version)
    assert batch is not None and len(batch.groups) == groups_per_batch and not batch.stale
    version += 1
    timed("publish", orch.publish, version, batch.groups)
    dispatch()
  us = {name: 1e6 * s / (steps * groups_per_batch) for name, s in seconds.items()}
  return {"benchmark": "data_plane", "part": "orchestrator", "regime": regime,
          "in_flight": in_flight,
          "groups/batch": groups_per_batch, "assembly": assembly, "reference": reference,
          **{f"{name} us": round(us[name], 2) for name in ("take", "finish", "cut", "publish")},
          "us/group": round(sum(us.values()), 2)}


def bench_plan(num_groups: int, group_size: int, processes: int, pack_len: int,
               repeats: int) -> dict:
  """Process 0 planning a batch from metadata (`shard_plan.make`, what it
  does before every step of a multi-controller run): `HeldRollout`s spread
  over `processes` holders, lognormal lengths (median ~1.5k tokens, capped
  at `pack_len`), packed rows; the plan's broadcast bytes."""
  rng = np.random.default_rng(0)
  groups = []
  for i in range(num_groups):
    lengths = np.minimum(rng.lognormal(np.log(1500), 0.8, group_size).astype(int) + 1,
                         pack_len - 512)
    groups.append(rollout_lib.Group(group_id=i, prompt_id=i, dispatch_version=3, rollouts=[
        rollout_lib.HeldRollout(
            group_id=i, sample_index=s, prompt_length=512, completion_length=int(c),
            span=(3, 3), dispatch_version=3, finish_reason="stop", holder=i % processes,
            reward=float(rng.random())) for s, c in enumerate(lengths)]))
  packing = packing_lib.Packing(pack_len=pack_len, row_multiple=processes)
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    plan = shard_plan.make(groups, blocks_of_process=list(range(processes)), prompt_len=512,
                           max_new_tokens=pack_len - 512, advantage_estimator="grpo",
                           mask_truncated_completions=False, packing=packing, num_slices=1)
    seconds.append(time.perf_counter() - start)
  rollouts = num_groups * group_size
  median = statistics.median(seconds)
  tokens = int(np.sum(plan.prompt_length + plan.completion_length))
  # What `shard_batch.local_batch`'s all-gather then delivers to each
  # process: every other process's outgoing bytes, padded to the largest.
  moved = plan.moved(list(range(processes)))
  outgoing = np.bincount(plan.holder, weights=moved * (4 * plan.prompt_length
                                                      + 16 * plan.completion_length),
                         minlength=processes)
  return {"benchmark": "data_plane", "part": "plan", "groups": num_groups,
          "rollouts": rollouts, "processes": processes, "tokens": tokens,
          "rows x width": f"{plan.rows} x {plan.width}",
          "fill": round(tokens / (plan.rows * plan.width), 3),
          "rollouts moved": int(moved.sum()),
          "plan KB": round(sum(a.nbytes for a in plan.to_arrays().values()) / 1e3, 1),
          "moved MB in per process": round((processes - 1) * outgoing.max() / 1e6, 2),
          "seconds": round(median, 3), "us/rollout": round(1e6 * median / rollouts, 1)}


def bench_assemble(num_groups: int, shape: tuple, pack_len: int, repeats: int) -> dict:
  """Building one `TrainBatch` from finished groups in one process (process
  0's whole batch before issue 23; a process's own block today): packed
  rows of `pack_len`."""
  groups = [make_group(*shape, seed=i) for i in range(num_groups)]
  group_size, prompt_len, completion_len = shape
  packing = packing_lib.Packing(pack_len=pack_len)
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    batch = train_batch_lib.assemble(groups, prompt_len=prompt_len,
                                     max_new_tokens=completion_len, pad_id=0,
                                     advantage_estimator="grpo", packing=packing)
    seconds.append(time.perf_counter() - start)
  nbytes = sum(getattr(batch, name).nbytes for name in train_batch_lib.FIELDS)
  rollouts = num_groups * group_size
  tokens = rollouts * (prompt_len + completion_len)
  median = statistics.median(seconds)
  return {"benchmark": "data_plane", "part": "assemble", "groups": num_groups,
          "rollouts": rollouts, "tokens": tokens, "rows x width": f"{batch.tokens.shape[0]} x "
          f"{batch.tokens.shape[1]}", "batch MB": round(nbytes / 1e6, 1),
          "bytes/token": round(nbytes / tokens, 1), "seconds": round(median, 3),
          "us/rollout": round(1e6 * median / rollouts, 1),
          "tokens/s": round(tokens / median)}


def bench_lockstep(num_processes: int, mode: str, placement: str, **sizes) -> dict:
  """Bytes each process receives while a step's batch reaches the learner
  devices (`arl_jax.testing.lockstep_worker`): `plan` (process-local
  shards: the plan, plus the rollouts balance moves) or `broadcast` (the
  replaced design: process 0 assembles it, every process receives it)."""
  reports = lockstep_worker.run(num_processes, mode=mode, placement=placement, **sizes)
  batch = reports[0]["batch_bytes"]
  worst = max(r["received"] for r in reports)
  if mode == "plan":
    assert all(r["block_equal"] for r in reports), reports
  return {"benchmark": "data_plane", "part": "lockstep", "processes": num_processes,
          "mode": mode, "placement": placement if mode == "plan" else "-",
          "batch MB": round(batch / 1e6, 1),
          "received MB per process (max)": round(worst / 1e6, 3),
          "received / batch": round(worst / batch, 3),
          "target (1.2 x batch / N)": round(1.2 / num_processes, 2),
          "rollouts moved": reports[0].get("moved_rollouts", "-"),
          "token MB moved in (max)": round(max(r["token_bytes_moved"] for r in reports) / 1e6, 3),
          "seconds": round(max(r["seconds"] for r in reports), 3)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small groups, few messages")
  parser.add_argument("--parts", default="codec,ingest,orchestrator,assemble,plan,lockstep",
                      help="comma-separated parts to run")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  # A group of 16 samples of a 512-token prompt and 8k-token completions.
  shape = (4, 64, 512) if args.quick else (16, 512, 8192)
  if "codec" in parts:
    rows = bench_codec(make_group(*shape), repeats=3 if args.quick else 10)
    report.print_table(rows, title=f"one group ({shape[0]} x ({shape[1]} + {shape[2]}) tokens)")
    report.append_jsonl(rows, args.out)
  if "orchestrator" in parts:
    # --quick: batches of 64 groups, at 2 and 8 batches in flight (async levels 1 and 7)
    sizes = (128, 512) if args.quick else (1024, 4096, 16384)
    cases = [("learner-bound", "fifo", "dispatch"), ("learner-bound", "windowed_fifo", "dispatch"),
             ("learner-bound", "first_done", "oldest_token"),
             ("sampler-bound", "fifo", "dispatch")]
    rows = [bench_orchestrator(n, 64 if args.quick else 1024, assembly, reference,
                               steps=2 if args.quick else 20, regime=regime,
                               # (--quick: ~0.1 s a collection with JAX loaded: once a case)
                               collect=not args.quick)
            for regime, assembly, reference in cases for n in sizes]
    report.print_table(rows, title="the orchestrator's own cost per group, by groups in flight")
    report.append_jsonl(rows, args.out)
  if "assemble" in parts:
    rows = [bench_assemble(n, shape, 2 * (shape[1] + shape[2]), repeats=2 if args.quick else 3)
            for n in ((2,) if args.quick else (4, 16))]
    report.print_table(rows, title="assembling a batch in one process (packed rows)")
    report.append_jsonl(rows, args.out)
  if "plan" in parts:
    rows = [bench_plan(*((64, 4, 4) if args.quick else (1024, 16, processes)), pack_len=8192,
                       repeats=1 if args.quick else 3)
            for processes in ((4,) if args.quick else (8, 64))]
    report.print_table(rows, title="process 0 planning a batch from metadata (packed rows)")
    report.append_jsonl(rows, args.out)
  if "lockstep" in parts:
    sizes = ({} if args.quick else
             dict(groups=64, group_size=8, prompt_len=256, completion_len=4096, pack_len=4096))
    cases = ([("broadcast", "local"), ("plan", "local")] if args.quick else
             [("broadcast", "local"), ("plan", "local"), ("plan", "spread"),
              ("plan", "process0")])
    rows = [bench_lockstep(n, mode, placement, **sizes)
            for n in ((2,) if args.quick else (1, 2, 4)) for mode, placement in cases]
    report.print_table(rows, title="a step's batch reaching the learner devices of N processes")
    report.append_jsonl(rows, args.out)
  if "ingest" in parts:
    count = 4 if args.quick else 16
    with tempfile.TemporaryDirectory() as tmp:
      # (Metadata messages are small: more of them, to time.)
      rows = [bench_ingest(codec, senders, shape, count * (16 if codec == "held" else 1), tmp)
              for senders in ((1,) if args.quick else (1, 4)) for codec in CODECS]
    for binary in (r for r in rows if r["codec"] != "json"):
      text = next(r for r in rows if r["codec"] == "json" and r["samplers"] == binary["samplers"])
      binary["vs json"] = round(binary["tokens/s"] / text["tokens/s"], 1)
    report.print_table(rows, title="ingest on one thread, samplers over loopback TCP")
    report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
