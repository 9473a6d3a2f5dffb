"""The learner's side of a disaggregated sampler fleet (docs/design.md section 8).

With `fleet.remote = True` the learner process runs no sampler engine: sampler
processes (`python -m arl_jax.distributed.sampler_worker --learner=ADDRESS`),
each a separate JAX program with its own devices and env workers, join over
ZeroMQ. `SamplerFleet` is what the learner loop talks to instead of a local
engine; it keeps every rule of the single-process run in the one orchestrator:

- requests: a sampler asks for groups (`take`: free slots, the version it
  holds) and the dispatcher answers under the same admission control as a
  local engine (nothing for a sampler behind the newest version: it must pull
  first). The free capacity is shared: one `take` gets at most its share
  (free groups / live samplers, rounded up), so a sampler that asks first
  does not take every group while the others idle (the next share goes to
  whoever asks next). Each handed-out group is owned by that sampler.
- results: finished, scored groups come back and enter the rollout buffer
  through `Orchestrator.group_finished`, stamped with the version live on
  arrival; the staleness sweep, assembly and drop accounting are unchanged.
- cancellation: the groups a publish cancels are pushed to their owners, which
  drop their slots and environment calls.
- weights: a `WeightServer` serves each published version; samplers pull it
  with `jax.experimental.transfer` (the sampler layout is made here first).
- faults: a sampler silent for `timeout_s` (dead, hung, partitioned) is lost:
  its groups start again from scratch on the other samplers
  (`Dispatcher.reassign`, same ids and dispatch versions), and anything it
  sends later is refused. A restarted sampler joins as a new one and pulls
  the newest version first.

Sockets: one ROUTER, used only by this class's thread (ZeroMQ sockets are not
thread-safe); the learner thread hands it cancellations through a queue.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import socket
import threading
import time

import zmq

from arl_jax.distributed import fleet_config, messages, weight_transfer, wire
from arl_jax.sampler import engine_stats

_ANY_INTERFACE = ("0.0.0.0", "*")

def _this_host() -> str:
  """An address of this machine that other hosts can reach (its name's)."""
  try:
    return socket.gethostbyname(socket.gethostname())
  except OSError:
    return socket.gethostname()


@dataclasses.dataclass
class _Sampler:
  """A sampler process as the learner knows it."""

  sampler_id: int
  name: str
  identity: bytes
  last_seen: float
  alive: bool = True
  process: int | None = None  # a multi-controller process (holds its groups)
  owned: set[int] = dataclasses.field(default_factory=set)  # group ids it generates
  groups_delivered: int = 0
  stats: engine_stats.EngineStats = dataclasses.field(default_factory=engine_stats.EngineStats)
  env_errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  env_timeouts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  env_turns: int = 0


class SamplerFleet:
  """The learner's server for sampler processes (`training.rollouts.RemoteRollouts`
  wraps it as the run's rollout side; a multi-controller run's process 0 uses
  it beside its local engine for the other processes' samplers)."""

  def __init__(self, cfg: fleet_config.FleetConfig, *, orchestrator, publisher, spec: dict,
               sampler_mesh_shape, workdir: str | None = None, print_fn=print,
               event_fn=lambda event: None, num_processes: int = 1):
    """Args:
      cfg: fleet settings.
      orchestrator: the run's orchestrator (dispatcher, buffer).
      publisher: the `WeightPublisher` whose versions samplers pull.
      spec: the run's resolved settings (`run_spec.RunSpec` as
        `spec_codec.to_json` writes it); joining samplers run them.
      sampler_mesh_shape: `[(axis, size), ...]` the samplers must build (the
        layout `publisher` stages versions in).
      workdir: where `fleet.json` (the addresses) is written; None: nowhere.
      print_fn: progress lines (joins, losses).
      event_fn: receives one dict per fleet event (for metrics.jsonl).
      num_processes: processes of a multi-controller run: processes 1.. send
        finished groups as metadata, keeping the arrays (`held_groups.py`).
    """
    self._cfg = cfg
    self._orchestrator = orchestrator
    self._dispatcher = orchestrator.dispatcher
    self._spec = spec
    self._mesh_shape = [[str(a), int(n)] for a, n in sampler_mesh_shape]
    self._print = print_fn
    self._event_fn = event_fn
    # Listening on every interface: samplers are told this host's address.
    advertised = cfg.host if cfg.host not in _ANY_INTERFACE else _this_host()
    self._weights = weight_transfer.WeightServer(publisher, host=advertised)
    self._socket = zmq.Context.instance().socket(zmq.ROUTER)
    self._socket.linger = 0
    if cfg.port:
      self._socket.bind(f"tcp://{cfg.host}:{cfg.port}")
      port = cfg.port
    else:
      port = self._socket.bind_to_random_port(f"tcp://{cfg.host}")
    self.address = f"tcp://{advertised}:{port}"
    if workdir is not None:
      with open(os.path.join(workdir, "fleet.json"), "w", encoding="utf-8") as f:
        json.dump({"address": self.address, "weights_address": self._weights.address}, f)
    self._lock = threading.Lock()  # guards the samplers' records and the counters
    self._samplers: dict[bytes, _Sampler] = {}
    self._owner: dict[int, _Sampler] = {}  # group id -> the sampler generating it
    self._outbox: queue.Queue = queue.Queue()  # messages from the learner thread
    self._num_processes = num_processes
    # Held groups (`held_groups.py`): (group id, copy) never to be trained,
    # and those in the buffer: group id -> copy (`take_forgotten`).
    self._forgotten: list[tuple[int, int]] = []
    self._held: dict[int, int] = {}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    # The engine and env-runner counters of a local run, summed over samplers
    # (each sampler reports its totals; the learner adds what grew).
    self.stats = engine_stats.EngineStats()
    self.errors: collections.Counter = collections.Counter()
    self.timeouts: collections.Counter = collections.Counter()
    self.turns = 0
    self.samplers_lost = 0
    self.late_groups = 0  # sent by a sampler that no longer owned them (cancelled, lost)
    self.bad_groups = 0  # malformed groups (reassigned)

  # -- the learner loop's interface --------------------------------------------

  def start(self) -> None:
    if self._thread is not None:
      return
    if self._cfg.remote:
      self._print(f"fleet: waiting for sampler processes at {self.address} "
                  f"(python -m arl_jax.distributed.sampler_worker --learner={self.address})")
    self._thread = threading.Thread(target=self._run, name="sampler-fleet", daemon=True)
    self._thread.start()

  def cancel(self, group_ids) -> None:
    """Tells the owners of these groups to drop them (the publish cancelled them)."""
    group_ids = list(group_ids)
    if group_ids:
      self._outbox.put(messages.Cancel(group_ids=group_ids))

  def announce(self, step: int) -> None:
    """Multi-controller lockstep: tells the other processes that process 0 is
    about to enter collective `step` (see `lockstep.py`)."""
    self._outbox.put(messages.Lockstep(step=step))

  def restart(self, group_ids) -> None:
    """Open groups a checkpoint restored: they start again from scratch on
    whichever sampler asks first (the sampled tokens of a remote group live in
    its sampler process, which the learner's checkpoint does not hold)."""
    self._dispatcher.reassign(group_ids)

  def take_forgotten(self, is_open) -> list[tuple[int, int]]:
    """`(group id, copy)` of held groups (`held_groups.py`) that will never
    train: those that came late or malformed, and those that left the run's
    open work (`is_open(group_id)` False: swept as stale, cancelled, or
    trained, whose holders let them go already) since the last call. Their
    holders may drop them (`ShardPlan.forget`)."""
    with self._lock:
      gone = [gid for gid in self._held if not is_open(gid)]
      forgotten = self._forgotten + [(gid, self._held.pop(gid)) for gid in gone]
      self._forgotten = []
    return forgotten

  @property
  def failed(self) -> bool:
    return self._error is not None

  def raise_if_failed(self) -> None:
    if self._error is not None:
      raise RuntimeError("the sampler fleet's server thread failed") from self._error

  def stop(self, raise_errors: bool = True) -> None:
    """Tells every live sampler the run is over and closes the sockets."""
    if self._thread is not None:
      self._outbox.put(messages.Stop())
      self._stop.set()
      self._thread.join()
    self._socket.close(linger=1000)  # let the `stop` messages leave
    self._weights.close()
    if raise_errors:
      self.raise_if_failed()

  def sampler_metrics(self) -> dict:
    """The samplers' engine and env-runner numbers, summed (for the step
    records of a run whose sampling is all remote)."""
    with self._lock:
      return {**self.stats.metrics(),
              "env_errors": int(sum(self.errors.values())),
              "env_timeouts": int(sum(self.timeouts.values())), "env_turns": self.turns}

  def state_dict(self) -> dict:
    """The summed counters a checkpoint carries (as a local run's)."""
    with self._lock:
      return {"sampler": self.stats.state_dict(),
              "env": {"errors": dict(self.errors), "timeouts": dict(self.timeouts),
                      "turns": self.turns}}

  def load_state_dict(self, state: dict) -> None:
    with self._lock:
      self.stats.load_state_dict(state["sampler"])
      self.errors.update(state["env"]["errors"])
      self.timeouts.update(state["env"]["timeouts"])
      self.turns = int(state["env"]["turns"])

  def metrics(self) -> dict:
    """Fleet numbers for the step records."""
    with self._lock:
      samplers = list(self._samplers.values())
      return {
          "fleet_samplers_live": sum(s.alive for s in samplers),
          "fleet_samplers_lost": self.samplers_lost,
          "fleet_groups_reassigned": self._dispatcher.num_reassigned,
          "fleet_groups_by_sampler": {str(s.sampler_id): s.groups_delivered for s in samplers},
          "fleet_late_groups": self.late_groups,
          "fleet_weight_pulls": self._weights.pulls_served,
      }

  # -- the server thread ------------------------------------------------------------

  def _run(self) -> None:
    try:
      poller = zmq.Poller()
      poller.register(self._socket, zmq.POLLIN)
      while True:
        self._send_outbox()
        if self._stop.is_set():
          return
        if poller.poll(10):
          while self._socket.poll(0):
            identity, *frames = self._socket.recv_multipart()
            try:
              message = messages.from_frames(frames, messages.FROM_SAMPLER)
            except ValueError as e:  # a sampler's fault, not the run's
              self._refuse(identity, f"sent a malformed message ({e})")
            else:
              self._handle(identity, message)
        self._find_lost(time.monotonic())
    except BaseException as e:  # surfaced to the learner thread by raise_if_failed
      self._error = e

  def _send(self, identity: bytes, message: messages.Message) -> None:
    self._socket.send_multipart([identity, *wire.encode(messages.to_wire(message))])

  def _send_outbox(self) -> None:
    while True:
      try:
        message = self._outbox.get_nowait()
      except queue.Empty:
        return
      if isinstance(message, (messages.Stop, messages.Lockstep)):  # (to every sampler)
        with self._lock:
          live = [s for s in self._samplers.values() if s.alive]
        for sampler in live:
          self._send(sampler.identity, message)
        continue
      by_owner = collections.defaultdict(list)  # (a cancel goes to each group's owner)
      with self._lock:
        for gid in message.group_ids:
          owner = self._owner.pop(gid, None)
          if owner is not None:
            owner.owned.discard(gid)
            by_owner[owner.identity].append(gid)
      for identity, gids in by_owner.items():
        self._send(identity, messages.Cancel(group_ids=gids))

  def _handle(self, identity: bytes, message: messages.Message) -> None:
    now = time.monotonic()
    if isinstance(message, messages.Hello):
      self._join(identity, message, now)
      return
    with self._lock:
      sampler = self._samplers.get(identity)
      if sampler is not None and sampler.alive:
        sampler.last_seen = now
    if sampler is None or not sampler.alive:
      # Lost (its groups went elsewhere) or never joined: it must start over.
      self._send(identity, messages.Rejected(reason=(
          "unknown sampler" if sampler is None else
          f"declared lost after {self._cfg.timeout_s}s without a message; its groups were "
          "reassigned")))
      return
    for gid, version in getattr(message, "notes", ()):
      self._dispatcher.note_sampling(gid, version)
    match message:
      case messages.Take(n=n, version=version):
        with self._lock:
          live = sum(s.alive for s in self._samplers.values())
        share = -(-self._dispatcher.free_capacity() // max(live, 1))
        requests = self._dispatcher.take(min(n, max(share, 1)), version, timeout=0.0)
        with self._lock:
          for request in requests:
            self._owner[request.group_id] = sampler
            sampler.owned.add(request.group_id)
        self._send(identity, messages.Groups(
            requests=[wire.request_to_wire(r) for r in requests]))
      case messages.GroupDone(group=record):
        self._receive_group(sampler, record)
      case messages.Bye():
        self._account(sampler, message)
        self._lose(sampler, "left")
      case messages.Heartbeat():
        self._account(sampler, message)
        self._send(identity, messages.Ack())  # the sampler's sign that the learner lives

  def _refuse(self, identity: bytes, why: str) -> None:
    """Drops a sampler that broke the protocol (its groups go elsewhere)."""
    with self._lock:
      sampler = self._samplers.get(identity)
    if sampler is not None and sampler.alive:
      self._lose(sampler, why)
    self._send(identity, messages.Rejected(reason=why))

  def _join(self, identity: bytes, hello: messages.Hello, now: float) -> None:
    want = 1
    for _, size in self._mesh_shape:
      want *= size
    if hello.devices < want:
      self._send(identity, messages.Refused(reason=(
          f"this run's samplers use mesh.sampler={self._mesh_shape} ({want} devices); the "
          f"process has {hello.devices}")))
      return
    with self._lock:
      sampler = _Sampler(sampler_id=len(self._samplers), name=hello.name, identity=identity,
                         last_seen=now, process=hello.process)
      self._samplers[identity] = sampler
    self._send(identity, messages.Welcome(
        sampler_id=sampler.sampler_id, spec=self._spec, sampler_mesh=self._mesh_shape,
        weights_address=self._weights.address, heartbeat_s=self._cfg.heartbeat_s,
        timeout_s=self._cfg.timeout_s))
    self._print(f"fleet: sampler {sampler.sampler_id} joined ({sampler.name})")
    self._event_fn({"event": "sampler_joined", "sampler": sampler.sampler_id,
                    "name": sampler.name})

  def _receive_group(self, sampler: _Sampler, record: dict) -> None:
    gid = record["group_id"]  # an int (`messages.GroupDone.check`)
    held = "held_by" in record  # (its holder keeps the arrays until told)
    copy = record.get("held_copy")
    held = held and type(record["held_by"]) is int and type(copy) is int
    with self._lock:
      owned = self._owner.get(gid) is sampler
      if not owned:
        self.late_groups += 1
        if held and record["held_by"] == sampler.process:
          self._forgotten.append((gid, copy))
        return
      del self._owner[gid]
      sampler.owned.discard(gid)
    try:
      group = wire.group_from_wire(record)
      size = self._orchestrator.cfg.group_size
      if [r.sample_index for r in group.rollouts] != list(range(size)):
        raise ValueError(f"sample indices {[r.sample_index for r in group.rollouts]} for a "
                         f"group of {size}")
      if "held_by" in record and not (
          sampler.process is not None and record["held_by"] == sampler.process
          and 0 < sampler.process < self._num_processes):
        raise ValueError(f"held by process {record['held_by']!r}, sent by "
                         f"{'a sampler process' if sampler.process is None else sampler.process}")
    except (ValueError, KeyError, TypeError) as e:
      with self._lock:
        self.bad_groups += 1
        if held and record["held_by"] == sampler.process:
          self._forgotten.append((gid, copy))
      self._print(f"fleet: sampler {sampler.sampler_id} sent a malformed group {gid} ({e}); "
                  "it is generated again")
      self._dispatcher.reassign([gid])
      return
    for rollout in group.rollouts:  # its restart points, should a checkpoint come
      self._orchestrator.rollout_scored(rollout)
    kept = self._orchestrator.group_finished(group)
    with self._lock:
      sampler.groups_delivered += 1
      if held and kept:
        self._held[gid] = copy
      elif held:  # cancelled meanwhile: its holder may drop it
        self._forgotten.append((gid, copy))

  def _account(self, sampler: _Sampler, report: messages.Heartbeat) -> None:
    """Adds what a sampler's reported totals grew by since its last report."""
    stats = wire.stats_from_wire(report.stats)
    env = report.env
    with self._lock:
      for f in dataclasses.fields(stats):
        new, old = getattr(stats, f.name), getattr(sampler.stats, f.name)
        if f.name in engine_stats.EngineStats.MAXIMA:
          setattr(self.stats, f.name, max(getattr(self.stats, f.name), new))
        else:
          setattr(self.stats, f.name, getattr(self.stats, f.name) + new - old)
      sampler.stats = stats
      for total, mine, key in ((self.errors, sampler.env_errors, "errors"),
                               (self.timeouts, sampler.env_timeouts, "timeouts")):
        reported = collections.Counter(env[key])
        total.update(reported - mine)
        mine.clear()
        mine.update(reported)
      self.turns += int(env["turns"]) - sampler.env_turns
      sampler.env_turns = int(env["turns"])

  def _find_lost(self, now: float) -> None:
    with self._lock:
      silent = [s for s in self._samplers.values()
                if s.alive and now - s.last_seen > self._cfg.timeout_s]
    for sampler in silent:
      self._lose(sampler, f"no message for {self._cfg.timeout_s}s")

  def _lose(self, sampler: _Sampler, why: str) -> None:
    with self._lock:
      sampler.alive = False
      owned = sorted(sampler.owned)
      sampler.owned.clear()
      for gid in owned:
        self._owner.pop(gid, None)
      if why != "left":
        self.samplers_lost += 1
    reassigned = self._dispatcher.reassign(owned)
    self._print(f"fleet: sampler {sampler.sampler_id} {why}; {len(reassigned)} of its groups "
                "start again on the other samplers")
    self._event_fn({"event": "sampler_lost" if why != "left" else "sampler_left",
                    "sampler": sampler.sampler_id, "reason": why, "reassigned": reassigned})
