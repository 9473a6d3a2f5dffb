"""Tokens/s through the OpenAI-compatible gateway against the same engine
driven in-process, at several numbers of concurrent clients.

Both sides drive one started `GatewayServer` (a tiny random decoder, one CPU
device, 32 slots): `gateway` rows are `/v1/completions` requests over HTTP
from C concurrent `aiohttp` clients in another process, as a served model's
clients are (`gateway_httpx_same_process` rows: `httpx` clients in the
server's own process, as the first version of this benchmark measured; at
128 connections `httpx` takes a core to send 49 requests/s and was what
that row measured); `in_process` rows hand the
same segments to the engine's port directly (`EnginePort.new_episode` +
`submit`), with no HTTP, no JSON and no request checks. Every request asks for `--tokens`
tokens after the same 16-token prompt; a sampled EOS ends one early, so
tokens/s counts the tokens actually sampled. The engine compiles every
shape it can use before the first round (`precompile`), and a warm-up round
of each side runs first. Latency is per request (time to the whole answer:
the gateway answers when the segment ends, so it is also the time to first
token of a stream); p50/p99 over the requests of a row. `sessions` rows:
short multi-turn chat episodes (3 turns of at most 8 tokens, each turn the
conversation so far plus one user message, in a session) from C concurrent
clients: sessions/s, per-turn latency, and the session breaks (0: every turn
extended the last one's exact tokens). `stream` rows: streamed chat
completions from C clients: time to the first content delta (TTFT) and the
gaps between deltas (per-token latency: a delta per engine iteration, one
token each at decode_burst 1), p50/p99, and the whole answer's p50. The
`stream` and `sessions` rows are each a second round (the first compiles
the engine's new shapes: the tiny server compiles on first use).

  python benchmarks/gateway.py [--quick] [--out=rows.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report  # noqa: E402


async def _run_clients(http, post, clients, requests):
  """`requests` requests from `clients` concurrent clients sharing `http`;
  `post(http)` sends one and returns its completion tokens."""
  latencies, sampled = [], 0
  queue = list(range(requests))

  async def client():
    nonlocal sampled
    while queue:
      queue.pop()
      start = time.perf_counter()
      tokens = await post(http)  # (not `sampled += await ...`: that reads `sampled` first)
      sampled += tokens
      latencies.append(time.perf_counter() - start)

  start = time.perf_counter()
  await asyncio.gather(*(client() for _ in range(clients)))
  return time.perf_counter() - start, sampled, latencies


async def _aiohttp_clients(base_url, prompt, tokens, clients, requests):
  import aiohttp  # noqa: PLC0415

  async def post(http):
    async with http.post(base_url + "/completions", json={
        "model": "arl_jax", "prompt": prompt, "max_tokens": tokens}) as r:
      r.raise_for_status()
      return (await r.json())["usage"]["completion_tokens"]

  async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as http:
    return await _run_clients(http, post, clients, requests)


async def _gateway_clients(base_url, prompt, tokens, clients, requests):
  import httpx  # noqa: PLC0415

  async def post(http):
    r = await http.post(base_url + "/completions", json={
        "model": "arl_jax", "prompt": prompt, "max_tokens": tokens})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]

  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as h:
    return await _run_clients(h, post, clients, requests)


def _gateway_clients_elsewhere(base_url, prompt, tokens, clients, requests):
  """`_aiohttp_clients` run in a new process (spawned: no JAX, no server)."""
  import concurrent.futures  # noqa: PLC0415
  import multiprocessing  # noqa: PLC0415

  with concurrent.futures.ProcessPoolExecutor(
      1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(_run_gateway_clients, base_url, prompt, tokens, clients,
                       requests).result()


def _run_gateway_clients(*args):
  """(wall, tokens, latencies, the client process's CPU seconds)."""
  cpu = time.process_time()
  return (*asyncio.run(_aiohttp_clients(*args)), time.process_time() - cpu)


def _thread_cpu_s(name: str) -> float | None:
  """CPU seconds (user + system) of this process's thread called `name`,
  from /proc (None where there is no /proc)."""
  thread = next((t for t in threading.enumerate() if t.name == name), None)
  try:
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (AttributeError, OSError):
    return None
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _in_process_clients(port, prompt, tokens, clients, requests):
  from arl_jax.gateway import engine_port  # noqa: PLC0415

  latencies, sampled = [], 0
  queue = list(range(requests))

  async def client():
    nonlocal sampled
    while queue:
      queue.pop()
      start = time.perf_counter()
      episode = port.new_episode(prompt, prompt=engine_port.ServedPrompt())
      done = await asyncio.wrap_future(port.submit(episode, max_tokens=tokens))
      latencies.append(time.perf_counter() - start)
      sampled += len(done.completion_ids)

  start = time.perf_counter()
  await asyncio.gather(*(client() for _ in range(clients)))
  return time.perf_counter() - start, sampled, latencies


async def _sessions(base_url, clients, sessions, turns, tokens):
  """`sessions` short multi-turn chat episodes, `clients` at a time: each
  turn sends the conversation so far (the answer and a new user message),
  which the session extends from its last turn's exact tokens."""
  import httpx  # noqa: PLC0415

  queue, latencies, breaks = list(range(sessions)), [], 0

  async def client(http):
    nonlocal breaks
    while queue:
      sid = f"bench-{queue.pop()}-{time.perf_counter_ns()}"
      messages = [{"role": "user", "content": "Hello there"}]
      for turn in range(turns):
        start = time.perf_counter()
        r = await http.post(base_url + "/chat/completions", headers={"X-Session-ID": sid},
                            json={"model": "arl_jax", "messages": messages,
                                  "max_tokens": tokens})
        r.raise_for_status()
        latencies.append(time.perf_counter() - start)
        messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"][
            "content"]}, {"role": "user", "content": f"And turn {turn + 2}?"}]
      session = (await http.get(base_url + f"/sessions/{sid}")).json()
      breaks += session["breaks"]

  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as h:
    start = time.perf_counter()
    await asyncio.gather(*(client(h) for _ in range(clients)))
  return time.perf_counter() - start, latencies, breaks


