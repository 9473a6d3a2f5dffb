r"""Entry point: `python -m arl_jax.launch --config=configs/arith.py --workdir=/tmp/run`.

Dotted overrides work on any key: `--config.learner.lr=1e-4`. The config is
locked, so an unknown key is an error before anything runs.

`--dry_run` validates the config and prints the resolved config, the mesh of
each role, the parameter count and the memory per device (`arl_jax/training/dry_run.py`),
then exits without compiling; `--dry_run_devices=N` plans for N devices instead
of the ones present (e.g. a v5e-8 config on a laptop), `--dry_run_device_gib`
for devices of that much memory (what `sampler.kv_memory_fraction` sizes the
paged KV pool from), `--dry_run_device=tpu-v5e` (or h100, ...) for chips of
that kind; with the memory known it also prints the largest batch and
completion budget that fit (`arl_jax/training/fit.py`).

`--replay=RUN` runs a recorded run (`--config.replay.record=True`) again
from its schedule (`RUN/schedule.jsonl`, `arl_jax/core/schedule.py`): same
config, a new `--workdir`; it reaches the recorded params bit for bit, or
stops at the first update that differs, saying what differed (exit status
1). `python -m arl_jax.diff RUN_A RUN_B` points at where two runs part.

Bad input (a config error, a missing file, an unusable `--workdir`, a
workdir another run holds) is printed as one `error: ...` line on stderr,
without a traceback, and the process exits with status 2; anything else is a
bug and keeps its traceback. Once the run has started, SIGINT (Ctrl-C) and
SIGTERM ask it to stop cleanly (`arl_jax/training/stop.py`).

Exit status: 0 when the run is complete (every update of `num_steps` ran, or
the data ran out); `EXIT_STOPPED` (75, sysexits' EX_TEMPFAIL: "try again
later") when a signal stopped it first, after a last line that says whether
and from which version the same command resumes; 2 for bad input; 1 for a
bug. A preempted job (a TPU VM's or a Kubernetes/Vertex eviction's SIGTERM)
thus reads as not finished, and a scheduler that restarts failed jobs
(Vertex AI with `launch/xm_launch.py`'s `--vertex_restart`, Kubernetes
`restartPolicy: OnFailure`, SLURM `--requeue`) reruns it, which resumes it.

Multi-host: `--distributed` (implied by `--coordinator_address`) calls
`jax.distributed.initialize()` first, with `--coordinator_address`,
`--num_processes` and `--process_id` when given (on TPU VMs and SLURM JAX
finds them itself).
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

# When this process began its work: the first progress line's startup
# phases count the imports (JAX's among them) from here.
_STARTED_AT = time.monotonic()

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics (and checkpoints).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False,
                             "Validate and plan (meshes, memory per device); do not train.")
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", None, "Plan for this many devices (default: the devices present).",
    lower_bound=1)
_DRY_RUN_DEVICE_GIB = flags.DEFINE_float(
    "dry_run_device_gib", None, "Plan for devices of this much memory (default: what the "
    "devices present report); sizes sampler.kv_memory_fraction's pool.", lower_bound=0.001)
_DRY_RUN_DEVICE = flags.DEFINE_string(
    "dry_run_device", None, "Plan for chips of this kind (tpu-v5e, h100, ...: "
    "training/fit.py's DEVICE_KINDS): whether the config fits, and the largest batch and "
    "completion budget that would.")
_REPLAY = flags.DEFINE_string(
    "replay", None, "A recorded run's workdir (replay.record=True): run it again following "
    "its schedule (sets replay.from_run).")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False,
                                 "Call jax.distributed.initialize() before anything else.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")


def _initialize_distributed() -> None:
  import jax  # noqa: PLC0415 - only after flags are parsed

  kwargs = {k: v for k, v in (("coordinator_address", _COORDINATOR.value),
                              ("num_processes", _NUM_PROCESSES.value),
                              ("process_id", _PROCESS_ID.value)) if v is not None}
  # Collectives between CPU processes (tests, CPU clusters); TPUs and GPUs
  # use their own interconnect and ignore this.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(**kwargs)


# Exit status for bad input: 2, the usual status of a usage error (flag
# values too: `_parse_flags`).
EXIT_BAD_INPUT = 2
# Exit status of a run a signal stopped before `num_steps`: sysexits.h's
# EX_TEMPFAIL (a temporary failure: the same command, rerun, goes on). Not 0,
# or a scheduler records a preempted job as succeeded and never reruns it.
EXIT_STOPPED = 75


class _BadInput(Exception):
  """A problem with the command line that launch itself finds."""


def _check_workdir(workdir: str) -> None:
  """Raises _BadInput unless `workdir` is, or can be made, a writable folder."""
  if os.path.lexists(workdir) and not os.path.isdir(workdir):
    raise _BadInput(f"--workdir={workdir} exists and is not a folder")
  existing = workdir  # the folder itself, or its nearest existing ancestor
  while not os.path.lexists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise _BadInput(f"--workdir={workdir}: {existing} is a file, so the folder cannot be "
                    "created")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise _BadInput(f"--workdir={workdir}: no permission to write in {existing}")


def dry_run(config, num_devices: int | None, print_fn=print,
            device_gib: float | None = None, device_kind: str | None = None) -> None:
  """Prints the resolved config and the run's plan; raises ConfigError on bad config.

  With `num_devices`, the meshes are validated and planned for that many
  devices instead of the ones present; with `device_gib` or `device_kind`
  (`fit.DEVICE_KINDS`), for devices of that much memory. Where the memory is
  known, the plan is followed by the largest batch and completion budget
  that fit (`training/fit.py`).
  """
  import jax  # noqa: PLC0415

  from arl_jax.config import run_spec  # noqa: PLC0415
  from arl_jax.sharding import mesh_lib  # noqa: PLC0415
  from arl_jax.training import dry_run, fit  # noqa: PLC0415

  if device_gib is not None and device_kind is not None:
    raise run_spec.ConfigError("--dry_run_device and --dry_run_device_gib both give the "
                               "device's memory: pass one")
  memory = None if device_gib is None else int(device_gib * 2**30)
  if device_kind is not None:
    memory = fit.device_memory(device_kind)
  if memory is None and num_devices is None:
    memory = mesh_lib.reported_memory(jax.devices())  # (None on CPU)
  spec = run_spec.build(config, None if num_devices is None else list(range(num_devices)),
                          device_memory=memory)
  print_fn("resolved config:\n" + str(config))
  print_fn(f"process {jax.process_index()} of {jax.process_count()} (jax.distributed "
           f"{'initialized' if jax.distributed.is_initialized() else 'not initialized'})")
  count = num_devices or len(jax.devices())
  # (planned for the devices here, a CPU backend's are the process's own memory)
  cpu = device_kind is None and device_gib is None and jax.default_backend() == "cpu"
  print_fn(dry_run.format_plan(dry_run.plan(spec, count, cpu=cpu), memory))
  if memory:
    print_fn(fit.format_fit(fit.fit(spec, count, memory), spec))


def _launch(stop):
  """Trains (or plans, with --dry_run); the run's `RunResult`, or None."""
  if not _DRY_RUN.value:
    if _WORKDIR.value is None:
      raise _BadInput("--workdir is required (except with --dry_run)")
    if "://" in _WORKDIR.value:  # (abspath would make it a local folder named "gs:")
      raise _BadInput(f"--workdir={_WORKDIR.value}: a run writes its workdir through the file "
                      "system; mount the bucket and give its folder (a Vertex AI job sees "
                      "gs://B at /gcs/B)")
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    _check_workdir(workdir)  # before JAX starts
  if _DISTRIBUTED.value or _COORDINATOR.value:
    _initialize_distributed()
  if _DRY_RUN.value:
    dry_run(_CONFIG.value, _DRY_RUN_DEVICES.value, device_gib=_DRY_RUN_DEVICE_GIB.value,
            device_kind=_DRY_RUN_DEVICE.value)
    return None
  # Imported here so that `--help` and flag errors do not initialise JAX.
  from arl_jax.training import replay, run_lib  # noqa: PLC0415

  config = _CONFIG.value
  if _REPLAY.value:
    config.replay.from_run = os.path.abspath(os.path.expanduser(_REPLAY.value))
  if config.replay.from_run:
    return replay.run(config, workdir, stop=stop, started_at=_STARTED_AT)
  return run_lib.run(config, workdir, stop=stop, started_at=_STARTED_AT)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # orbax logs every checkpoint step at INFO; the progress line says what matters.
    logging.set_verbosity(logging.WARNING)
  from arl_jax.training import stop as stop_lib  # noqa: PLC0415 - (no JAX)

  # Signals ask for a clean stop from here on (training/stop.py): one that
  # comes while the run is still being built stops it at its first safe point.
  with stop_lib.StopRequest() as stop:
    _main(stop)


