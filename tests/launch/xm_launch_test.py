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


def _cli(*flags, home, timeout=240, xmanager_cli=False):
  """`python -m launch.xm_launch` from the repository (or XManager's own
  `xmanager launch launch/xm_launch.py -- ...`), with XManager's local
  experiment database under `home`."""
  if xmanager_cli:
    # (XManager's console script, entry point xmanager.cli.cli:entrypoint)
    command = [sys.executable, "-c", "import sys; from xmanager.cli import cli; "
               "sys.argv[0] = 'xmanager'; cli.entrypoint()", "launch", "launch/xm_launch.py",
               "--", *flags]
  else:
    command = [sys.executable, "-m", "launch.xm_launch", *flags]
  return subprocess.run(command, cwd=REPO, env={**os.environ, "HOME": str(home)},
                        capture_output=True, text=True, timeout=timeout)


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
  gpus = xm_launch.parse_accelerator("a100=8")  # (XManager's names, any case)
  xm_launch.check_requirements(gpus, "vertex")  # its Vertex executor places 8 A100s
  experiment = xm_mock.MockExperiment()
  with experiment:
    xm_launch.add_jobs(experiment, jobs, "vertex", gpus, "python:3.11-slim")
  launched = experiment.launched_jobs
  assert [j.args.to_list(str) for j in launched] == [_as_flags(p["args"]) for p in printed]
  for job in launched:
    assert isinstance(job.executor, xm_local.Vertex)
    assert job.executor.requirements.accelerator == xm.ResourceType.A100
    assert job.executor.requirements.task_requirements[xm.ResourceType.A100] == 8


@pytest.mark.parametrize("accelerator, extra", [("TPU_V3=8", "tpu"), ("h100=8", "cuda12"),
                                                ("", "cpu")])
def test_the_vertex_container_installs_this_repository_with_the_accelerators_extra(
    accelerator, extra):
  """The Dockerfile XManager's packaging writes for the container: XManager's
  default steps want a requirements.txt, this project installs from its
  pyproject.toml with the accelerator's JAX extra."""
  from xmanager.cloud import build_image  # noqa: PLC0415

  with xm_launch.staged_source(REPO, xm_launch.source_files(REPO)) as staged:
    spec = xm_launch.packageable("vertex", xm_launch.parse_accelerator(accelerator),
                                 "python:3.11-slim", staged).executable_spec
    assert isinstance(spec, xm.PythonContainer) and spec.path == staged
    assert spec.entrypoint == xm.ModuleName("arl_jax.launch")
    with open(build_image._create_dockerfile(spec, xm.SequentialArgs(), {})) as f:
      dockerfile = f.read()
    # The build context holds the staged copy under the repository's folder name.
    prefix = "COPY --chown=1000:root "
    [copy] = [line for line in dockerfile.splitlines() if line.startswith(prefix + "[")]
    source, destination = json.loads(copy[len(prefix):])
    assert source == os.path.basename(REPO) + "/"
    assert os.path.isfile(os.path.join(os.path.dirname(staged), source, "pyproject.toml"))
  assert dockerfile.lstrip().startswith("FROM python:3.11-slim")
  assert "WORKDIR /arl_jax" in dockerfile and destination == "/arl_jax"
  assert f"RUN python -m pip install --no-cache-dir '.[{extra}]'" in dockerfile
  assert "netcat" in dockerfile  # (XManager's entrypoint waits for a legacy TPU with nc)
  assert "requirements.txt" not in dockerfile


