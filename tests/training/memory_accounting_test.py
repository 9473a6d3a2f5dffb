"""A run's memory by owner (`memory.jsonl`) against its own `--dry_run` plan."""

import json
import math
import os

from arl_jax.testing import tiny
from arl_jax.training import dry_run, run_lib


def _memory_rows(workdir):
  with open(os.path.join(workdir, "memory.jsonl"), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return rows[0], rows[1:]


def test_a_colocated_run_holds_no_more_parameter_copies_than_its_plan(tmp_path):
  config = tiny.load_config("arith", "tiny")
  config.mesh.placement = "colocated"  # (both roles on all 8 devices)
  config.update(num_steps=4, eval_every=2, log_every=1)
  config.checkpoint.every_steps = 2
  run_lib.run(config, str(tmp_path), print_fn=lambda line: None)
  plan, rows = _memory_rows(tmp_path)
  assert plan["phase"] == "plan" and plan["colocated"] and plan["num_devices"] == 8
  phases = [(r["phase"], r["step"]) for r in rows]
  for phase in [("update", 1), ("eval", 2), ("checkpoint", 2), ("update", 4), ("stop", 4)]:
    assert phase in phases, phases
  devices = plan["num_devices"]
  params = plan["learner"]["params"] * devices  # (per device in the plan; summed here)
  sampler_versions = next(v for k, v in plan["sampler"].items() if k.startswith("params_x"))
  for r in rows:
    if r["step"] is None:  # (the start-up: the learner's state is still being built)
      continue
    held = r["by_owner"]
    assert held["learner params"] == params, r
    # AdamW's two moments, sharded as the params are (and a few scalars).
    assert 2 * params <= held["optimizer state"] <= 2 * params + 64 * devices, r
    assert held["sampler params"] <= sampler_versions * devices, r
    assert held["sampler kv cache"] <= (plan["sampler"]["kv_cache"]
                                        + plan["sampler"]["slot_state"]) * devices, r
    # The evaluation holds nothing between its passes.
    assert held["evaluation kv cache"] == 0, r


# (a program's own memory while it runs, or a compilation's)
INSIDE_PROGRAMS = (*dry_run.UPDATE, *dry_run.COMPILE)


def test_the_plan_of_the_arrays_a_run_holds_is_within_a_quarter_of_what_it_measures(tmp_path):
  """Between phases a run holds its arrays only (a program's temporaries, the
  gradients among them, exist while it runs; the evaluation's cache during
  its pass): those of the plan, on the busiest device, against the most the
  ledger found on any device."""
  config = tiny.load_config("arith", "tiny")
  config.update(num_steps=3, eval_every=3, log_every=1)
  run_lib.run(config, str(tmp_path), print_fn=lambda line: None)
  plan, rows = _memory_rows(tmp_path)
  devices = {role: math.prod(plan[f"{role}_mesh"].values()) for role in ("learner", "sampler")}

  def planned(versions_held: int) -> int:
    held = {}
    for role in ("learner", "sampler"):
      held[role] = 0
      for name, b in plan[role].items():
        if name.startswith("params_x"):  # (the plan's swap peak: two versions)
          b = b // int(name.split("_x")[1].split("_")[0]) * versions_held
        if name not in INSIDE_PROGRAMS and not name.startswith("eval_"):
          held[role] += b
    return held["learner"] + held["sampler"] if plan["colocated"] else max(held.values())

  def measured(row) -> int:
    """The owners' arrays on one device of each role (the ledger sums every
    device; `unclaimed` leaves out what other tests in this process hold)."""
    held = {role: sum(b for owner, b in row["by_owner"].items()
                      if owner.startswith("sampler") == (role == "sampler")
                      and owner != "unclaimed") // devices[role]
            for role in ("learner", "sampler")}
    return held["learner"] + held["sampler"] if plan["colocated"] else max(held.values())

  # A phase ends with the live version held, and a second one while a swap
  # is under way.
  most = max(measured(r) for r in rows if r["phase"] == "update")
  assert 0.8 * planned(1) <= most <= 1.25 * planned(2), (most, plan)
