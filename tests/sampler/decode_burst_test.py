"""Decode bursts (`EngineConfig.decode_burst`): several decode steps per
device call while nothing waits between them sample exactly what single
steps sample, dense or paged, and a swap, a cancellation or new work waits
for the burst's end only."""

import pytest

from arl_jax.sampler import engine_config, precompile
from arl_jax.testing import tiny
from tests.sampler.engine_test import ScriptedPublisher
from tests.sampler.paged_engine_test import (
  SMALL_POOL,
  _check_pages,
  _groups,
  assert_exact_versions,
  assert_same_samples,
)

PAGED = dict(kv_cache="paged", page_size=4, attention_block=8)  # (reads 1 to 3 blocks)


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


@pytest.fixture(scope="module")
def single_steps(setup):
  """The dense engine's groups, one decode step per call (the reference)."""
  v0, _ = setup["sampler_params"]
  return _groups(setup, ScriptedPublisher(v0, None, 0))


@pytest.mark.parametrize("cache", [{}, SMALL_POOL], ids=["dense", "paged_preempting"])
def test_bursts_sample_what_single_steps_sample(setup, single_steps, cache):
  v0, _ = setup["sampler_params"]
  single, _ = single_steps
  burst, engine = _groups(setup, ScriptedPublisher(v0, None, 0), decode_burst=4, **cache)
  # Fewer device calls (and host round trips) than decode steps.
  assert engine.stats.model_passes < engine.stats.steps
  assert_same_samples(setup, single, burst)
  if cache:
    assert engine.stats.preemptions > 0
    _check_pages(engine)


@pytest.mark.parametrize("mode,kv_policy", [("in_flight", "recompute"), ("pinned", "keep")])
def test_a_swap_between_bursts_records_exact_versions(setup, mode, kv_policy):
  v0, v1 = setup["sampler_params"]
  groups, engine = _groups(setup, ScriptedPublisher(v0, v1, switch_after=3), mode,
                           kv_policy=kv_policy, decode_burst=3, **PAGED)
  assert engine.stats.swaps == 1
  assert_exact_versions(setup, groups, kv_policy)


@pytest.mark.parametrize("attention_block", [8, 0])
def test_an_engine_with_bursts_compiles_both_step_counts(attention_block):
  cfg = engine_config.EngineConfig(prompt_len=6, precompile=False, num_slots=4, group_size=1,
                                   max_new_tokens=8, kv_cache="paged", page_size=4, decode_burst=4,
                                   attention_block=attention_block)
  shapes = precompile.engine_shapes(cfg)
  assert shapes.steps == (1, 4)
  assert sorted({s for _, _, s in shapes.decode}) == [1, 4]
  # A program per row bucket, and per width unless attention reads blocks.
  widths = len(cfg.decode_widths) if not attention_block else 1
  assert len(shapes.decode) == 2 * len(shapes.take_rows) * widths
