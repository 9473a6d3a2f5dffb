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
  (`fleet._parse`, then `group_from_wire` / the JSON codec): tokens per second
  this one thread absorbs, from the first message to the last.
- `orchestrator`: the orchestrator's own cost per group (dispatch, arrival,
  sweep + cut, publish) in steady state with 1k-16k groups in flight
  (`bench_orchestrator`): microseconds per group, flat in the number in
  flight when no step scans everything in the system.
- `lockstep`: N processes (`jax.distributed`, gloo on loopback, one CPU
  device each) share one step's batch as the learner does before every
  update (`lockstep.share`); the bytes each process's TCP sockets receive
  meanwhile (the kernel's count), against issue 23's target of at most 1.2x
  the batch / N.
- `assemble`: process 0 building the global `TrainBatch` (packed rows) from
  finished groups, as it does before every step today: seconds, bytes per
  token of the batch every process then receives (`lockstep.share`).

  python benchmarks/data_plane.py --out=/tmp/data_plane.jsonl   # ~1 min
  python benchmarks/data_plane.py --quick                      # seconds
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from arl_jax import packing as packing_lib
from arl_jax import rollout as rollout_lib
from arl_jax import train_batch as train_batch_lib
from arl_jax.distributed import fleet as fleet_lib
from arl_jax.distributed import wire
from arl_jax.envs import env_api
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import orchestrator as orchestrator_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import json_wire  # noqa: E402  (the JSON codec the wire format replaced)
import report  # noqa: E402  (benchmarks/report.py, run as a script)


CODECS = {
    "json": (lambda g: [json.dumps({"type": "group", "group": json_wire.group_to_json(g)},
                                   separators=(",", ":")).encode()],
             lambda frames: json_wire.group_from_json(json.loads(frames[0])["group"])),
    "binary": (lambda g: wire.encode({"type": "group", "group": wire.group_to_wire(g)}),
               # The fleet's own parser (`_parse`: decode + the message's keys).
               lambda frames: wire.group_from_wire(
                   fleet_lib._parse(frames)["group"])),  # noqa: SLF001
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
  for name, (encode, decode) in CODECS.items():
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
    tokens += sum(len(r.prompt_ids) + len(r.completion_ids) for r in group.rollouts)
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
                       steps: int, regime: str = "learner-bound") -> dict:
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
  orch = orchestrator_lib.Orchestrator(
      dispatch_cfg=dispatcher_lib.DispatchConfig(
          group_size=1, groups_per_batch=groups_per_batch, max_async_level=level,
          max_off_policy_steps=k, staleness_reference=reference),
      buffer_cfg=buffer_lib.BufferConfig(
          max_off_policy_steps=k, staleness_reference=reference, assembly=assembly,
          window_groups=max(1, groups_per_batch // 4)),
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
          rollout_lib.Rollout(group_id=r.group_id, sample_index=0,
                              prompt_ids=np.asarray(r.prompt_ids, np.int32),
                              completion_ids=np.ones(1, np.int32),
                              loss_mask=np.ones(1, np.float32),
                              behaviour_logprobs=np.zeros(1, np.float32),
                              token_versions=np.full(1, version, np.int32),
                              dispatch_version=r.dispatch_version, finish_reason="stop",
                              reward=1.0, env_name="x")])
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
    gc.collect()  # (between steps, untimed: a collection inside one call is noise)
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


def bench_assemble(num_groups: int, shape: tuple, pack_len: int, repeats: int) -> dict:
  """Process 0 building one global `TrainBatch` from finished groups (what
  it does before every step today): packed rows of `pack_len`."""
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


def _tcp_bytes_received() -> int:
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


def lockstep_worker(process_id: int, num_processes: int, port: int, rows: int,
                    columns: int) -> None:
  """One process of `bench_lockstep`: joins the run, then shares a step's
  batch the way the learner does before every update (`lockstep.share`, a
  sum over the learner devices through gloo) and prints what it received."""
  import jax  # noqa: PLC0415
  from arl_jax.distributed import lockstep  # noqa: PLC0415
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes, process_id=process_id)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  step = None
  if process_id == 0:
    rng = np.random.default_rng(0)
    batch = train_batch_lib.TrainBatch(**{
        name: rng.integers(0, 100, (rows, columns)).astype(dtype)
        for name, (dtype, _) in train_batch_lib.FIELDS.items()})
    step = lockstep.Step(kind=lockstep.BATCH, batch=batch)
  lockstep.share(step, mesh)  # compiles the sums
  before, start = _tcp_bytes_received(), time.perf_counter()
  got = lockstep.share(step, mesh)
  seconds, received = time.perf_counter() - start, _tcp_bytes_received() - before
  print(json.dumps({"process": process_id, "received": received, "seconds": seconds,
                    "batch_bytes": sum(getattr(got.batch, name).nbytes
                                       for name in train_batch_lib.FIELDS)}), flush=True)
  jax.distributed.shutdown()


def bench_lockstep(num_processes: int, rows: int, columns: int) -> dict:
  """Bytes each process receives while the step's batch is shared, today's
  way (process 0 holds the whole batch; every process receives it)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  # One CPU device per process (the last device-count flag wins), other flags kept.
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--lockstep_worker",
                             f"{i},{num_processes},{port},{rows},{columns}"], env=env,
                            stdout=subprocess.PIPE, text=True) for i in range(num_processes)]
  results = []
  for p in procs:
    out, _ = p.communicate(timeout=600)
    if p.returncode:
      raise RuntimeError(f"lockstep worker failed ({p.returncode})")
    results.append(json.loads(out.strip().splitlines()[-1]))
  batch = results[0]["batch_bytes"]
  worst = max(r["received"] for r in results)
  return {"benchmark": "data_plane", "part": "lockstep", "processes": num_processes,
          "batch MB": round(batch / 1e6, 1),
          "received MB per process (max)": round(worst / 1e6, 1),
          "received / batch": round(worst / batch, 2),
          "target (1.2 x batch / N)": round(1.2 / num_processes, 2),
          "seconds": round(max(r["seconds"] for r in results), 3)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small groups, few messages")
  parser.add_argument("--parts", default="codec,ingest,orchestrator,assemble,lockstep",
                      help="comma-separated parts to run")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--lockstep_worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.lockstep_worker:
    lockstep_worker(*(int(x) for x in args.lockstep_worker.split(",")))
    return
  parts = set(args.parts.split(","))
  # A group of 16 samples of a 512-token prompt and 8k-token completions.
  shape = (4, 64, 512) if args.quick else (16, 512, 8192)
  if "codec" in parts:
    rows = bench_codec(make_group(*shape), repeats=3 if args.quick else 10)
    report.print_table(rows, title=f"one group ({shape[0]} x ({shape[1]} + {shape[2]}) tokens)")
    report.append_jsonl(rows, args.out)
  if "orchestrator" in parts:
    sizes = (512, 2048) if args.quick else (1024, 4096, 16384)
    cases = [("learner-bound", "fifo", "dispatch"), ("learner-bound", "windowed_fifo", "dispatch"),
             ("learner-bound", "first_done", "oldest_token"),
             ("sampler-bound", "fifo", "dispatch")]
    rows = [bench_orchestrator(n, 256 if args.quick else 1024, assembly, reference,
                               steps=2 if args.quick else 20, regime=regime)
            for regime, assembly, reference in cases for n in sizes]
    report.print_table(rows, title="the orchestrator's own cost per group, by groups in flight")
    report.append_jsonl(rows, args.out)
  if "assemble" in parts:
    rows = [bench_assemble(n, shape, 2 * (shape[1] + shape[2]), repeats=2 if args.quick else 3)
            for n in ((2,) if args.quick else (4, 16))]
    report.print_table(rows, title="process 0 assembling the global batch (packed rows)")
    report.append_jsonl(rows, args.out)
  if "lockstep" in parts:
    batch_shape = (16, 512) if args.quick else (256, 4096)
    rows = [bench_lockstep(n, *batch_shape) for n in ((2,) if args.quick else (1, 2, 4))]
    report.print_table(rows, title="the step's batch shared with every process (lockstep)")
    report.append_jsonl(rows, args.out)
  if "ingest" in parts:
    count = 4 if args.quick else 16
    with tempfile.TemporaryDirectory() as tmp:
      rows = [bench_ingest(codec, senders, shape, count, tmp)
              for senders in ((1,) if args.quick else (1, 4)) for codec in CODECS]
    for binary in (r for r in rows if r["codec"] == "binary"):
      text = next(r for r in rows if r["codec"] == "json" and r["samplers"] == binary["samplers"])
      binary["vs json"] = round(binary["tokens/s"] / text["tokens/s"], 1)
    report.print_table(rows, title="ingest on one thread, samplers over loopback TCP")
    report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
