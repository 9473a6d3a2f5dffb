"""launch/xm_launch.py against the real `xmanager` package: the jobs XManager's own
classes build and launch are the jobs `--print_jobs` lists."""

import json
import os
import subprocess
import sys

import pytest
from xmanager import xm, xm_local, xm_mock  # the [xmanager] extra, part of [dev]

from launch import xm_launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*flags, home, timeout=240):
  """`python -m launch.xm_launch` from the repository, with XManager's local
  experiment database under `home`."""
  return subprocess.run([sys.executable, "-m", "launch.xm_launch", *flags], cwd=REPO,
                        env={**os.environ, "HOME": str(home)}, capture_output=True, text=True,
                        timeout=timeout)


def _printed_jobs(*flags, home):
  proc = _cli(*flags, "--print_jobs", home=home)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return [json.loads(line) for line in proc.stdout.splitlines()]


def _as_flags(args: dict) -> list[str]:
  return [f"--{k}={v}" for k, v in args.items()]


def test_vertex_jobs_built_by_xmanager_are_the_printed_jobs(tmp_path):
  flags = ["--config=configs/arith.py", "--workdir=gs://bucket/k", "--sweep=learner.lr=1e-4,3e-4"]
  printed = _printed_jobs(*flags, home=tmp_path)
  assert len(printed) == 12  # the config's 6 points x 2 learning rates
  assert len({j["args"]["workdir"] for j in printed}) == 12
  first = printed[0]["args"]
  assert first["config"] == "configs/arith.py" and first["config.seed"] == "0"
  assert first["config.orchestrator.max_off_policy_steps"] == "0"
  assert first["config.learner.lr"] == "1e-4"

  # A Vertex job sees the bucket at /gcs/bucket (Cloud Storage FUSE).
  assert printed[0]["args"]["workdir"].startswith("/gcs/bucket/k/")
  jobs = xm_launch.job_specs("configs/arith.py", xm_launch.job_root("gs://bucket/k", "vertex"),
                             xm_launch.points("configs/arith.py", ["learner.lr=1e-4,3e-4"], True))
  tpu = xm_launch.Accelerator("TPU_V5E", 8)
  experiment = xm_mock.MockExperiment()
  with experiment:
    xm_launch.add_jobs(experiment, jobs, "vertex", tpu, "python:3.11-slim")
  launched = experiment.launched_jobs
  assert [j.args.to_list(str) for j in launched] == [_as_flags(p["args"]) for p in printed]
  for job in launched:
    assert isinstance(job.executor, xm_local.Vertex)
    assert job.executor.requirements.accelerator == xm.ResourceType.TPU_V5E
    assert job.executor.requirements.task_requirements[xm.ResourceType.TPU_V5E] == 8


@pytest.mark.parametrize("accelerator, extra", [("TPU_V5E=8", "tpu"), ("H100=8", "cuda12"),
                                                ("", "cpu")])
def test_the_vertex_container_installs_this_repository_with_the_accelerators_extra(
    accelerator, extra):
  """The Dockerfile XManager's packaging writes for the container: XManager's
  default steps want a requirements.txt, this project installs from its
  pyproject.toml with the accelerator's JAX extra."""
  from xmanager.cloud import build_image  # noqa: PLC0415

  spec = xm_launch.packageable("vertex", xm_launch.parse_accelerator(accelerator),
                               "python:3.11-slim").executable_spec
  assert isinstance(spec, xm.PythonContainer) and spec.path == REPO
  assert spec.entrypoint == xm.ModuleName("arl_jax.launch")
  with open(build_image._create_dockerfile(spec, xm.SequentialArgs(), {})) as f:
    dockerfile = f.read()
  assert dockerfile.lstrip().startswith("FROM python:3.11-slim")
  # The build context holds the repository under its folder name.
  [copy] = [line for line in dockerfile.splitlines() if line.startswith("COPY --chown=1000:root ")
            and "entrypoint" not in line]
  source = copy.split()[2]
  assert os.path.isfile(os.path.join(os.path.dirname(REPO), source, "pyproject.toml"))
  assert f"RUN python -m pip install --no-cache-dir '.[{extra}]'" in dockerfile
  assert "requirements.txt" not in dockerfile


def test_local_jobs_run_through_xmanager_with_the_printed_arguments(tmp_path):
  """XManager's local executor runs each job as a process of this Python: each
  point's run ends in its own workdir, after the number of updates it was given."""
  workdir = tmp_path / "sweep"
  flags = ["--config=configs/arith.py:tiny", f"--workdir={workdir}", "--no_config_sweep",
           "--sweep=num_steps=1,2", "--sweep=eval_every=0"]
  printed = _printed_jobs(*flags, home=tmp_path)
  proc = _cli(*flags, "--executor=local", home=tmp_path)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert os.path.exists(tmp_path / ".xmanager" / "experiments.sqlite3")  # XManager's own record
  for job in printed:
    args = job["args"]
    with open(os.path.join(args["workdir"], "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    updates = [r for r in records if r.get("phase") == "rl" and "loss" in r]
    assert updates[-1]["version"] == int(args["config.num_steps"])


def test_bad_jobs_stop_the_launch_before_xmanager_does_anything(tmp_path):
  proc = _cli("--config=configs/arith.py:tiny", f"--workdir={tmp_path}/k", "--no_config_sweep",
              "--sweep=orchestrator.max_off_policy_steps=4,-1", "--executor=local",
              home=tmp_path)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr
  [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
  assert "orchestrator.max_off_policy_steps=-1" in line and "max_off_policy_steps" in line
  assert not os.path.exists(tmp_path / ".xmanager")  # no experiment was created

  with pytest.raises(ValueError, match=r"TPU_V9=8.*XManager names: .*TPU_V5E"):
    xm_launch.check_requirements(xm_launch.Accelerator("TPU_V9", 8), "vertex")
  with pytest.raises(ValueError, match="local jobs use this machine's devices"):
    xm_launch.check_requirements(xm_launch.Accelerator("TPU_V5E", 8), "local")
  with pytest.raises(ValueError, match=r"gs://b/k: .*through the file system.*mounted for "
                     "--executor=vertex"):
    xm_launch.job_root("gs://b/k", "local")
  with pytest.raises(ValueError, match="s3://b/k: jobs write their workdir"):
    xm_launch.job_root("s3://b/k", "vertex")
  with pytest.raises(ValueError, match="expected NAME=COUNT"):
    xm_launch.parse_accelerator("TPU_V5E")
  # Configs are checked for the accelerator's device count: disaggregated
  # meshes want more than one device.
  jobs = xm_launch.job_specs("configs/arith.py:tiny", "gs://b/k", xm_launch.points(
      "configs/arith.py", ["mesh.placement=disaggregated"], False))
  xm_launch.check_jobs(jobs, xm_launch.Accelerator("TPU_V5E", 8), None, "vertex")
  with pytest.raises(ValueError, match="job 'mesh.placement=disaggregated': .* needs >= 2 dev"):
    xm_launch.check_jobs(jobs, None, None, "vertex")
