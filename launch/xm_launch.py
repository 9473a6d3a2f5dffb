r"""XManager launch script: one job per sweep point of a config.

  xmanager launch launch/xm_launch.py -- --config=configs/arith.py \
      --workdir=gs://BUCKET/arith_k --accelerator=TPU_V3=8
  python -m launch.xm_launch --config=configs/arith.py --workdir=/tmp/k --print_jobs

The points are the config file's `get_sweep()` (see `arl_jax/sweep.py`), times
any `--sweep=KEY=V1,V2` axes (as `launch.local_sweep`). Each job runs
`python -m arl_jax.launch --config=... --workdir=<workdir>/<point name>
--config.<key>=<value> ...` in a container built from this repository
(`xm.PythonContainer`) on the Vertex AI executor, with the requested
accelerators.

`--print_jobs` prints the job list as JSON lines without importing XManager,
which is also what the tests check (there is no cloud account here): the
XManager calls below follow its documented launch-script API but have not
been run against a real XManager installation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags

from launch import local_sweep

_CONFIG = flags.DEFINE_string("config", None, "configs/NAME.py[:ARG]")
_WORKDIR = flags.DEFINE_string("workdir", None,
                               "Root folder (e.g. gs://...); one subfolder per job.")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2 axes, times the config's sweep.")
_NO_CONFIG_SWEEP = flags.DEFINE_bool("no_config_sweep", False,
                                     "Ignore the config's get_sweep(); only --sweep axes.")
_ACCELERATOR = flags.DEFINE_string("accelerator", "",
                                   "Per job, NAME=COUNT as XManager names them (TPU_V3=8, A100=1).")
_TITLE = flags.DEFINE_string("title", "arl_jax", "Experiment title.")
_PRINT_JOBS = flags.DEFINE_bool("print_jobs", False, "Print the jobs; launch nothing.")


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """One job: its name and the `arl_jax.launch` flags it runs with."""

  name: str
  args: dict[str, str]


def job_specs(config: str, workdir: str, points: list[local_sweep.Point]) -> list[JobSpec]:
  jobs = []
  for point in points:
    args = {"config": config, "workdir": f"{workdir.rstrip('/')}/{point.name}"}
    args.update({f"config.{k}": v for k, v in point.overrides})
    jobs.append(JobSpec(name=point.name, args=args))
  if len({j.name for j in jobs}) != len(jobs):
    raise ValueError("two sweep points share a name; their workdirs would collide")
  return jobs


def points(config: str, sweep_flags: list[str], use_config_sweep: bool) -> list[local_sweep.Point]:
  axes = local_sweep.expand(local_sweep.parse_sweep(sweep_flags))
  return local_sweep.combine(local_sweep.config_points(config), axes) if use_config_sweep else axes


def _requirements(spec: str) -> dict[str, int]:
  if not spec:
    return {}
  name, sep, count = spec.partition("=")
  if not sep or not count.isdigit():
    raise app.UsageError(f"--accelerator={spec!r}: expected NAME=COUNT, e.g. TPU_V3=8")
  return {name: int(count)}


def launch(jobs: list[JobSpec], title: str, requirements: dict[str, int]) -> None:
  """Packages this repository once and adds one XManager job per spec."""
  from xmanager import xm, xm_local  # noqa: PLC0415 - optional, only to launch

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with xm_local.create_experiment(experiment_title=title) as experiment:
    [executable] = experiment.package([xm.python_container(
        executor_spec=xm_local.Vertex.Spec(), path=repo,
        entrypoint=xm.ModuleName("arl_jax.launch"))])
    for job in jobs:
      experiment.add(xm.Job(
          executable=executable,
          executor=xm_local.Vertex(requirements=xm.JobRequirements(**requirements)),
          args=job.args))


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    jobs = job_specs(_CONFIG.value, _WORKDIR.value,
                     points(_CONFIG.value, _SWEEP.value, not _NO_CONFIG_SWEEP.value))
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if _PRINT_JOBS.value:
    for job in jobs:
      print(json.dumps(dataclasses.asdict(job)))
    return
  launch(jobs, _TITLE.value, _requirements(_ACCELERATOR.value))


if __name__ == "__main__":
  flags.mark_flags_as_required(["config", "workdir"])
  sys.exit(app.run(main))
