r"""XManager launch script: one job per sweep point of a config.

  # Vertex AI: this repository built into a container, one job per point
  xmanager launch launch/xm_launch.py -- --config=configs/arith.py \
      --workdir=gs://BUCKET/arith_k --accelerator=A100=8
  # This machine: the same jobs as local processes, through XManager's local executor
  xmanager launch launch/xm_launch.py -- --config=configs/arith.py:tiny \
      --workdir=/tmp/k --executor=local
  # The job list, without XManager (python -m launch.xm_launch takes the same flags)
  python -m launch.xm_launch --config=configs/arith.py --workdir=gs://BUCKET/k --print_jobs

The points are the config file's `get_sweep()` (see `arl_jax/config/sweep.py`), times
any `--sweep=KEY=V1,V2` axes (as `launch.local_sweep`). Each job runs
`python -m arl_jax.launch --config=... --workdir=<workdir>/<point name>
--config.<key>=<value> ...`: `--print_jobs` prints exactly these arguments, one
JSON line a job, and the tests check that the jobs XManager launches carry
them (`tests/launch/xm_launch_test.py`, against the `xmanager` package).

Before anything is packaged, every point's config is built as
`arl_jax.launch` would build it, for the job's devices (the accelerator's
count on Vertex; this machine's, in a child process, for local jobs), and the
accelerator is placed by XManager's own Vertex machine mapping (XManager
0.8.5 places GPUs and TPU v2/v3 only), so bad input is one `error:` line
instead of failed jobs in the cloud (`--nocheck` skips the configs, for
configs whose files exist only where the jobs run).

A Vertex job's disk is gone when it ends: its workdir is a bucket,
`gs://BUCKET/...`, which the job sees at `/gcs/BUCKET/...` (runs write through
the file system); its config a file of this repository (the container's copy).

`--executor=vertex` packages the repository with `xm.python_container`: a
`--base_image` (default a slim Python), the repository copied in and
installed with the extra of the accelerator (`[tpu]` for TPUs, `[cuda12]`
for GPUs, `[cpu]` otherwise), `python -m arl_jax.launch` as the entrypoint.
XManager copies the folder it is given whole into the build context, so it is
given a copy holding the files git would commit (tracked, or untracked and not
ignored): not workdirs, checkpoints, virtual environments or `.git`.
`--executor=local` runs each job as a process on this machine, with this
Python (`xm.binary` and `xm_local.Local`), all at once; `launch.local_sweep`
bounds how many run together and tabulates their results.

Preemption. A job that gets SIGTERM (a maintenance event, a Spot VM taken
back, an eviction) stops at its next safe point, saves (every built-in
config's default variant saves on stop: `checkpoint.save_final`) and exits
75, not 0 (`arl_jax/launch.py`), so the platform does not record a job cut
short as succeeded; the same command on the same `gs://` workdir resumes it.
Vertex AI restarts a job's containers on its own for internal errors (its
`Scheduling.disable_retries`, off by default); XManager 0.8.5 submits custom
jobs with no scheduling options, so this launcher adds Vertex's
`restart_job_on_worker_restart` to its submit (`--vertex_restart`, on by
default): when a worker is restarted the whole job restarts, and every job of
a multi-controller run resumes from the same checkpoint. Neither was run on
Vertex here (no cloud account); the tests check the submit XManager makes
carries the option.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

from arl_jax.config import builtin
from launch import job_check, local_sweep

# XManager's experiment database logs each of alembic's plugins at INFO.
logging.getLogger("alembic").setLevel(logging.WARNING)
try:  # Imported here, not when launching: its own flags (--xm_*, and the
  # `xmanager launch` CLI's) must be defined before absl parses the command line.
  from xmanager import xm, xm_local
except ImportError as _error:  # --print_jobs works without it
  xm = xm_local = None
  _IMPORT_ERROR = _error

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
                                   "(A100=8, H100=8, TPU_V3=8).")
_BASE_IMAGE = flags.DEFINE_string("base_image", "python:3.11-slim",
                                  "The Vertex container's base image.")
_DEVICE_GIB = flags.DEFINE_float("device_gib", None,
                                 "Memory of one job device, to check configs that size the KV "
                                 "pool by sampler.kv_memory_fraction.")
_CHECK = flags.DEFINE_bool("check", True,
                           "Build every job's config here first (--nocheck: its files exist "
                           "only where the jobs run).")
_TITLE = flags.DEFINE_string("title", "arl_jax", "Experiment title.")
_VERTEX_RESTART = flags.DEFINE_bool(
    "vertex_restart", True, "Vertex jobs: restart the whole job when a worker restarts "
    "(Scheduling.restart_job_on_worker_restart); it resumes from its checkpoint.")
_PRINT_JOBS = flags.DEFINE_bool("print_jobs", False, "Print the jobs; launch nothing.")

@dataclasses.dataclass(frozen=True)
class JobSpec:
  """One job: its name and the `arl_jax.launch` flags it runs with."""

  name: str
  args: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """`--accelerator=NAME=COUNT`: XManager's accelerator name and the job's device count."""

  name: str
  count: int
  extra: str  # the package extra that installs JAX for it: "tpu" or "cuda12"


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
  FUSE), and its own disk is gone when it ends."""
  if executor == "vertex":
    if workdir.startswith("gs://"):
      return "/gcs/" + workdir[len("gs://"):]
    if not workdir.startswith("/gcs/"):
      raise ValueError(f"--workdir={workdir}: a Vertex job's own disk is gone when it ends; "
                       "give a bucket, gs://BUCKET/... (the job sees it at /gcs/BUCKET/...)")
    return workdir
  if "://" in workdir:
    raise ValueError(f"--workdir={workdir}: local jobs write their workdir through the file "
                     "system; give a folder (gs:// buckets are mounted for --executor=vertex)")
  return workdir