def test_the_container_holds_what_git_would_commit_and_nothing_else(tmp_path):
  """XManager copies the folder it packages whole into the build context: it
  gets a copy without workdirs, checkpoints or .git (what XManager's own
  staging step, docker_lib.prepare_directory, then copies)."""
  from xmanager.cloud import docker_lib  # noqa: PLC0415

  repo = tmp_path / "arl_jax_checkout"
  for name, text in {"pyproject.toml": "[project]\n", "arl_jax/core.py": "x = 1\n",
                     ".gitignore": "/workdir*/\n*.jsonl\n", "configs/new.py": "# untracked\n",
                     "workdir_run/checkpoints/1/params": "weights", "metrics.jsonl": "{}\n",
                     "arl_jax/gone.py": "deleted after it was committed\n"}.items():
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).write_text(text)
  git = lambda *args: subprocess.run(["git", "-C", str(repo), *args], check=True,
                                     capture_output=True)
  git("init", "-q")
  git("add", "pyproject.toml", "arl_jax", ".gitignore")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
  (repo / "arl_jax/gone.py").unlink()
  files = xm_launch.source_files(str(repo))
  assert files == [".gitignore", "arl_jax/core.py", "configs/new.py", "pyproject.toml"]
  with xm_launch.staged_source(str(repo), files) as staged:
    assert os.path.basename(staged) == "arl_jax_checkout"
    context = tmp_path / "context"
    context.mkdir()
    entrypoint, dockerfile = tmp_path / "entrypoint.sh", tmp_path / "Dockerfile"
    entrypoint.write_text(""), dockerfile.write_text("FROM scratch\n")
    docker_lib.prepare_directory(str(context), staged, "arl_jax_checkout", str(entrypoint),
                                 str(dockerfile))
  copied = sorted(str(p.relative_to(context / "arl_jax_checkout"))
                  for p in (context / "arl_jax_checkout").rglob("*") if p.is_file())
  assert copied == files
  assert (context / "arl_jax_checkout/arl_jax/core.py").read_text() == "x = 1\n"
  assert not os.path.exists(staged)  # (the copy is gone after the build)

  with pytest.raises(ValueError, match="git cannot list them"):
    xm_launch.source_files(str(tmp_path / "context"))  # (not a checkout)


