"""The sampler process's end of the connection to the learner (`LearnerLink`).

One `LearnerLink` thread owns the ZeroMQ DEALER socket (sockets are not
thread-safe); the engine and env threads hand it messages through a queue. It
joins the learner (hello, welcome), asks for groups, sends groups back, beats
its heart with the counters, hears cancellations, lockstep announcements and
the end of the run, and ends the process's sampling when the learner falls
silent for its timeout. The address is checked first (`tcp://HOST:PORT`);
while no learner answers at it a line says so every few seconds.

Exit codes of a sampler process: 0 the learner ended the run; 1 a failure
here, no learner answered, or the learner went silent; 2 a bad command line
or settings; 3 the learner refused this process (wrong device count) or
declared it lost (it was silent too long; its groups went elsewhere).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import zmq

from arl_jax.distributed import messages, wire

EXIT_STOPPED, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_REJECTED = 0, 1, 2, 3


class LearnerGone(RuntimeError):
  """The learner refused or dropped this sampler, or stopped answering."""


class LearnerUnreachable(LearnerGone):
  """No learner answered the first message within the connect timeout."""


def check_address(address: str) -> str:
  """Returns `address` if it is `tcp://HOST:PORT` with a port in 1..65535.

  Raises:
    ValueError: saying what is wrong and what to write instead.
  """
  scheme, sep, rest = address.partition("://")
  if not sep:
    raise ValueError(f"{address!r} has no scheme: write tcp://HOST:PORT (e.g. "
                     f"tcp://{address}), as the learner prints it and writes it to fleet.json")
  if scheme != "tcp":
    raise ValueError(f"{address!r}: only tcp:// addresses are supported (tcp://HOST:PORT)")
  host, sep, port = rest.rpartition(":")
  if not sep or not host or host == "*" or any(c.isspace() for c in host):
    raise ValueError(f"{address!r}: expected tcp://HOST:PORT with the learner's host name or "
                     "IP address as HOST")
  if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
    raise ValueError(f"{address!r}: port {port!r} is not a number in 1..65535")
  return address


class LearnerLink:
  """This process's connection to the learner's `SamplerFleet`."""

  def __init__(self, address: str, *, name: str, num_devices: int,
               connect_timeout_s: float = 120.0, print_fn=None, notice_every_s: float = 5.0,
               process: int | None = None):
    """Joins the learner: says hello and waits for its welcome.

    Args:
      address: the learner's fleet address, `tcp://HOST:PORT`.
      name: this sampler's name in the learner's log.
      num_devices: devices this process samples on.
      connect_timeout_s: how long to wait for the learner's first answer.
      print_fn: where to say, every `notice_every_s` seconds, that no learner
        has answered yet (None: nowhere).
      notice_every_s: see `print_fn`.
      process: this process's index in a multi-controller job (it holds the
        groups it samples, `held_groups.py`); None: a sampler process.

    Raises:
      LearnerUnreachable: no answer within `connect_timeout_s`.
      LearnerGone: the learner refused this sampler.
    """
    self._socket = zmq.Context.instance().socket(zmq.DEALER)
    self._socket.linger = 1000  # let a last `bye` or group leave
    try:
      self._socket.connect(address)
    except zmq.ZMQError as e:
      self._socket.close(linger=0)
      raise ValueError(f"cannot connect to {address!r}: {e}") from None
    self.address = address
    # ZeroMQ keeps reconnecting in the background and sends the hello once
    # a connection is up, so waiting is retrying; the notices tell the user
    # early that nothing answers (a wrong address, or no learner yet).
    hello = messages.Hello(name=name, devices=num_devices, process=process)
    self._socket.send_multipart(wire.encode(messages.to_wire(hello)))
    start = time.monotonic()
    while True:
      left = start + connect_timeout_s - time.monotonic()
      if self._socket.poll(int(max(0.0, min(notice_every_s, left)) * 1000)):
        break
      waited = time.monotonic() - start
      if waited >= connect_timeout_s:
        self._socket.close(linger=0)  # (the unsent hello would hold up the exit)
        raise LearnerUnreachable(
            f"no learner answered at {address} within {connect_timeout_s:g}s: is the learner "
            "running, with fleet.remote=True, and is this its address (fleet.json)?")
      if print_fn is not None:
        print_fn(f"sampler {name}: no answer from {address} after {waited:.0f}s; still "
                 f"trying (giving up after {connect_timeout_s:g}s)")
    welcome = messages.from_frames(self._socket.recv_multipart(), messages.FROM_LEARNER)
    if isinstance(welcome, (messages.Refused, messages.Rejected)):
      raise LearnerGone(f"the learner refused this sampler: {welcome.reason}")
    if not isinstance(welcome, messages.Welcome):
      raise ValueError(f"the learner answered a hello with {welcome.kind!r}")
    self.welcome = welcome
    self.heartbeat_s = float(welcome.heartbeat_s)
    self.timeout_s = float(welcome.timeout_s)
    self._outbox: queue.Queue = queue.Queue()
    self._lock = threading.Condition()
    self._notes: list[list[int]] = []
    self._arrived: list = []  # group requests not yet taken by the engine
    self._asking = False  # a `take` is out, its answer not yet back
    self._last_empty = -float("inf")
    self._cancelled: set[int] = set()
    self._on_cancel = lambda group_ids: None
    self._report_fn = None  # set by `start`, before the link thread runs
    self._last_heard = time.monotonic()
    self._lockstep = -1  # the newest lockstep step process 0 announced
    self.ended = threading.Event()
    self.end_code = EXIT_STOPPED
    self.end_reason = ""
    self._thread: threading.Thread | None = None

  def start(self, *, on_cancel, report_fn) -> None:
    """`on_cancel(group_ids)`: drop these groups; `report_fn()`: heartbeat body."""
    self._on_cancel, self._report_fn = on_cancel, report_fn
    self._thread = threading.Thread(target=self._run, name="learner-link", daemon=True)
    self._thread.start()

  # -- called by the engine and env threads ------------------------------------------

  def take(self, max_groups: int, version: int, timeout: float) -> list:
    """Group requests for up to `max_groups` groups at `version`: asks the
    learner (one question at a time) and returns what has arrived, waiting up
    to `timeout` seconds when nothing has."""
    now = time.monotonic()
    with self._lock:
      if not self._asking and now - self._last_empty > 0.02:
        self._asking = True
        self._outbox.put(messages.Take(n=max_groups, version=version))
      self._lock.wait_for(lambda: self._arrived or self.ended.is_set(), timeout)
      arrived, self._arrived = self._arrived, []
    return arrived

  def wait_for_lockstep(self, step: int) -> None:
    """Blocks until process 0 announced lockstep `step` (multi-controller)."""
    with self._lock:
      self._lock.wait_for(lambda: self._lockstep >= step or self.ended.is_set())
    if self._lockstep < step:
      raise LearnerGone(f"process 0 went away before lockstep step {step}: {self.end_reason}")

  def note_sampling(self, group_id: int, version: int) -> None:
    with self._lock:
      self._notes.append([group_id, version])

  def send_group(self, group, held_by: int | None = None, copy: int = 0) -> None:
    """`held_by`: this process keeps the arrays (as `copy`), only the metadata goes."""
    self._outbox.put(messages.GroupDone(group=wire.group_to_wire(group, held_by, copy)))

  def close(self, say_bye: bool) -> None:
    if say_bye and self._thread is not None and not self.ended.is_set():
      self._outbox.put(messages.Bye(**self._report_fn()))
      deadline = time.monotonic() + 2.0
      while not self._outbox.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    self._end(EXIT_STOPPED, "closed")
    if self._thread is not None:
      self._thread.join()
    self._socket.close()

  # -- the link thread -----------------------------------------------------------------

  def _end(self, code: int, reason: str) -> None:
    if not self.ended.is_set():
      self.end_code, self.end_reason = code, reason
      self.ended.set()
    with self._lock:
      self._lock.notify_all()

  def _run(self) -> None:
    next_beat = time.monotonic()
    try:
      while not self.ended.is_set():
        now = time.monotonic()
        if now >= next_beat:
          self._outbox.put(messages.Heartbeat(**self._report_fn()))
          next_beat = now + self.heartbeat_s
        self._flush()
        if self._socket.poll(10):
          while self._socket.poll(0):
            self._handle(messages.from_frames(self._socket.recv_multipart(),
                                              messages.FROM_LEARNER))
        if time.monotonic() - self._last_heard > self.timeout_s:
          self._end(EXIT_FAILED, f"the learner at {self.address} was silent for "
                                 f"{self.timeout_s}s")
      self._flush()
    except BaseException as e:  # noqa: BLE001 - ends the process with the reason
      self._end(EXIT_FAILED, f"link failed: {e!r}")

  def _flush(self) -> None:
    while True:
      try:
        message = self._outbox.get_nowait()
      except queue.Empty:
        return
      if isinstance(message, (messages.Take, messages.Heartbeat)):  # (a Bye is a Heartbeat)
        with self._lock:
          message, self._notes = dataclasses.replace(message, notes=self._notes), []
      self._socket.send_multipart(wire.encode(messages.to_wire(message)))

  def _handle(self, message: messages.Message) -> None:
    self._last_heard = time.monotonic()
    match message:
      case messages.Groups(requests=records):
        requests = [wire.request_from_wire(r) for r in records]
        with self._lock:
          self._asking = False
          if not requests:
            self._last_empty = time.monotonic()
          self._arrived += [r for r in requests if r.group_id not in self._cancelled]
          self._lock.notify_all()
      case messages.Cancel(group_ids=group_ids):
        with self._lock:
          self._cancelled.update(group_ids)
          self._arrived = [r for r in self._arrived if r.group_id not in self._cancelled]
        self._on_cancel(list(group_ids))
      case messages.Lockstep(step=step):
        with self._lock:
          self._lockstep = max(self._lockstep, step)
          self._lock.notify_all()
      case messages.Stop():
        self._end(EXIT_STOPPED, "the learner ended the run")
      case messages.Rejected(reason=reason):
        self._end(EXIT_REJECTED, f"the learner dropped this sampler: {reason}")
      case messages.Ack():
        pass
      case _:  # (a Welcome or Refused after joining)
        raise ValueError(f"unexpected {message.kind!r} from the learner")
