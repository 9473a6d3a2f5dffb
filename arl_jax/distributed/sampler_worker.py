r"""A sampler process: `python -m arl_jax.distributed.sampler_worker --learner=ADDRESS`.

It joins a learner whose config has `fleet.remote = True` (the address is
printed by the learner and written to `WORKDIR/fleet.json`), receives the
run's config, and runs the same `SamplerEngine` and `EnvRunner` a local run
would, on this process's devices:

- requests come from the learner's dispatcher (`RemoteDispatcher`: the
  interface of `Dispatcher` the engine uses), finished groups go back, scored
  by the env workers here;
- weights come from the learner's `WeightServer` (`WeightClient`: the
  interface of `WeightPublisher`), pulled device to device;
- the learner's cancellations drop slots and environment calls here;
- a heartbeat reports the engine's and env workers' counters.

One `LearnerLink` thread owns the ZeroMQ DEALER socket (sockets are not
thread-safe); the engine and env threads hand it messages through a queue.

The address is checked before anything starts (`tcp://HOST:PORT`); while no
learner answers at it, a line says so every few seconds, and after
`--connect_timeout_s` the process gives up.

Exit codes: 0 the learner ended the run; 1 a failure here, no learner
answered, or the learner went silent; 2 a bad command line or config; 3 the
learner refused this process (wrong device count) or declared it lost (it was
silent too long; its groups went elsewhere): restart it to join as a new
sampler.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import socket
import sys
import threading
import time

import zmq

from arl_jax.distributed import wire

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
               connect_timeout_s: float = 120.0, print_fn=None, notice_every_s: float = 5.0):
    """Joins the learner: says hello and waits for its welcome.

    Args:
      address: the learner's fleet address, `tcp://HOST:PORT`.
      name: this sampler's name in the learner's log.
      num_devices: devices this process samples on.
      connect_timeout_s: how long to wait for the learner's first answer.
      print_fn: where to say, every `notice_every_s` seconds, that no learner
        has answered yet (None: nowhere).
      notice_every_s: see `print_fn`.

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
    self._socket.send(wire.encode({"type": "hello", "name": name, "devices": num_devices}))
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
    welcome = wire.decode(self._socket.recv())
    if welcome["type"] == "refused":
      raise LearnerGone(f"the learner refused this sampler: {welcome['reason']}")
    self.welcome = welcome
    self.heartbeat_s = float(welcome["heartbeat_s"])
    self.timeout_s = float(welcome["timeout_s"])
    self._outbox: queue.Queue = queue.Queue()
    self._lock = threading.Condition()
    self._notes: list[list[int]] = []
    self._arrived: list = []  # group requests not yet taken by the engine
    self._asking = False  # a `take` is out, its answer not yet back
    self._last_empty = -float("inf")
    self._cancelled: set[int] = set()
    self._on_cancel = lambda group_ids: None
    self._report_fn = dict
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
        self._outbox.put({"type": "take", "n": max_groups, "version": version})
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

  def send_group(self, group) -> None:
    self._outbox.put({"type": "group", "group": wire.group_to_json(group)})

  def close(self, say_bye: bool) -> None:
    if say_bye and self._thread is not None and not self.ended.is_set():
      self._outbox.put({"type": "bye", **self._report_fn()})
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
          self._outbox.put({"type": "heartbeat", **self._report_fn()})
          next_beat = now + self.heartbeat_s
        self._flush()
        if self._socket.poll(10):
          while self._socket.poll(0):
            self._handle(wire.decode(self._socket.recv()))
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
      if message["type"] in ("take", "heartbeat", "bye"):
        with self._lock:
          message["notes"], self._notes = self._notes, []
      self._socket.send(wire.encode(message))

  def _handle(self, message: dict) -> None:
    self._last_heard = time.monotonic()
    kind = message["type"]
    if kind == "groups":
      requests = [wire.request_from_json(r) for r in message["requests"]]
      with self._lock:
        self._asking = False
        if not requests:
          self._last_empty = time.monotonic()
        self._arrived += [r for r in requests if r.group_id not in self._cancelled]
        self._lock.notify_all()
    elif kind == "cancel":
      group_ids = [int(g) for g in message["group_ids"]]
      with self._lock:
        self._cancelled.update(group_ids)
        self._arrived = [r for r in self._arrived if r.group_id not in self._cancelled]
      self._on_cancel(group_ids)
    elif kind == "lockstep":
      with self._lock:
        self._lockstep = max(self._lockstep, int(message["step"]))
        self._lock.notify_all()
    elif kind == "stop":
      self._end(EXIT_STOPPED, "the learner ended the run")
    elif kind == "rejected":
      self._end(EXIT_REJECTED, f"the learner dropped this sampler: {message['reason']}")
    elif kind != "ack":
      raise ValueError(f"unknown message type {kind!r} from the learner")