async def _streams(base_url, clients, requests, tokens):
  """Streamed chat completions: the time to each one's first content delta,
  and the gaps between its deltas (one per engine iteration at most)."""
  import httpx  # noqa: PLC0415

  queue, first, gaps, whole = list(range(requests)), [], [], []

  async def client(http):
    while queue:
      queue.pop()
      start = last = time.perf_counter()
      body = {"model": "arl_jax", "messages": [{"role": "user", "content": "Hello there"}],
              "max_tokens": tokens, "stream": True}
      async with http.stream("POST", base_url + "/chat/completions", json=body) as r:
        r.raise_for_status()
        seen = False
        async for line in r.aiter_lines():
          if '"content": "' in line and '"content": ""' not in line:
            now = time.perf_counter()
            (gaps if seen else first).append(now - last)
            seen, last = True, now
      whole.append(time.perf_counter() - start)

  async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as h:
    await asyncio.gather(*(client(h) for _ in range(clients)))
  return first, gaps, whole


# The decoder body of SmolLM2-135M (30 layers, d 576, 9 query / 3 KV heads,
# MLP 1536), random, with the tiny chat tokenizer's vocabulary: a real small
# model's work per token, where `tiny` has almost none (so its rows measure
# the HTTP path's CPU against nearly free decode steps).
MODEL_SHAPES = {
    "tiny": {},
    "smollm2_body": dict(d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                         mlp_dim=1536),
}


def _cpu_snapshot():
  return {"process": time.process_time(), "http": _thread_cpu_s("gateway-http"),
          "engine": _thread_cpu_s("sampler-engine")}


_ENGINE_COUNTS = ("steps", "inserts", "prefill_phases", "prefill_seconds", "decode_seconds",
                  "occupied_slot_steps", "slot_steps")


def _engine_work(engine, before: dict | None = None) -> dict:
  """The engine's counters now (`before` None), or what it did since `before`:
  decode steps, admissions, seconds in prefill and decode calls, occupancy
  (so a difference of the two sides shows whether the engine did more work
  or did the same work slower)."""
  now = {k: getattr(engine.stats, k) for k in _ENGINE_COUNTS}
  if before is None:
    return now
  d = {k: now[k] - before[k] for k in _ENGINE_COUNTS}
  return {"decode_steps": d["steps"], "admissions": d["inserts"],
          "prefill_phases": d["prefill_phases"], "prefill_s": round(d["prefill_seconds"], 3),
          "decode_s": round(d["decode_seconds"], 3),
          "occupancy": round(d["occupied_slot_steps"] / max(d["slot_steps"], 1), 3)}


def _cpu_ms_per_request(before, after, requests, client_cpu_s=None) -> dict:
  """CPU milliseconds per request: the server's HTTP thread, its engine
  thread, the whole server process (XLA's threads too) and the clients."""
  per = lambda key: (None if before[key] is None or after[key] is None  # noqa: E731
                     else round(1e3 * (after[key] - before[key]) / requests, 3))
  out = {"http_thread_cpu_ms": per("http"), "engine_thread_cpu_ms": per("engine"),
         "process_cpu_ms": per("process")}
  if client_cpu_s is not None:
    out["client_process_cpu_ms"] = round(1e3 * client_cpu_s / requests, 3)
  return out


