r"""A sampler process: `python -m arl_jax.distributed.sampler_worker --learner=ADDRESS`.

It joins a learner whose config has `fleet.remote = True` (the address is
printed by the learner and written to `WORKDIR/fleet.json`), receives the
run's resolved settings (a `run_spec.RunSpec`, decided and validated by the
learner: `spec_codec.py`) and the sampler mesh to build, and runs the same
`SamplerEngine` and `EnvRunner` a local run would, on this process's devices:

- requests come from the learner's dispatcher (`RemoteRequests`: the
  engine's request source, as `Dispatcher` is locally), finished groups go
  back, scored by the env workers here;
- weights come from the learner's `WeightServer` (`WeightClient`: the
  engine's weight source, as `WeightPublisher` is locally), pulled device to
  device;
- the learner's cancellations drop slots and environment calls here;
- a heartbeat reports the engine's and env workers' counters.

The connection itself, and the exit codes, are `learner_link.py`'s.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import threading
import time

from arl_jax.core import compile_cache, spec_codec
from arl_jax.distributed import learner_link, wire

EXIT_STOPPED, EXIT_FAILED = learner_link.EXIT_STOPPED, learner_link.EXIT_FAILED
EXIT_BAD_INPUT, EXIT_REJECTED = learner_link.EXIT_BAD_INPUT, learner_link.EXIT_REJECTED


class RemoteRequests:
  """Group requests answered by the learner: a `sources.RequestSource` for
  the engine (the learner keeps the groups' restart points)."""

  def __init__(self, link: learner_link.LearnerLink):
    self._link = link

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    return self._link.take(max_groups, live_version, timeout)

  def note_sampling(self, group_id: int, version: int) -> None:
    self._link.note_sampling(group_id, version)


class LocalSampling:
  """The engine and env workers of one sampler process (or of one process of a
  multi-controller run), working for the learner at the other end of `link`."""

  def __init__(self, spec, *, mesh, graphdef, weights, link: learner_link.LearnerLink,
               held=None, process_index: int = 0):
    """Args:
      spec: the run's `run_spec.RunSpec`.
      mesh: this process's sampler mesh.
      graphdef: the decoder's graph definition.
      weights: source of `(version, params)` (`latest()`).
      link: the connection to the learner (joined, not started).
      held: a multi-controller follower's `held_groups.HeldGroups`: finished
        groups stay there, the learner gets their metadata (None: whole
        groups go to the learner).
      process_index: this process's index (with `held`).
    """
    from arl_jax.envs import env_api, registry  # noqa: PLC0415 - JAX after flags
    from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: PLC0415
    from arl_jax.orchestrator import env_runner as env_runner_lib  # noqa: PLC0415
    from arl_jax.sampler import engine as engine_lib  # noqa: PLC0415

    tokenizer = tokenizer_lib.make_tokenizer(spec.tokenizer)
    env = registry.ENVS[spec.env_name].make_env_fn(spec.env, tokenizer)
    self.link = link

    def finished(group) -> None:
      if held is None:
        link.send_group(group)
      else:  # kept first: process 0 may plan it as soon as it hears
        link.send_group(group, held_by=process_index, copy=held.hold(group))

    self.env_runner = env_runner_lib.EnvRunner(
        env, on_group_fn=finished, max_new_tokens=spec.engine.max_new_tokens,
        num_workers=spec.num_env_workers, timeout_s=spec.env_timeout_s,
        vocab_size=spec.model.vocab_size)
    self.engine = engine_lib.SamplerEngine(
        cfg=spec.engine, settings=spec.sampling, graphdef=graphdef,
        model_cfg=spec.sampler_model, mesh=mesh, publisher=weights,
        dispatcher=RemoteRequests(link), on_segment_fn=self.env_runner.submit,
        stop_ids_fn=functools.partial(env_api.segment_stop_ids, tokenizer, env))
    self.env_runner.connect(self.engine.resume)

  def start(self) -> None:
    self.link.start(on_cancel=self._cancel, report_fn=self._report)
    self.engine.start()

  def _cancel(self, group_ids) -> None:
    self.engine.cancel(group_ids)
    self.env_runner.cancel(group_ids)

  def _report(self) -> dict:
    return {"stats": wire.stats_to_wire(self.engine.stats),
            "env": {"errors": dict(self.env_runner.errors),
                    "timeouts": dict(self.env_runner.timeouts), "turns": self.env_runner.turns}}

  @property
  def failed(self) -> bool:
    return self.engine.failed or self.env_runner.failed

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

  name = name or f"{socket.gethostname()}:{os.getpid()}"
  try:
    link = learner_link.LearnerLink(learner_address, name=name,
                                    num_devices=len(jax.local_devices()),
                                    connect_timeout_s=connect_timeout_s, print_fn=print_fn)
  except learner_link.LearnerUnreachable as e:
    print_fn(f"sampler {name}: error: {e}")
    return EXIT_FAILED
  except learner_link.LearnerGone as e:
    print_fn(f"sampler {name}: {e}")
    return EXIT_REJECTED
  try:
    sampling, weights, mesh = _build(link)
  except (OSError, ValueError) as e:  # e.g. the tokenizer file missing on this host
    print_fn(f"sampler {name}: error: {e}")
    link.close(say_bye=False)
    return EXIT_BAD_INPUT
  stop = threading.Event()
  previous = None
  if threading.current_thread() is threading.main_thread():
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
  print_fn(f"sampler {name}: joined {learner_address} as sampler "
           f"{link.welcome.sampler_id} (mesh {dict(mesh.shape)})")
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


def _build(link: learner_link.LearnerLink):
  """`(LocalSampling, WeightClient, sampler mesh)` as the learner's welcome
  says: its resolved settings, the sampler mesh shape, the weight server."""
  import jax  # noqa: PLC0415 - after the caller set XLA flags
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  from arl_jax.distributed import weight_transfer  # noqa: PLC0415
  from arl_jax.models import init_lib  # noqa: PLC0415
  from arl_jax.sharding import rules as rules_lib  # noqa: PLC0415

  welcome = link.welcome
  spec = spec_codec.from_json(welcome.spec)
  compile_cache.enable(spec.run.compilation_cache)  # (this machine's folder, when "auto")
  axes = [(str(a), int(n)) for a, n in welcome.sampler_mesh]
  size = int(np.prod([n for _, n in axes]))
  # The layout each version arrives in: the learner's `mesh.sampler` as
  # resolved there, on this process's first devices.
  mesh = Mesh(np.array(jax.local_devices()[:size]).reshape([n for _, n in axes]),
              tuple(a for a, _ in axes))
  graphdef, abstract = init_lib.abstract_model(spec.model)
  shardings = rules_lib.state_shardings(abstract, mesh, rules_lib.SAMPLER_RULES)
  dtype = jax.numpy.dtype(spec.sampler_model.param_dtype)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, dtype, sharding=s),
                          abstract, shardings)
  weights = weight_transfer.WeightClient(welcome.weights_address, abstract,
                                         timeout_s=link.timeout_s)
  return (LocalSampling(spec, mesh=mesh, graphdef=graphdef, weights=weights, link=link),
          weights, mesh)


def main(argv=None) -> int:
  import argparse  # noqa: PLC0415

  def address(text: str) -> str:
    try:
      return learner_link.check_address(text)
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