def _main(stop) -> None:
  # (Importing these initialises no JAX backend: distributed init still comes first.)
  from arl_jax.config import run_spec  # noqa: PLC0415
  from arl_jax.core import schedule  # noqa: PLC0415
  from arl_jax.learner import checkpointing  # noqa: PLC0415
  from arl_jax.training import start, workdir_lock  # noqa: PLC0415

  # What the user can fix: a config key, a missing data, model or checkpoint
  # file, a checkpoint of another model or base, the workdir. Their messages name the
  # problem, so a traceback would only bury it; every other exception is a bug
  # and keeps its traceback.
  bad_input = (_BadInput, run_spec.ConfigError, checkpointing.CheckpointFormatError,
               checkpointing.DamagedCheckpoint, FileNotFoundError, workdir_lock.WorkdirInUse,
               start.AnotherBase, schedule.ScheduleError)
  try:
    result = _launch(stop)
  except bad_input as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)
  except schedule.ReplayDiverged as e:  # (the finding of a replay, not a bug)
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  if result is not None and not result.complete:
    sys.exit(EXIT_STOPPED)  # (its last line said why and how it resumes)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with every problem of the command line reported as
  bad input (one `error:` line, status 2, no traceback): a `--config` file
  that does not exist (the built-in configs named), an exception of the
  config file's own (`configs/arith.py:152: ValueError: ...`), a flag value
  of the wrong type (`--config.sampler.top_p=abc`) or an override of a key
  the config lacks (`--config.sampler.typo=1`, a bare AttributeError from
  ml_collections). `--config=NAME[:ARG]` loads a built-in config by name."""
  from arl_jax.config import cli_argument  # noqa: PLC0415 - (no JAX)

  try:
    argv = cli_argument.resolve(argv)
    rest = flags.FLAGS(argv)
    # A config file whose get_config raised an OSError is a placeholder that
    # raises on first access (ml_collections): access it here.
    if flags.FLAGS["config"].value is not None:
      _ = flags.FLAGS["config"].value.lock
    return rest
  except cli_argument.MissingConfigFile as e:
    _exit_bad_input(str(e))
  except Exception as e:  # noqa: BLE001 - sorted below; anything else re-raised
    message = cli_argument.load_error(e, argv)
    if message is not None:
      _exit_bad_input(message)
    if isinstance(e, flags.IllegalFlagValueError):  # e.g. --config.sampler.top_p=abc
      _exit_bad_input(str(e))
    if isinstance(e, (AttributeError, KeyError)):
      from arl_jax.config import run_spec  # noqa: PLC0415 - only on this error

      _exit_bad_input(run_spec.unknown_key_message(argv, e))
    raise


def _exit_bad_input(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_BAD_INPUT)


def cli() -> None:
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  sys.exit(cli())
