r"""XManager launch script: one job per sweep point of a config.

  # Vertex AI: this repository built into a container, one job per point
  xmanager launch launch/xm_launch.py -- --config=configs/arith.py \
      --workdir=gs://BUCKET/arith_k --accelerator=TPU_V5E=8
  # This machine: the same jobs as local processes, through XManager's local executor
  python -m launch.xm_launch --config=configs/arith.py:tiny --workdir=/tmp/k --executor=local
  # The job list, without XManager
  python -m launch.xm_launch --config=configs/arith.py --workdir=/tmp/k --print_jobs

The points are the config file's `get_sweep()` (see `arl_jax/sweep.py`), times
any `--sweep=KEY=V1,V2` axes (as `launch.local_sweep`). Each job runs
`python -m arl_jax.launch --config=... --workdir=<workdir>/<point name>
--config.<key>=<value> ...`: `--print_jobs` prints exactly these arguments, one
JSON line a job, and the tests check that the jobs XManager launches carry
them (`tests/launch/xm_launch_test.py`, against the `xmanager` package).

Every point's config is built first (`config_lib.build`, for the accelerator's
device count), so a bad key or value stops the launch with one line before
anything is packaged, instead of failing jobs in the cloud (`--nocheck` skips
this for configs whose files exist only where the jobs run).

A `gs://BUCKET/...` workdir is where a Vertex job sees the bucket,
`/gcs/BUCKET/...` (runs write through the file system).

`--executor=vertex` packages the repository with `xm.python_container`: a
`--base_image` (default a slim Python), the repository copied in and
installed with the extra of the accelerator (`[tpu]` for TPU_*, `[cuda12]`
for GPUs, `[cpu]` otherwise), `python -m arl_jax.launch` as the entrypoint.
`--executor=local` runs each job as a process on this machine, with this
Python (`xm.binary` and `xm_local.Local`), all at once; `launch.local_sweep`
bounds how many run together and tabulates their results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags

from launch import local_sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CONFIG = flags.DEFINE_string("config", None, "configs/NAME.py[:ARG]")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Root folder (e.g. gs://...); one subfolder per job.")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2 axes, times the config's sweep.")
_NO_CONFIG_SWEEP = flags.DEFINE_bool("no_config_sweep", False,
                                     "Ignore the config's get_sweep(); only --sweep axes.")
_EXECUTOR = flags.DEFINE_enum("executor", "vertex", ["vertex", "local"],
                              "vertex: a container on Vertex AI; local: processes here.")
_ACCELERATOR = flags.DEFINE_string("accelerator", "",
                                   "Per Vertex job, NAME=COUNT as XManager names them "
                                   "(TPU_V5E=8, A100=1).")
_BASE_IMAGE = flags.DEFINE_string("base_image", "python:3.11-slim",
                                  "The Vertex container's base image.")
_DEVICE_GIB = flags.DEFINE_float("device_gib", None,
                                 "Memory of one job device, to check configs that size the KV "
                                 "pool by sampler.kv_memory_fraction.")
_CHECK = flags.DEFINE_bool("check", True,
                           "Build every job's config here first (--nocheck: its files exist "
                           "only where the jobs run).")
_TITLE = flags.DEFINE_string("title", "arl_jax", "Experiment title.")
_PRINT_JOBS = flags.DEFINE_bool("print_jobs", False, "Print the jobs; launch nothing.")

# XManager's resource names for GPUs (the rest of its accelerators are TPU_*).
_GPUS = ("A100", "A100_80GIB", "B200", "B300", "GB200", "GB300", "H100", "H100_MEGA", "H200",
         "L4_24TH", "LOCAL_GPU", "P100", "P4", "T4", "V100")


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """One job: its name and the `arl_jax.launch` flags it runs with."""

  name: str
  args: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """`--accelerator=NAME=COUNT`: XManager's resource name and the job's device count."""

  name: str
  count: int

  @property
  def extra(self) -> str:
    """The package extra that installs JAX for this accelerator."""
    if self.name.startswith("TPU_"):
      return "tpu"
    return "cuda12" if self.name in _GPUS else "cpu"


def job_specs(config: str, workdir: str, points: list[local_sweep.Point]) -> list[JobSpec]:
  jobs = []
  for point in points:
    args = {"config": config, "workdir": f"{workdir.rstrip('/')}/{point.name}"}
    args.update({f"config.{k}": v for k, v in point.overrides})
    jobs.append(JobSpec(name=point.name, args=args))
  if len({j.name for j in jobs}) != len(jobs):
    raise ValueError("two sweep points share a name; their workdirs would collide")
  return jobs


def job_root(workdir: str, executor: str) -> str:
  """The jobs' root folder as they see it. arl_jax writes its workdir through
  the file system; a Vertex AI job sees bucket gs://B at /gcs/B (Cloud Storage
  FUSE)."""
  if workdir.startswith("gs://") and executor == "vertex":
    return "/gcs/" + workdir[len("gs://"):]
  if "://" in workdir:
    raise ValueError(f"--workdir={workdir}: jobs write their workdir through the file system; "
                     "give a folder" + (" (gs:// buckets are mounted for --executor=vertex)"
                                        if executor == "local" else ""))
  return workdir


def points(config: str, sweep_flags: list[str], use_config_sweep: bool) -> list[local_sweep.Point]:
  axes = local_sweep.expand(local_sweep.parse_sweep(sweep_flags))
  return local_sweep.combine(local_sweep.config_points(config), axes) if use_config_sweep else axes


def parse_accelerator(spec: str) -> Accelerator | None:
  if not spec:
    return None
  name, sep, count = spec.partition("=")
  if not sep or not count.isdigit() or int(count) < 1:
    raise ValueError(f"--accelerator={spec!r}: expected NAME=COUNT, e.g. TPU_V5E=8")
  return Accelerator(name, int(count))


def packageable(executor: str, accelerator: Accelerator | None, base_image: str):
  """What XManager packages: this Python for local jobs, a container for Vertex."""
  from xmanager import xm, xm_local  # noqa: PLC0415 - optional, only to launch

  if executor == "local":
    return xm.binary(path=sys.executable, args=["-m", "arl_jax.launch"],
                     executor_spec=xm_local.Local.Spec())
  # XManager's default steps install a requirements.txt; this project installs
  # from pyproject.toml, with the accelerator's JAX extra. Its build context
  # holds the repository under its folder name and the entrypoint script,
  # which the template copies into the working directory.
  extra = accelerator.extra if accelerator else "cpu"
  return xm.python_container(
      executor_spec=xm_local.Vertex.Spec(), path=REPO, base_image=base_image,
      entrypoint=xm.ModuleName("arl_jax.launch"),
      docker_instructions=[
          "ENV LANG=C.UTF-8 PYTHONUNBUFFERED=1",
          f"COPY --chown=1000:root {os.path.basename(REPO)}/ /arl_jax",
          "WORKDIR /arl_jax",
          f"RUN python -m pip install --no-cache-dir '.[{extra}]'",
      ])


def make_executor(executor: str, accelerator: Accelerator | None):
  from xmanager import xm, xm_local  # noqa: PLC0415

  if executor == "local":
    return xm_local.Local()
  requirements = {accelerator.name: accelerator.count} if accelerator else {}
  return xm_local.Vertex(requirements=xm.JobRequirements(**requirements))


def add_jobs(experiment, jobs: list[JobSpec], executor: str, accelerator: Accelerator | None,
             base_image: str) -> None:
  """Packages once and adds one work unit per job to an XManager experiment."""
  from xmanager import xm  # noqa: PLC0415

  [executable] = experiment.package([packageable(executor, accelerator, base_image)])
  for job in jobs:
    experiment.add(xm.Job(executable=executable, executor=make_executor(executor, accelerator),
                          args=job.args))


def check_jobs(jobs: list[JobSpec], accelerator: Accelerator | None,
               device_gib: float | None, executor: str) -> None:
  """Builds every job's config as `arl_jax.launch` would (its flag parsing, then
  `config_lib.build` for the job's devices); raises ValueError naming the job."""
  from absl import flags as absl_flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  from arl_jax import config_lib  # noqa: PLC0415

  # Local jobs see this machine's devices; a Vertex job the accelerator's
  # (or one CPU device without one).
  devices = None if executor == "local" else list(range(accelerator.count if accelerator else 1))
  memory = None if device_gib is None else int(device_gib * 2**30)
  for job in jobs:
    argv = ["arl_jax.launch"] + [f"--{k}={v}" for k, v in job.args.items()
                                 if k == "config" or k.startswith("config.")]
    values = absl_flags.FlagValues()
    # (ml_collections finds the `--config.*` overrides in the argv it is given here)
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    try:
      values(argv)
      config_lib.build(values.config, devices, device_memory=memory)
    except (absl_flags.Error, AttributeError, KeyError, config_lib.ConfigError) as e:
      # (a config file's own error arrives with its traceback as text: keep its last line)
      raise ValueError(f"job {job.name!r}: {str(e).strip().splitlines()[-1]}") from e


