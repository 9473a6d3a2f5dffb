"""The Colab quickstart notebook runs headless on CPU (tiny variant), so it can't rot."""

import os

import pytest

from arl_jax.testing import xla_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_executes(monkeypatch, tmp_path):
  monkeypatch.setenv("ARL_JAX_NOTEBOOK_TINY", "1")
  # One CPU device, as a Colab CPU runtime (and the tests' cheap compiles).
  monkeypatch.setenv("XLA_FLAGS", xla_env.xla_flags())
  nb = nbformat.read(os.path.join(REPO, "notebooks", "quickstart.ipynb"), as_version=4)
  nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}}).execute()
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "final version 4" in text and "held-out reward" in text
  assert "sync: final version 4" in text  # the baseline, a second real run
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the reward plot