def job_config(config: str, executor: str) -> str:
  """`--config` as the jobs see it: a Vertex job runs in the container's copy
  of this repository, so its config must be a file inside it (given relative
  to the working directory here; passed relative to the repository), or a
  built-in config by name, which the container's install has too."""
  path, sep, arg = config.partition(":")
  if executor != "vertex" or (path in builtin.names() and not os.path.isfile(path)):
    return config
  relative = os.path.relpath(os.path.abspath(path), REPO)
  if relative.startswith(os.pardir) or not os.path.isfile(os.path.join(REPO, relative)):
    raise ValueError(f"--config={config}: a Vertex job runs this repository's copy in its "
                     f"container; give a config file inside {REPO}")
  return relative + sep + arg


def points(config: str, sweep_flags: list[str], use_config_sweep: bool) -> list[local_sweep.Point]:
  axes = local_sweep.expand(local_sweep.parse_sweep(sweep_flags))
  return local_sweep.combine(local_sweep.config_points(config), axes) if use_config_sweep else axes


def parse_accelerator(spec: str) -> Accelerator | None:
  """`NAME=COUNT` with NAME one of XManager's GPU or TPU types (any case)."""
  if not spec:
    return None
  name, sep, count = spec.partition("=")
  if not sep or not count.isdigit() or int(count) < 1:
    raise ValueError(f"--accelerator={spec!r}: expected NAME=COUNT, e.g. A100=8")
  accelerators = [*xm.GpuType, *xm.TpuType]
  try:
    resource = xm.ResourceType[name]
  except KeyError:
    resource = None
  if resource not in accelerators:
    raise ValueError(f"--accelerator={spec}: {name!r} is not one of XManager's accelerators: "
                     f"{', '.join(r.name for r in accelerators)}")
  return Accelerator(resource.name, int(count), "tpu" if resource in xm.TpuType else "cuda12")


