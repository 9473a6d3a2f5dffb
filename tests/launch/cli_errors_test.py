"""`python -m arl_jax.launch` on bad input: one `error: ...` line naming the
problem, no traceback, a non-zero exit status; real bugs keep their traceback."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BAD_INPUT = 2  # launch.EXIT_BAD_INPUT (importing launch here would define its flags)


def _launch(*args, devices=1):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, "-m", "arl_jax.launch", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)


def _assert_clean_error(proc, message):
  assert proc.returncode == BAD_INPUT, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), proc.stderr


def test_a_config_error_is_one_line_without_a_traceback():
  proc = _launch("--config=configs/arith.py:tiny", "--dry_run", "--config.sampler.prompt_len=4")
  _assert_clean_error(proc, "config.sampler.prompt_len: a prompt of env 'arith' has 5 tokens")


def test_a_training_run_with_a_missing_data_file_fails_cleanly_before_writing(tmp_path):
  workdir = tmp_path / "run"
  proc = _launch("--config=configs/arith.py:tiny", f"--workdir={workdir}",
                 f"--config.data.train_path={tmp_path / 'missing.jsonl'}")
  _assert_clean_error(proc, "config.data.train_path: ")
  assert "missing.jsonl" in proc.stderr
  assert not workdir.exists() or not os.listdir(workdir)


@pytest.mark.parametrize("relative, problem", [
    ("a_file", "exists and is not a folder"),
    ("a_file/run", "a_file is a file, so the folder cannot be created"),
    ("gs://bucket/run", "mount the bucket"),  # not a local folder named "gs:"
])
def test_a_workdir_that_cannot_be_a_folder_is_named(tmp_path, relative, problem):
  (tmp_path / "a_file").write_text("not a folder")
  workdir = relative if "://" in relative else tmp_path / relative
  proc = _launch("--config=configs/arith.py:tiny", f"--workdir={workdir}")
  _assert_clean_error(proc, f"--workdir={workdir}")
  assert problem in proc.stderr
  assert not os.path.exists(os.path.join(REPO, "gs:"))


@pytest.mark.parametrize("override, message", [
    ("--config.sampler.typo=1", "--config.sampler.typo: the config has no key 'typo'"),
    ("--config.nosection.x=1", "--config.nosection.x: the config has no key 'nosection'"),
    ("--config.sampler.top_p=abc", "flag --config.sampler.top_p=abc: could not convert"),
])
def test_an_override_the_config_cannot_take_is_one_line(override, message):
  _assert_clean_error(_launch("--config=configs/arith.py:tiny", "--dry_run", override), message)


@pytest.mark.parametrize("config, message", [
    ("configs/nope.py", "--config=configs/nope.py: no such file: configs/nope.py"),
    ("nope:tiny", "--config=nope:tiny: no such file: nope"),
    ("configs", "--config=configs: is a folder, not a config file"),
])
def test_a_config_file_that_does_not_exist_is_one_line_naming_the_built_in_configs(
    config, message):
  proc = _launch(f"--config={config}", "--workdir=/tmp/unused")
  _assert_clean_error(proc, message)
  assert "built-in configs, by name or as configs/NAME.py in a checkout: arith, " in proc.stderr


@pytest.mark.parametrize("config, message", [
    ("configs/arith.py:foo", "configs/arith.py:"),
    ("configs/math_tpu.py", "configs/math_tpu.py:"),
])
def test_a_config_file_s_own_error_is_one_line_naming_the_file_and_line(config, message):
  proc = _launch(f"--config={config}", "--dry_run")
  _assert_clean_error(proc, message)
  # The line the exception came from, and its message.
  file = config.partition(":")[0]
  lines = open(os.path.join(REPO, file), encoding="utf-8").read().splitlines()
  line = int(proc.stderr.split(f"error: {file}:")[1].split(":")[0])
  assert "raise ValueError" in lines[line - 1]
  assert ("unknown variant 'foo'" if ":foo" in config else "needs a Hugging Face model folder"
          ) in proc.stderr


@pytest.mark.parametrize("body, message", [
    ("def get_config(arg=None):\n  return {}['x']\n", "mine.py:2: KeyError: 'x'"),
    ("def get_config(arg=None):\n  open('/nonexistent/data.json')\n",
     "mine.py:2: FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/data."),
    ("def get_config(arg=None)\n  return 1\n", "mine.py:1: SyntaxError: expected ':'"),
])
def test_any_exception_of_a_user_s_config_file_is_one_line(tmp_path, body, message):
  (tmp_path / "mine.py").write_text(body)
  proc = _launch(f"--config={tmp_path / 'mine.py'}", "--dry_run")
  _assert_clean_error(proc, f"{tmp_path}/{message}")


def test_a_built_in_config_loads_by_name_from_any_directory(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.run([sys.executable, "-m", "arl_jax.launch", "--config=arith:tiny",
                         "--dry_run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "parameters:" in proc.stdout


def test_dry_run_devices_must_be_positive():
  proc = _launch("--config=configs/arith.py:tiny", "--dry_run", "--dry_run_devices=-4")
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert "--dry_run_devices=-4" in proc.stderr and "positive" in proc.stderr


def test_learner_devices_that_cannot_be_honoured_are_an_error_but_plan_for_more_devices():
  override = "--config.mesh.learner_devices=4"
  proc = _launch("--config=configs/arith.py:tiny", "--dry_run", override, devices=1)
  _assert_clean_error(proc, "config.mesh.learner_devices=4 asks for 4 learner device(s)")
  assert "only 1 device(s) are present" in proc.stderr
  # Planning for 8 devices validates the split against those 8, not the one present.
  proc = _launch("--config=configs/arith.py:tiny", "--dry_run", override, "--dry_run_devices=8",
                 devices=1)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "learner mesh {'fsdp': 4, 'tp': 1}" in proc.stdout


def test_a_missing_checkpoint_to_resume_from_is_named(tmp_path):
  proc = _launch("--config=configs/arith.py:tiny", f"--workdir={tmp_path / 'run'}",
                 f"--config.checkpoint.resume_from={tmp_path / 'nowhere'}")
  _assert_clean_error(proc, f"checkpoint.resume_from='{tmp_path / 'nowhere'}': no such folder")


def test_a_bug_keeps_its_traceback():
  # In a subprocess: importing arl_jax.launch here would define its flags in
  # the test process (and clash with launch/xm_launch.py's).
  script = ("from arl_jax import launch\n"
            "def bug(stop):\n"
            "  raise KeyError('a bug, not bad input')\n"
            "launch._launch = bug\n"
            "launch.main(['launch'])\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-3000:]
  assert "KeyError: 'a bug, not bad input'" in proc.stderr
