"""The Colab quickstart notebook runs headless on CPU (tiny variant), so it
can't rot: from the checkout, and from a regular (non-editable) install in a
fresh virtual environment, run from another directory; the variant it picks
on a TPU or GPU runtime plans for 8 devices."""

import os
import subprocess
import sys
import textwrap

import pytest

from arl_jax.testing import xla_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")


def _check(text: str, has_image: bool) -> None:
  assert "final version 4" in text and "held-out reward" in text, text[-3000:]
  assert "sync: final version 4" in text  # the baseline, a second real run
  assert has_image  # the reward plot


def test_quickstart_notebook_executes(monkeypatch, tmp_path):
  monkeypatch.setenv("ARL_JAX_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("TMPDIR", str(tmp_path))  # (the notebook's workdirs: removed with it)
  # One CPU device, as a Colab CPU runtime (and the tests' cheap compiles).
  monkeypatch.setenv("XLA_FLAGS", xla_env.xla_flags())
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert f"arl_jax from {os.path.join(REPO, 'arl_jax')};" in text
  _check(text, any("image/png" in o.get("data", {}) for o in outputs))


_EXECUTE = textwrap.dedent("""
    import sys, nbclient, nbformat
    nb = nbformat.read(sys.argv[1], as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": "."}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    print("".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream"))
    print("has image:", any("image/png" in o.get("data", {}) for o in outputs))
""")


def _site_dirs() -> list[str]:
  """The folders this interpreter imports installed packages from: a virtual
  environment's own (and its base's, with system site packages), a conda
  prefix's, or the system interpreter's."""
  return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]


def _venv_seeing_this_environment(venv) -> str:
  """A new virtual environment whose Python also imports what this one has
  installed; its interpreter.

  (`venv --system-site-packages` is no substitute: run from inside a virtual
  environment it gives the *base* interpreter's packages, not the running
  environment's, and the notebook kernel then lacks nbclient.) Each folder is
  added with `site.addsitedir`, after the new environment's own, so its
  `.pth` files work as they do here and the new environment's arl_jax wins.
  """
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  python = str(venv / "bin" / "python")
  own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                       check=True, capture_output=True, text=True).stdout.strip()
  lines = [f"import site; site.addsitedir({d!r})\n" for d in _site_dirs()]
  with open(os.path.join(own, "_arl_jax_test_parent_env.pth"), "w", encoding="utf-8") as f:
    f.writelines(lines)
  return python


def test_quickstart_notebook_executes_from_a_wheel_install(tmp_path):
  """`pip install <repo>` (a built wheel, not editable) into a new virtual
  environment, then the notebook from an empty directory: the configs come
  from the installed package. (The venv sees this environment's packages for
  the dependencies, so nothing is downloaded; arl_jax itself is its own.)"""
  venv = tmp_path / "venv"
  python = _venv_seeing_this_environment(venv)
  subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", REPO], check=True,
                 capture_output=True, timeout=600)
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  env = dict(os.environ, ARL_JAX_NOTEBOOK_TINY="1", XLA_FLAGS=xla_env.xla_flags(),
             TMPDIR=str(tmp_path),  # (the notebook's workdirs: removed with it)
             PATH=f"{venv / 'bin'}:{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
  env.pop("PYTHONPATH", None)
  result = subprocess.run([python, "-c", _EXECUTE, NOTEBOOK], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  installed = os.path.join(str(venv), "lib")
  assert f"arl_jax from {installed}" in result.stdout, result.stdout[-3000:]
  _check(result.stdout, "has image: True" in result.stdout)


def test_the_accelerator_variant_the_notebook_picks_plans_for_8_devices():
  """On a TPU or GPU runtime the notebook loads `arith:accelerator`:
  disaggregated meshes and a larger model, planned here for 8 devices."""
  nb = nbformat.read(NOTEBOOK, as_version=4)
  assert any('"accelerator" if platform in ("tpu", "gpu")' in c.source for c in nb.cells)
  result = subprocess.run(
      [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py:accelerator",
       "--dry_run", "--dry_run_devices=8"], cwd=REPO, env=xla_env.subprocess_env(1),
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "devices: 8 (disaggregated)" in result.stdout
  assert "learner mesh {'fsdp': 4, 'tp': 1}" in result.stdout
  assert "sampler mesh {'data': 4, 'tp': 1}" in result.stdout
  assert "parameters: 25,307,136" in result.stdout