def _throughput_rows(served, prompt, tokens, clients, quick, model):
  """`gateway` / `in_process` (/ `gateway_httpx_same_process` on `tiny`)
  tokens/s at each number of clients, with CPU per request, and their ratio."""
  sides = ("in_process", "gateway") + (("gateway_httpx_same_process",) if model == "tiny"
                                       else ())
  asyncio.run(_in_process_clients(served.server.port, prompt, tokens, 8, 16))
  _gateway_clients_elsewhere(served.base_url, prompt, tokens, 8, 16)
  rows = []
  for c in clients:
    requests = max(2 * c, 8) if not quick else 4
    pair = {}
    for side in sides:
      before, work, client_cpu = _cpu_snapshot(), _engine_work(served.server.engine), None
      if side == "gateway":
        wall, sampled, lat, client_cpu = _gateway_clients_elsewhere(served.base_url, prompt,
                                                                    tokens, c, requests)
      elif side == "gateway_httpx_same_process":
        wall, sampled, lat = asyncio.run(_gateway_clients(served.base_url, prompt, tokens, c,
                                                          requests))
      else:
        wall, sampled, lat = asyncio.run(_in_process_clients(served.server.port, prompt, tokens,
                                                             c, requests))
      pair[side] = sampled / wall
      rows.append({"benchmark": "gateway", "part": "throughput", "model": model, "side": side,
                   "clients": c, "requests": requests, "tokens": sampled,
                   "tokens_per_s": round(sampled / wall, 1),
                   "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
                   "latency_p99_s": round(float(np.percentile(lat, 99)), 4)}
                  | _cpu_ms_per_request(before, _cpu_snapshot(), requests, client_cpu)
                  | _engine_work(served.server.engine, work))
    rows.append({"benchmark": "gateway", "part": "ratio", "model": model, "clients": c,
                 "gateway_over_in_process": round(pair["gateway"] / pair["in_process"], 3)}
                | ({"httpx_same_process_over_in_process": round(
                    pair["gateway_httpx_same_process"] / pair["in_process"], 3)}
                   if "gateway_httpx_same_process" in pair else {}))
  return rows


def _stream_rows(served, tokens, quick):
  rows = []
  for c in ([4] if quick else [1, 16, 64]):
    for _ in range(1 if quick else 2):  # (the first round compiles its shapes)
      first, gaps, whole = asyncio.run(_streams(served.base_url, c,
                                                4 if quick else max(2 * c, 8), tokens))
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 4) if xs else None  # noqa: E731
    rows.append({"benchmark": "gateway", "part": "stream", "clients": c,
                 "requests": len(whole), "ttft_p50_s": pct(first, 50),
                 "ttft_p99_s": pct(first, 99), "delta_gap_p50_s": pct(gaps, 50),
                 "delta_gap_p99_s": pct(gaps, 99), "whole_p50_s": pct(whole, 50)})
  return rows


def _session_rows(served, quick):
  rows = []
  for c in ([4] if quick else [1, 16, 64]):
    count = 4 if quick else max(2 * c, 16)
    for _ in range(1 if quick else 2):  # (the first round compiles its shapes)
      wall, lat, breaks = asyncio.run(_sessions(served.base_url, c, count, 3, 8))
    rows.append({"benchmark": "gateway", "part": "sessions", "clients": c, "sessions": count,
                 "turns": 3, "tokens": 8, "sessions_per_s": round(count / wall, 2),
                 "latency_p50_s": round(float(np.percentile(lat, 50)), 4),
                 "latency_p99_s": round(float(np.percentile(lat, 99)), 4), "breaks": breaks})
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="a few requests, for the tests")
  parser.add_argument("--clients", default="1,16,128")
  parser.add_argument("--tokens", type=int, default=32)
  parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SHAPES))
  parser.add_argument("--prompt_buckets", default="",
                      help="comma-separated prompt lengths the engine pads to below its 384 "
                      "(sampler.prompt_buckets; default: a served engine's, powers of two "
                      "from 32; 384 alone pads every prompt to 384, as before 2026-12-06)")
  parser.add_argument("--parts", default="throughput,stream,sessions",
                      help="comma-separated: throughput, stream, sessions")
  parser.add_argument("--out", help="append JSON rows here")
  args = parser.parse_args(argv)
  parts = set(args.parts.split(","))
  if parts - {"throughput", "stream", "sessions"}:
    parser.error(f"--parts: unknown {sorted(parts - {'throughput', 'stream', 'sessions'})}")
  from arl_jax.testing import served as served_lib  # noqa: PLC0415

  clients = [1, 4] if args.quick else [int(c) for c in args.clients.split(",")]
  # Every program shape compiled before the first round (else the first side
  # to see a new batch size pays its compiles: 16 clients once read 1.98x).
  served = served_lib.start_tiny(tempfile.mkdtemp(), num_slots=32, max_new_tokens=64,
                                 precompile=not args.quick,
                                 model_shape=MODEL_SHAPES[args.model],
                                 prompt_buckets=tuple(int(b) for b in args.prompt_buckets.split(",")
                                                      if b))
  rows = []
  try:
    if "throughput" in parts:
      rows += _throughput_rows(served, list(range(10, 26)), args.tokens, clients, args.quick,
                               args.model)
    if "stream" in parts:
      rows += _stream_rows(served, args.tokens, args.quick)
    if "sessions" in parts:
      rows += _session_rows(served, args.quick)
  finally:
    served.server.stop()
  report.print_table(rows, f"gateway against the engine in-process ({args.model} model, "
                     "1 CPU device)")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