class _NoRestartPoints:
  """Restart points are the learner's business (its open-work registry)."""

  def at_env(self, episode) -> None:
    del episode

  def at_sampler(self, episode) -> None:
    del episode


class RemoteDispatcher:
  """What `SamplerEngine` needs of a `Dispatcher`, answered by the learner."""

  def __init__(self, link: LearnerLink):
    self._link = link
    self.work = _NoRestartPoints()

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    return self._link.take(max_groups, live_version, timeout)

  def note_sampling(self, group_id: int, version: int) -> None:
    self._link.note_sampling(group_id, version)

  def snapshot_work(self, partials, exclude=frozenset()):
    raise RuntimeError("a sampler process holds no checkpoint state (the learner's does)")


class LocalSampling:
  """The engine and env workers of one sampler process (or of one process of a
  multi-controller run), working for the learner at the other end of `link`."""

  def __init__(self, spec, *, mesh, graphdef, weights, link: LearnerLink):
    """Args:
      spec: the run's `config_lib.RunSpec`.
      mesh: this process's sampler mesh.
      graphdef: the decoder's graph definition.
      weights: source of `(version, params)` (`latest()`).
      link: the connection to the learner (joined, not started).
    """
    from arl_jax.envs import env_api, registry  # noqa: PLC0415 - JAX after flags
    from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: PLC0415
    from arl_jax.orchestrator import env_runner as env_runner_lib  # noqa: PLC0415
    from arl_jax.sampler import engine as engine_lib  # noqa: PLC0415

    tokenizer = tokenizer_lib.make_tokenizer(spec.tokenizer)
    env = registry.ENVS[spec.env_name].make_env_fn(spec.env, tokenizer)
    self.link = link
    self.env_runner = env_runner_lib.EnvRunner(
        env, on_group_fn=link.send_group, max_new_tokens=spec.engine.max_new_tokens,
        num_workers=spec.num_env_workers, timeout_s=spec.env_timeout_s,
        vocab_size=spec.model.vocab_size)
    self.engine = engine_lib.SamplerEngine(
        cfg=spec.engine, settings=spec.sampling, graphdef=graphdef,
        model_cfg=spec.sampler_model, mesh=mesh, publisher=weights,
        dispatcher=RemoteDispatcher(link), on_segment_fn=self.env_runner.submit,
        stop_ids_fn=functools.partial(env_api.segment_stop_ids, tokenizer, env))
    self.env_runner.connect(self.engine.resume)

  def start(self) -> None:
    self.link.start(on_cancel=self._cancel, report_fn=self._report)
    self.engine.start()

  def _cancel(self, group_ids) -> None:
    self.engine.cancel(group_ids)
    self.env_runner.cancel(group_ids)

  def _report(self) -> dict:
    return {"stats": wire.stats_to_json(self.engine.stats),
            "env": {"errors": dict(self.env_runner.errors),
                    "timeouts": dict(self.env_runner.timeouts), "turns": self.env_runner.turns},
            "version": self.engine.version}

  @property
  def failed(self) -> bool:
    return self.engine.failed or _failed(self.env_runner)

  def stop(self, say_bye: bool) -> None:
    self.engine.stop(raise_errors=False)
    self.env_runner.close()
    self.link.close(say_bye=say_bye)

  def describe_failure(self) -> str:
    for component in (self.engine, self.env_runner):
      try:
        component.raise_if_failed()
      except RuntimeError as e:
        return f"{e} ({e.__cause__!r})"
    return ""


