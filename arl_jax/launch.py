r"""Entry point: `python -m arl_jax.launch --config=configs/arith.py --workdir=/tmp/run`.

Dotted overrides work on any key: `--config.learner.lr=1e-4`. The config is
locked, so an unknown key is an error before anything runs.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for metrics (and checkpoints).")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Imported here so that `--help` and flag errors do not initialise JAX.
  from arl_jax import run_lib

  workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
  run_lib.run(_CONFIG.value, workdir)


def cli() -> None:
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)


if __name__ == "__main__":
  sys.exit(cli())