def source_files(repo: str) -> list[str]:
  """The repository's files a container is built from, relative to `repo`:
  what git would commit (tracked, or untracked and not ignored), so runs'
  workdirs, checkpoints, virtual environments and `.git` stay out of the
  image. Raises ValueError where git cannot list them."""
  command = ["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
  try:
    listed = subprocess.run(command, capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError) as e:
    detail = getattr(e, "stderr", b"").decode(errors="replace").strip() or e
    raise ValueError(f"{repo}: the container is built from the files git lists, and git "
                     f"cannot list them ({detail})") from e
  # (A tracked file deleted from the working tree is still listed.)
  return sorted(name for name in set(listed.decode().split("\0"))
                if name and os.path.isfile(os.path.join(repo, name)))


@contextlib.contextmanager
def staged_source(repo: str, files: list[str]):
  """A temporary copy of `files` of `repo`, in a folder of the repository's
  name (the Dockerfile copies it by that name); removed on exit."""
  with tempfile.TemporaryDirectory(prefix="arl_jax_image_") as staging:
    source = os.path.join(staging, os.path.basename(repo))
    for name in files:
      os.makedirs(os.path.dirname(os.path.join(source, name)), exist_ok=True)
      shutil.copy2(os.path.join(repo, name), os.path.join(source, name))
    yield source


def packageable(executor: str, accelerator: Accelerator | None, base_image: str,
                source: str = REPO):
  """What XManager packages: this Python for local jobs, a container of
  `source` (a `staged_source` of the repository) for Vertex."""
  if executor == "local":
    return xm.binary(path=sys.executable, args=["-m", "arl_jax.launch"],
                     executor_spec=xm_local.Local.Spec())
  # XManager's default steps install a requirements.txt; this project installs
  # from pyproject.toml, with the accelerator's JAX extra. Its build context
  # holds the repository under its folder name and the entrypoint script,
  # which the template copies into the working directory; the script waits
  # for a legacy Cloud TPU with netcat, which slim images lack.
  extra = accelerator.extra if accelerator else "cpu"
  return xm.python_container(
      executor_spec=xm_local.Vertex.Spec(), path=source, base_image=base_image,
      entrypoint=xm.ModuleName("arl_jax.launch"),
      docker_instructions=[
          "ENV LANG=C.UTF-8 PYTHONUNBUFFERED=1",
          "RUN apt-get update && apt-get install -y --no-install-recommends netcat-openbsd "
          "&& rm -rf /var/lib/apt/lists/*",
          f"COPY --chown=1000:root {json.dumps([os.path.basename(source) + '/', '/arl_jax'])}",
          "WORKDIR /arl_jax",
          f"RUN python -m pip install --no-cache-dir '.[{extra}]'",
      ])


def make_executor(executor: str, accelerator: Accelerator | None):
  if executor == "local":
    return xm_local.Local()
  requirements = {accelerator.name: accelerator.count} if accelerator else {}
  return xm_local.Vertex(requirements=xm.JobRequirements(**requirements))


def add_jobs(experiment, jobs: list[JobSpec], executor: str, accelerator: Accelerator | None,
             base_image: str, source: str = REPO) -> None:
  """Packages once (a Vertex container of `source`) and adds one work unit
  per job to an XManager experiment."""
  [executable] = experiment.package([packageable(executor, accelerator, base_image, source)])
  for job in jobs:
    experiment.add(xm.Job(executable=executable, executor=make_executor(executor, accelerator),
                          args=job.args))


def check_jobs(jobs: list[JobSpec], accelerator: Accelerator | None,
               device_gib: float | None, executor: str) -> None:
  """Builds every job's config as `arl_jax.launch` would (`launch/job_check.py`)
  for the job's devices: the accelerator's count for a Vertex job (one CPU
  device without one), this machine's for a local job, in a child process
  (this one would otherwise hold the devices, and a GPU's preallocated memory,
  while XManager waits for the jobs). Raises ValueError naming the job."""
  args = [(job.name, job.args) for job in jobs]
  if executor == "local":
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
      problem = pool.submit(job_check.first_problem, args, None, device_gib).result()
  else:
    problem = job_check.first_problem(args, accelerator.count if accelerator else 1, device_gib)
  if problem:
    raise ValueError(problem)


def check_requirements(accelerator: Accelerator | None, executor: str) -> None:
  """Refuses what XManager would refuse only after the container is built:
  an accelerator its Vertex executor cannot place (its own machine-type
  mapping, `xmanager.cloud.vertex.get_machine_spec`)."""
  if accelerator is None:
    return
  if executor == "local":
    raise ValueError("--accelerator is for --executor=vertex; local jobs use this machine's "
                     "devices")
  from xmanager.cloud import vertex  # noqa: PLC0415 - the Google Cloud client, only here

  job = xm.Job(executable=None, executor=make_executor(executor, accelerator))
  try:
    vertex.get_machine_spec(job)
  except (KeyError, ValueError) as e:
    raise ValueError(f"--accelerator={accelerator.name}={accelerator.count}: XManager's Vertex "
                     f"executor cannot place it ({e!r})") from e


@contextlib.contextmanager
def vertex_scheduling(restart_job_on_worker_restart: bool):
  """Within: Vertex custom jobs are submitted with
  `restart_job_on_worker_restart` (XManager 0.8.5's Vertex client calls
  `CustomJob.submit` with no scheduling options of its own)."""
  from google.cloud import aiplatform  # noqa: PLC0415 - the Google Cloud client, only here

  submit = aiplatform.CustomJob.submit

  def submit_with_scheduling(job, *args, **kwargs):
    kwargs.setdefault("restart_job_on_worker_restart", restart_job_on_worker_restart)
    return submit(job, *args, **kwargs)

  aiplatform.CustomJob.submit = submit_with_scheduling
  try:
    yield
  finally:
    aiplatform.CustomJob.submit = submit


def launch(jobs: list[JobSpec], title: str, executor: str, accelerator: Accelerator | None,
           base_image: str, files: list[str] | None, vertex_restart: bool = True) -> None:
  """`files`: what a Vertex container holds of the repository (`source_files`)."""
  with contextlib.ExitStack() as stack:
    source = REPO if files is None else stack.enter_context(staged_source(REPO, files))
    if executor == "vertex":
      stack.enter_context(vertex_scheduling(vertex_restart))
    with xm_local.create_experiment(experiment_title=title) as experiment:
      add_jobs(experiment, jobs, executor, accelerator, base_image, source)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    jobs = job_specs(job_config(_CONFIG.value, _EXECUTOR.value),
                     job_root(_WORKDIR.value, _EXECUTOR.value),
                     points(_CONFIG.value, _SWEEP.value, not _NO_CONFIG_SWEEP.value))
    if _PRINT_JOBS.value:
      for job in jobs:
        print(json.dumps(dataclasses.asdict(job)))
      return
    if xm is None:
      raise ValueError(f"launching needs the xmanager package ({_IMPORT_ERROR}): pip install "
                       "'arl_jax[xmanager]' (--print_jobs works without it)")
    accelerator = parse_accelerator(_ACCELERATOR.value)
    check_requirements(accelerator, _EXECUTOR.value)
    if _CHECK.value:
      check_jobs(jobs, accelerator, _DEVICE_GIB.value, _EXECUTOR.value)
    files = source_files(REPO) if _EXECUTOR.value == "vertex" else None
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  launch(jobs, _TITLE.value, _EXECUTOR.value, accelerator, _BASE_IMAGE.value, files,
         _VERTEX_RESTART.value)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  sys.exit(app.run(main))
