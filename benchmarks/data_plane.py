r"""What it costs to move finished rollouts from sampler processes to the learner:
the binary wire format (`arl_jax/distributed/wire.py`) against the JSON text
it replaced, kept here as the comparison row (`json_group_to_json`, ...).

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

  python benchmarks/data_plane.py --out=/tmp/data_plane.jsonl   # ~1 min
  python benchmarks/data_plane.py --quick                      # seconds
"""

from __future__ import annotations

import argparse
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

from arl_jax import rollout as rollout_lib
from arl_jax.distributed import fleet as fleet_lib
from arl_jax.distributed import wire

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)


# -- the JSON codec the binary format replaced (arl_jax before issue 23) ------------------

def json_group_to_json(group: rollout_lib.Group) -> dict:
  return {
      "group_id": group.group_id, "prompt_id": group.prompt_id,
      "dispatch_version": group.dispatch_version,
      "rollouts": [{
          "sample_index": r.sample_index, "prompt_ids": r.prompt_ids.tolist(),
          "completion_ids": r.completion_ids.tolist(), "loss_mask": r.loss_mask.tolist(),
          "logprobs": r.behaviour_logprobs.tolist(), "versions": r.token_versions.tolist(),
          "finish_reason": r.finish_reason, "reward": r.reward, "env_name": r.env_name,
          "timings": r.timings} for r in group.rollouts],
  }


def json_group_from_json(record: dict) -> rollout_lib.Group:
  group_id, dispatch_version = int(record["group_id"]), int(record["dispatch_version"])
  rollouts = [rollout_lib.Rollout(
      group_id=group_id, sample_index=int(r["sample_index"]),
      prompt_ids=np.asarray(r["prompt_ids"], np.int32),
      completion_ids=np.asarray(r["completion_ids"], np.int32),
      loss_mask=np.asarray(r["loss_mask"], np.float32),
      behaviour_logprobs=np.asarray(r["logprobs"], np.float32),
      token_versions=np.asarray(r["versions"], np.int32), dispatch_version=dispatch_version,
      finish_reason=r["finish_reason"], reward=r["reward"], env_name=r["env_name"],
      timings={k: float(v) for k, v in r["timings"].items()}) for r in record["rollouts"]]
  return rollout_lib.Group(group_id=group_id, prompt_id=int(record["prompt_id"]),
                           dispatch_version=dispatch_version, rollouts=rollouts)


CODECS = {
    "json": (lambda g: [json.dumps({"type": "group", "group": json_group_to_json(g)},
                                   separators=(",", ":")).encode()],
             lambda frames: json_group_from_json(json.loads(frames[0])["group"])),
    "binary": (lambda g: wire.encode({"type": "group", "group": wire.group_to_wire(g)}),
               lambda frames: wire.group_from_wire(fleet_lib._parse(frames)["group"])),  # noqa: SLF001
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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small groups, few messages")
  parser.add_argument("--parts", default="codec,ingest", help="comma-separated parts to run")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  # A group of 16 samples of a 512-token prompt and 8k-token completions.
  shape = (4, 64, 512) if args.quick else (16, 512, 8192)
  if "codec" in parts:
    rows = bench_codec(make_group(*shape), repeats=3 if args.quick else 10)
    report.print_table(rows, title=f"one group ({shape[0]} x ({shape[1]} + {shape[2]}) tokens)")
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