def check_requirements(accelerator: Accelerator | None, executor: str) -> None:
  if accelerator is None:
    return
  if executor == "local":
    raise ValueError("--accelerator is for --executor=vertex; local jobs use this machine's "
                     "devices")
  from xmanager import xm  # noqa: PLC0415

  try:
    xm.JobRequirements(**{accelerator.name: accelerator.count})
  except (KeyError, ValueError) as e:
    raise ValueError(f"--accelerator={accelerator.name}={accelerator.count}: {e}; XManager "
                     f"names: {', '.join(t.name for t in xm.ResourceType)}") from e


def _require_xmanager() -> None:
  try:
    import xmanager  # noqa: F401, PLC0415
  except ImportError as e:
    raise ValueError(f"launching needs the xmanager package ({e}): pip install "
                     "'arl_jax[xmanager]' (--print_jobs works without it)") from e


def launch(jobs: list[JobSpec], title: str, executor: str, accelerator: Accelerator | None,
           base_image: str) -> None:
  from xmanager import xm_local  # noqa: PLC0415

  with xm_local.create_experiment(experiment_title=title) as experiment:
    add_jobs(experiment, jobs, executor, accelerator, base_image)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    jobs = job_specs(_CONFIG.value, job_root(_WORKDIR.value, _EXECUTOR.value),
                     points(_CONFIG.value, _SWEEP.value, not _NO_CONFIG_SWEEP.value))
    if _PRINT_JOBS.value:
      for job in jobs:
        print(json.dumps(dataclasses.asdict(job)))
      return
    _require_xmanager()
    accelerator = parse_accelerator(_ACCELERATOR.value)
    check_requirements(accelerator, _EXECUTOR.value)
    if _CHECK.value:
      check_jobs(jobs, accelerator, _DEVICE_GIB.value, _EXECUTOR.value)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  launch(jobs, _TITLE.value, _EXECUTOR.value, accelerator, _BASE_IMAGE.value)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  sys.exit(app.run(main))