def test_local_jobs_run_through_xmanager_with_the_printed_arguments(tmp_path):
  """XManager's local executor runs each job as a process of this Python: each
  point's run ends in its own workdir, after the number of updates it was given."""
  workdir = tmp_path / "sweep"
  flags = ["--config=configs/arith.py:tiny", f"--workdir={workdir}", "--no_config_sweep",
           "--sweep=num_steps=1,2", "--sweep=eval_every=0", "--executor=local"]
  printed = _printed_jobs(*flags, home=tmp_path)
  proc = _cli(*flags, home=tmp_path, xmanager_cli=True)  # as the README says to launch
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert os.path.exists(tmp_path / ".xmanager" / "experiments.sqlite3")  # XManager's own record
  for job in printed:
    args = job["args"]
    with open(os.path.join(args["workdir"], "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
    updates = [r for r in records if r.get("phase") == "rl" and "loss" in r]
    assert updates[-1]["version"] == int(args["config.num_steps"])


@pytest.mark.parametrize("sweep, message", [
    ("orchestrator.max_off_policy_steps=4,-1",
     "job 'orchestrator.max_off_policy_steps=-1': config.orchestrator.max_off_policy_steps"),
    ("sampler.top_q=1", "job 'sampler.top_q=1': --config.sampler.top_q: the config has no key "
                        "'top_q' (Did you mean \"top_p\""),
])
def test_bad_jobs_stop_the_launch_before_xmanager_does_anything(tmp_path, sweep, message):
  proc = _cli("--config=configs/arith.py:tiny", f"--workdir={tmp_path}/k", "--no_config_sweep",
              f"--sweep={sweep}", "--executor=local", home=tmp_path)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [f"error: {message}"] or \
      proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), proc.stderr
  assert not os.path.exists(tmp_path / ".xmanager")  # no experiment was created


def test_bad_flags_are_named():
  with pytest.raises(ValueError, match="'TPU_V9' is not one of XManager's accelerators: .*A100"):
    xm_launch.parse_accelerator("TPU_V9=8")
  with pytest.raises(ValueError, match="'CPU' is not one of XManager's accelerators"):
    xm_launch.parse_accelerator("CPU=4")
  with pytest.raises(ValueError, match="expected NAME=COUNT"):
    xm_launch.parse_accelerator("A100")
  # XManager 0.8.5's Vertex executor places only TPU v2/v3 among TPUs: refused
  # here, not after the container is built.
  with pytest.raises(ValueError, match="TPU_V5E=8: XManager's Vertex executor cannot place"):
    xm_launch.check_requirements(xm_launch.parse_accelerator("TPU_V5E=8"), "vertex")
  with pytest.raises(ValueError, match="local jobs use this machine's devices"):
    xm_launch.check_requirements(xm_launch.parse_accelerator("A100=8"), "local")
  with pytest.raises(ValueError, match=r"gs://b/k: .*through the file system.*mounted for "
                     "--executor=vertex"):
    xm_launch.job_root("gs://b/k", "local")
  with pytest.raises(ValueError, match="/tmp/k: a Vertex job's own disk is gone"):
    xm_launch.job_root("/tmp/k", "vertex")
  assert xm_launch.job_root("/gcs/b/k", "vertex") == "/gcs/b/k"
  with pytest.raises(ValueError, match="give a config file inside"):
    xm_launch.job_config("/tmp/mine.py:tiny", "vertex")
  assert xm_launch.job_config(os.path.join(REPO, "configs/arith.py:tiny"),
                              "vertex") == "configs/arith.py:tiny"
  with pytest.raises(ValueError, match="seed: set by both the config's sweep and --sweep"):
    xm_launch.points("configs/arith.py", ["seed=5,6"], True)



def test_configs_are_checked_for_the_jobs_devices():
  """A Vertex job's config is built for the accelerator's device count:
  disaggregated meshes want more than one device."""
  jobs = xm_launch.job_specs("configs/arith.py:tiny", "/gcs/b/k", xm_launch.points(
      "configs/arith.py", ["mesh.placement=disaggregated"], False))
  xm_launch.check_jobs(jobs, xm_launch.parse_accelerator("H100=8"), None, "vertex")
  with pytest.raises(ValueError, match="job 'mesh.placement=disaggregated': .* needs >= 2 dev"):
    xm_launch.check_jobs(jobs, None, None, "vertex")
  # The kernels' platforms are the job's, unknown here: a GPU job's GPU kernel passes.
  jobs = xm_launch.job_specs("configs/arith.py:tiny", "/gcs/b/k", xm_launch.points(
      "configs/arith.py", ["sampler.kv_cache=paged", "sampler.paged_attention=pallas"], False))
  xm_launch.check_jobs(jobs, xm_launch.parse_accelerator("H100=8"), None, "vertex")


@pytest.mark.parametrize("restart", [True, False])
def test_vertex_jobs_are_submitted_to_restart_when_a_worker_restarts(monkeypatch, restart):
  """XManager's own Vertex client submits the custom job (its CustomJob, a
  recording stand-in: there is no cloud account here) with Vertex's
  `restart_job_on_worker_restart` as `--vertex_restart` says."""
  from google.cloud import aiplatform
  from xmanager.cloud import vertex
  from xmanager.xm_local import executables

  submitted = []

  class RecordingCustomJob:
    resource_name = "projects/p/locations/l/customJobs/1"

    def __init__(self, **kwargs):
      self.kwargs = kwargs

    def submit(self, **kwargs):
      submitted.append(kwargs)

    def _dashboard_uri(self):
      return "https://console.cloud.google.com/"

  monkeypatch.setattr(aiplatform, "CustomJob", RecordingCustomJob)
  monkeypatch.setattr(vertex.auth, "get_bucket", lambda: "bucket")
  monkeypatch.setattr(vertex.auth, "get_service_account", lambda: "xmanager@p.iam")
  client = vertex.Client.__new__(vertex.Client)  # (its __init__ logs into the project)
  client.project, client.location = "p", "us-central1"
  executable = executables.GoogleContainerRegistryImage(name="arl_jax",
                                                        image_path="gcr.io/p/a")
  job = xm.Job(executable=executable, executor=xm_launch.make_executor(
      "vertex", xm_launch.parse_accelerator("a100=8")), args={"config": "arith"})
  with xm_launch.vertex_scheduling(restart):
    client.launch("arl_jax", [job])
  assert submitted and submitted[0]["restart_job_on_worker_restart"] is restart
  assert aiplatform.CustomJob.submit is RecordingCustomJob.submit  # (put back after)
