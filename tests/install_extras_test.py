"""The accelerator extras: `[tpu]` and `[cuda12]` pin JAX's own accelerator
extra at the JAX version the project pins, and the packages that extra names
for that version resolve in the package index (`pip install --dry-run
--no-deps`: found, nothing installed)."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # (Python >= 3.11)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def _jax_pin() -> str:
  (pin,) = [d.split("==")[1] for d in _project()["dependencies"] if d.startswith("jax==")]
  return pin


def test_the_extras_pin_jax_s_own_accelerator_extra_at_the_pinned_version():
  pin = _jax_pin()
  extras = _project()["optional-dependencies"]
  assert extras["tpu"] == [f"jax[tpu]=={pin}"]
  assert extras["cuda12"] == [f"jax[cuda12]=={pin}"]
  assert extras["cpu"] == []  # the CPU jaxlib is a plain dependency
  assert importlib.metadata.version("jax") == pin


@pytest.mark.parametrize("extra", ["tpu", "cuda12"])
def test_the_accelerator_packages_of_an_extra_resolve(extra):
  """What `jax[extra]==PIN` adds beyond jaxlib (libtpu; the CUDA plugin and
  its PJRT), exactly as JAX's own metadata names them, found in the index."""
  pin = _jax_pin()
  wanted = []
  for requirement in importlib.metadata.distribution("jax").requires:
    name, _, marker = requirement.partition(";")
    if re.search(rf"extra == \"{extra}\"", marker) and not name.startswith(("jaxlib", "requests")):
      wanted.append(re.sub(r"\[.*\]", "", name.strip()))
  assert wanted, f"jax {pin} names no packages for extra {extra!r}"
  result = subprocess.run(
      [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
       "--quiet", "--report", "-", *wanted], capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  found = {item["metadata"]["name"].lower().replace("_", "-")
           for item in __import__("json").loads(result.stdout)["install"]}
  names = {re.split(r"[<>=!~ ]", w)[0].lower().replace("_", "-") for w in wanted}
  assert names <= found, (names, found)
