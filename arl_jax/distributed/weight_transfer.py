"""Weights across processes: the learner serves each published version, sampler
processes pull it (the disaggregated-sampler path of docs/design.md section 2).

`jax.experimental.transfer` moves the arrays; ZeroMQ carries the small control
messages (which version is newest, under which transfer id). The served arrays
are the learner's `WeightPublisher` output: already cast and laid out with the
sampler's PartitionSpecs on a local mesh of the sampler's shape, because a pull
into a different per-shard layout returns wrong values without an error
(docs/jax_notes.md). The sampler process builds the same shardings on its own mesh.

Protocol (ZeroMQ REQ/REP, JSON): a sampler sends `{"have": version or null,
"has_base": bool}`; the server answers `{"version": v}` when nothing newer
exists, else schedules one pull of version `v` under a fresh id and answers
`{"version": v, "uuid": u, "address": transfer address, "whole": bool}`. One
pull is scheduled per request, so any number of samplers can pull the same
version. With LoRA (`models/lora.py`) a sampler's first pull is the whole
model (`whole`: the frozen base and the adapters) and every later one the
adapters alone (with a critic's value head), which it puts beside the base
it keeps.

`WeightClient.latest()` has the interface of `WeightPublisher.latest()`, so a
sampler engine in another process uses it unchanged.
"""

from __future__ import annotations

import itertools
import json
import threading
import time

import jax
import zmq
from jax.experimental import transfer

from arl_jax.models import lora as lora_lib


def _transfer_server(devices, host: str):
  return transfer.start_transfer_server(devices[0].client, f"{host}:0", [f"{host}:0"])


class WeightServer:
  """Learner side: serves the newest version of a `WeightPublisher` to pulls."""

  def __init__(self, publisher, *, host: str = "127.0.0.1", port: int = 0):
    """Args:
      publisher: a `learner.publish.WeightPublisher` whose sampler shardings
        have the remote samplers' PartitionSpecs and mesh shape.
      host: interface for the control socket and the transfer server.
      port: control port (0: any free one; see `address`).
    """
    self._publisher = publisher
    devices = jax.devices()
    self._transfer = _transfer_server(devices, host)
    self._context = zmq.Context.instance()
    self._socket = self._context.socket(zmq.REP)
    self._socket.linger = 0
    if port:
      self._socket.bind(f"tcp://{host}:{port}")
    else:
      port = self._socket.bind_to_random_port(f"tcp://{host}")
    self.address = f"tcp://{host}:{port}"
    self._ids = itertools.count(1)
    self.pulls_served = 0
    self.bytes_served = 0  # what the pulls served moved (one sampler's copy each)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    poller = zmq.Poller()
    poller.register(self._socket, zmq.POLLIN)
    while not self._stop.is_set():
      if not poller.poll(50):
        continue
      request = json.loads(self._socket.recv())
      version, params, trained = self._publisher.latest_trained()
      reply = {"version": version}
      if version is not None and request.get("have") != version:
        whole = not (self._publisher.has_frozen_base and request.get("has_base"))
        served = params if whole else trained
        uuid = next(self._ids)
        self._transfer.await_pull(uuid, served)
        reply.update(uuid=uuid, address=self._transfer.address(), whole=whole)
        self.pulls_served += 1
        self.bytes_served += sum(x.nbytes for x in jax.tree.leaves(served))
      self._socket.send(json.dumps(reply).encode())

  def close(self) -> None:
    self._stop.set()
    self._thread.join()
    self._socket.close()


class WeightClient:
  """Sampler side: `latest()` -> `(version, params)`, pulling each new version
  from a `WeightServer` into `abstract_params`' shardings (on this process's
  devices). Asks the server at most every `poll_interval_s`."""

  def __init__(self, address: str, abstract_params, *, host: str = "127.0.0.1",
               poll_interval_s: float = 0.05, timeout_s: float = 60.0):
    """Args:
      address: the server's control address (`WeightServer.address`).
      abstract_params: the sampler's params as ShapeDtypeStructs with their
        shardings (same PartitionSpecs and mesh shape as the server's).
      host: interface for this side's transfer server.
      poll_interval_s: minimum seconds between two questions to the server.
      timeout_s: how long an answer may take before `latest` raises.
    """
    self._abstract = abstract_params
    # With LoRA adapters: their part, and the base once the first pull brought it.
    self._abstract_trained, abstract_base = lora_lib.split(abstract_params)
    self._keeps_base = bool(jax.tree.leaves(abstract_base))
    self._base = None
    self._transfer = _transfer_server(jax.devices(), host)
    self._connections: dict[str, object] = {}
    self._context = zmq.Context.instance()
    self._address = address
    self._timeout_ms = int(timeout_s * 1000)
    self._socket = self._connect()
    self._poll_interval_s = poll_interval_s
    self._last_poll = -float("inf")
    self.version: int | None = None
    self.params = None
    self.pulls = 0
    self.pull_seconds = 0.0
    self.pulled_bytes = 0

  def _connect(self):
    socket = self._context.socket(zmq.REQ)
    socket.linger = 0
    socket.rcvtimeo = self._timeout_ms
    socket.connect(self._address)
    return socket

  def latest(self):
    now = time.monotonic()
    if now - self._last_poll < self._poll_interval_s:
      return self.version, self.params
    self._last_poll = now
    self._socket.send(json.dumps({"have": self.version,
                                  "has_base": self._base is not None}).encode())
    try:
      reply = json.loads(self._socket.recv())
    except zmq.Again:
      # A REQ socket that missed its answer cannot ask again: start a fresh one.
      self._socket.close()
      self._socket = self._connect()
      raise TimeoutError(f"no answer from the weight server at {self._address}") from None
    if "uuid" in reply:
      start = time.monotonic()
      connection = self._connections.get(reply["address"])
      if connection is None:
        connection = self._connections[reply["address"]] = self._transfer.connect(
            reply["address"])
      whole = reply.get("whole", True)
      params = connection.pull(reply["uuid"],
                               self._abstract if whole else self._abstract_trained)
      jax.block_until_ready(params)
      self.pull_seconds += time.monotonic() - start
      self.pulls += 1
      self.pulled_bytes += sum(x.nbytes for x in jax.tree.leaves(params))
      if self._keeps_base and whole:
        self._base = lora_lib.split(params)[1]
      elif self._keeps_base:
        params = lora_lib.merge(params, self._base)
      self.version, self.params = reply["version"], params
    return self.version, self.params

  def close(self) -> None:
    self._socket.close()
