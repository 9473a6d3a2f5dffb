"""Checkpoints written before issue 53 (main at 46acdb4: the module paths before
the move, the untyped open-work record of checkpoint format 3) resume: the
saved open work goes on and the run reaches its end. The workdirs were made
by `tests/data/main_46acdb4/make.py`."""

import json
import os
import shutil

import pytest

from arl_jax.testing import tiny
from arl_jax.training import run_lib

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "main_46acdb4")


@pytest.mark.parametrize("name", ["arith", "tool_agent"])
def test_a_checkpoint_from_before_the_move_resumes_with_its_open_work(tmp_path, name):
  workdir = tmp_path / name
  shutil.copytree(os.path.join(DATA, name), workdir)
  saved = json.load(open(workdir / "checkpoints" / "2" / "run" / "metadata"))
  assert saved["format_version"] == 3 and "version" not in saved["work"]  # (the old layout)
  open_groups = {g["group_id"] for g in saved["work"]["groups"]}
  assert open_groups
  config = tiny.load_config(name, "tiny")
  config.num_steps = 4
  config.eval_every = 0
  config.checkpoint.update(every_steps=2, save_final=True)
  lines = []
  result = run_lib.run(config, str(workdir), print_fn=lines.append)
  assert result.final_version == 4
  resumed = [line for line in lines if "resumed from" in line]
  assert resumed and "version 2" in resumed[0], lines[:5]
  assert any(f"{len(open_groups)} open groups go on" in line for line in lines)
  # Every group open at the save was trained or retired after the resume, none lost.
  events = [json.loads(line) for line in open(workdir / "groups.jsonl")]
  after = {e["group_id"] for e in events[[e["event"] for e in events].index("resumed"):]
           if "group_id" in e}
  assert open_groups <= after
  # The new checkpoint writes the typed record's format.
  record = json.load(open(workdir / "checkpoints" / "4" / "run" / "metadata"))
  assert record["work"]["version"] == 2
