"""Whether a config fits a device kind, and the largest batch and context that would."""

import math
import os
import subprocess
import sys

import pytest

from arl_jax.config import run_spec
from arl_jax.testing import tiny
from arl_jax.training import dry_run, fit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("edge, unit, limit, expected", [
    (37, 4, 1000, 36), (36, 4, 1000, 36), (3, 4, 1000, None), (10**6, 4, 1000, 1000),
    (1, 1, 1 << 20, 1), (12345, 1, 1 << 20, 12345), (4, 8, 4, None)])
def test_largest_multiple_finds_the_edge_of_a_monotone_test(edge, unit, limit, expected):
  asked = []

  def fits(n):
    asked.append(n)
    return n <= edge

  assert fit.largest_multiple(fits, unit, limit) == expected
  assert all(n % unit == 0 and n <= limit for n in asked)
  assert len(asked) <= 2 * 21 + 2  # a doubling then a bisection, not a scan


def test_the_largest_batch_and_budget_fit_and_one_step_more_does_not():
  spec = run_spec.build(tiny.load_config("arith", None), list(range(8)))
  memory = 32 * 2**20  # a 32 MiB device: twice the arith run's 15 MiB plan
  budget = dry_run.USABLE * memory
  answers = fit.fit(spec, 8, memory)
  peak = lambda s: dry_run.plan(s, 8).per_device_peak()
  assert answers.busiest == peak(spec) and answers.fits == (peak(spec) <= budget)
  unit = fit.batch_unit(spec, 8)
  assert unit % spec.orchestrator.group_size == 0
  batch = answers.largest_batch
  assert batch % unit == 0 and batch > spec.orchestrator.batch_size
  assert peak(fit.with_batch(spec, batch)) <= budget < peak(fit.with_batch(spec, batch + unit))
  config = tiny.load_config("arith", None)
  config.orchestrator.batch_size = batch
  run_spec.build(config, list(range(8)))  # a valid config, as the answer says
  tokens = answers.largest_new_tokens
  text = fit.format_fit(answers, spec)
  assert f"orchestrator.batch_size={batch} (now {spec.orchestrator.batch_size})" in text
  assert f"sampler.max_new_tokens={tokens} (now {spec.engine.max_new_tokens}" in text
  grown = fit.with_new_tokens(spec, tokens)
  if grown.model.max_seq_len != spec.model.max_seq_len:
    assert f"model.max_seq_len={grown.model.max_seq_len}" in text

  def built(new_tokens):  # the budget as a user would ask for it: the keys the answer names
    config = tiny.load_config("arith", None)
    config.sampler.max_new_tokens = new_tokens
    config.model.max_seq_len = max(config.model.max_seq_len,
                                   spec.engine.prompt_len + new_tokens)
    return run_spec.build(config, list(range(8)))
  assert peak(built(tokens)) <= budget < peak(built(tokens + 1))


def test_batch_unit_splits_into_the_learner_rows_and_whole_groups():
  config = tiny.load_config("arith", None)
  config.learner.num_microbatches = 4  # 4 x fsdp 4 rows: 16, where a group is 8
  spec = run_spec.build(config, list(range(8)))
  fsdp = dict(dry_run.plan(spec, 8).learner.mesh)["fsdp"]
  layout = spec.loss.layout
  assert fsdp == 4 and spec.orchestrator.group_size == 8
  assert fit.batch_unit(spec, 8) == math.lcm(8, layout.num_minibatches * 4 * fsdp) == 16


def test_a_longer_budget_picks_the_kv_cache_a_config_asking_for_it_would():
  spec = run_spec.build(tiny.load_config("arith", None), list(range(8)))
  assert spec.kv_cache_setting == "auto" and spec.engine.kv_cache == "dense"
  long = 2048 - spec.engine.prompt_len
  assert fit.with_new_tokens(spec, long).engine.kv_cache == "paged"  # (auto: >= 1,024 columns)
  config = tiny.load_config("arith", None)
  config.sampler.kv_cache = "dense"
  dense = run_spec.build(config, list(range(8)))
  assert fit.with_new_tokens(dense, long).engine.kv_cache == "dense"
  # A fixed pool holds no sequence longer than itself: not an error, no fit.
  config = tiny.load_config("arith", None)
  config.sampler.kv_pages = 4
  pool = run_spec.build(config, list(range(8)))
  columns = 4 * pool.engine.page_size
  with pytest.raises(ValueError):
    fit.with_new_tokens(pool, columns)
  answer = fit.fit(pool, 8, 2**40).largest_new_tokens
  assert answer is not None and spec.engine.prompt_len + answer <= columns
  # A device too small for the params alone: nothing fits.
  none = fit.fit(spec, 8, 2**10)
  assert (none.fits, none.largest_batch, none.largest_new_tokens) == (False, None, None)
  assert "no batch fits" in fit.format_fit(none, spec)


def test_the_cli_answers_for_a_device_kind_and_rejects_an_unknown_one():
  cmd = [sys.executable, "-m", "arl_jax.launch", "--config=configs/arith.py", "--dry_run",
         "--dry_run_devices=8"]
  env = dict(os.environ, XLA_FLAGS="")
  run = lambda *extra: subprocess.run([*cmd, *extra], cwd=REPO, env=env, capture_output=True,
                                      text=True, timeout=120)
  proc = run("--dry_run_device=tpu-v5e")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "fits in 16.0 GiB per device" in proc.stdout
  assert "largest batch that fits at this context: orchestrator.batch_size=" in proc.stdout
  assert "largest completion budget that fits at this batch" in proc.stdout
  for extra, message in ((["--dry_run_device=tpu-v9"], "unknown device kind; known: a100-40gb"),
                         (["--dry_run_device=h100", "--dry_run_device_gib=80"], "pass one")):
    bad = run(*extra)
    assert bad.returncode == 2 and message in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