def run_sampler(learner_address: str, *, name: str | None = None, print_fn=print,
                connect_timeout_s: float = 30.0) -> int:
  """Joins the learner, samples until it ends the run; returns the exit code.

  Args:
    learner_address: the learner's fleet address, `tcp://HOST:PORT`.
    name: this sampler's name in the learner's log (default HOST:PID).
    print_fn: where progress and errors go.
    connect_timeout_s: how long to wait for the learner to answer at first.
  """
  import jax  # noqa: PLC0415 - after the caller set XLA flags
  import ml_collections  # noqa: PLC0415

  from arl_jax import config_lib  # noqa: PLC0415
  from arl_jax.distributed import weight_transfer  # noqa: PLC0415
  from arl_jax.models import init_lib  # noqa: PLC0415
  from arl_jax.sharding import mesh_lib  # noqa: PLC0415
  from arl_jax.sharding import rules as rules_lib  # noqa: PLC0415

  name = name or f"{socket.gethostname()}:{os.getpid()}"
  try:
    link = LearnerLink(learner_address, name=name, num_devices=len(jax.local_devices()),
                       connect_timeout_s=connect_timeout_s, print_fn=print_fn)
  except LearnerUnreachable as e:
    print_fn(f"sampler {name}: error: {e}")
    return EXIT_FAILED
  except LearnerGone as e:
    print_fn(f"sampler {name}: {e}")
    return EXIT_REJECTED
  welcome = link.welcome
  sampler_mesh = tuple((str(a), int(n)) for a, n in welcome["sampler_mesh"])
  num_devices = 1
  for _, size in sampler_mesh:
    num_devices *= size
  devices = jax.local_devices()[:num_devices]
  config = ml_collections.ConfigDict(welcome["config"])
  # This process samples only: its mesh is the learner's `mesh.sampler` as
  # resolved there (the layout weights arrive in); the learner mesh entry
  # only satisfies the config checks (nothing is placed on it).
  config.mesh.update(placement="colocated", learner=[("fsdp", 1), ("tp", -1)],
                     sampler=[list(axis) for axis in sampler_mesh])
  try:
    spec = config_lib.build(config, devices=devices)
  except config_lib.ConfigError as e:  # e.g. a data file missing on this host
    print_fn(f"sampler {name}: error: {e}")
    link.close(say_bye=False)
    return EXIT_BAD_INPUT
  mesh = mesh_lib.make_role_meshes(spec.mesh, devices=devices).sampler
  graphdef, abstract = init_lib.abstract_model(spec.model)
  shardings = rules_lib.state_shardings(abstract, mesh, rules_lib.SAMPLER_RULES)
  dtype = jax.numpy.dtype(spec.sampler_model.param_dtype)
  # The layout and dtype the learner's publisher stages each version in.
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s),
                          abstract, shardings)
  weights = weight_transfer.WeightClient(welcome["weights_address"], abstract,
                                         timeout_s=link.timeout_s)
  sampling = LocalSampling(spec, mesh=mesh, graphdef=graphdef, weights=weights, link=link)
  stop = threading.Event()
  previous = None
  if threading.current_thread() is threading.main_thread():
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
  print_fn(f"sampler {name}: joined {learner_address} as sampler {welcome['sampler_id']} "
           f"(mesh {dict(mesh.shape)})")
  sampling.start()
  code, reason = EXIT_STOPPED, ""
  try:
    while not link.ended.is_set() and not stop.is_set():
      if sampling.failed:
        code, reason = EXIT_FAILED, sampling.describe_failure()
        break
      time.sleep(0.05)
  except KeyboardInterrupt:
    stop.set()
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    if link.ended.is_set():
      code, reason = link.end_code, link.end_reason
    elif stop.is_set():
      reason = "stopped by a signal"
    # Leaving on our own: say so, so that the learner reassigns our groups now.
    sampling.stop(say_bye=code != EXIT_STOPPED or stop.is_set())
    weights.close()
  print_fn(f"sampler {name}: {reason}; {sampling.engine.stats.sampled_tokens} tokens sampled, "
           f"{weights.pulls} weight versions pulled")
  return code


def _failed(env_runner) -> bool:
  try:
    env_runner.raise_if_failed()
  except RuntimeError:
    return True
  return False


def main(argv=None) -> int:
  import argparse  # noqa: PLC0415

  def address(text: str) -> str:
    try:
      return check_address(text)
    except ValueError as e:  # argparse prints this message and exits with status 2
      raise argparse.ArgumentTypeError(str(e)) from None

  def positive(text: str) -> float:
    value = float(text)
    if not value > 0:
      raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--learner", required=True, type=address,
                      help="the learner's fleet address (tcp://HOST:PORT, see fleet.json)")
  parser.add_argument("--name", default=None, help="name in the learner's log")
  parser.add_argument("--connect_timeout_s", type=positive, default=30.0,
                      help="give up when no learner answers within this many seconds "
                           "(a line says so every 5 s meanwhile)")
  args = parser.parse_args(argv)
  return run_sampler(args.learner, name=args.name, connect_timeout_s=args.connect_timeout_s,
                     print_fn=functools.partial(print, flush=True))


if __name__ == "__main__":
  sys.exit(main())
