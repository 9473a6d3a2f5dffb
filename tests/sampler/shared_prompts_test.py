"""The samples of a group share one prefill (`EngineConfig.share_prompts`):
the others start from it (`sampling.fork`) and sample what they would have
sampled from prefills of their own, dense or paged (sharing the prompt's
pages), in every weight-update mode."""

import pytest

from arl_jax.testing import tiny
from tests.sampler.engine_test import ScriptedPublisher
from tests.sampler.paged_engine_test import (
  _check_pages,
  _groups,
  assert_exact_versions,
  assert_same_samples,
)

PAGED = dict(kv_cache="paged", page_size=4)


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


@pytest.mark.parametrize("cache", [{}, PAGED], ids=["dense", "paged"])
def test_forked_samples_sample_what_their_own_prefills_sample(setup, cache):
  v0, _ = setup["sampler_params"]
  # Prompts of 5-6 tokens: more than a page of 4 columns.
  own, alone = _groups(setup, ScriptedPublisher(v0, None, 0), share_prompts=False,
                       prompt_tokens=(5, 6), **cache)
  shared, engine = _groups(setup, ScriptedPublisher(v0, None, 0), prompt_tokens=(5, 6),
                           **cache)
  assert alone.stats.forked_rows == 0
  # Groups of 4 admitted whole: 3 of every 4 rows start from another's prefill.
  assert engine.stats.forked_rows == 3 * engine.stats.inserts // 4 > 0
  assert_same_samples(setup, own, shared)
  if cache:
    _check_pages(engine)
    # A group's prompt (columns 0-4 or 0-5) is one shared page, and its last
    # column's page a copy each: fewer pages than four prefills hold.
    assert engine.stats.kv_pages_peak < alone.stats.kv_pages_peak


@pytest.mark.parametrize("mode,kv_policy,cache", [
    ("in_flight", "keep", PAGED), ("in_flight", "recompute", PAGED), ("pinned", "keep", {}),
    ("drain", "keep", PAGED)])
def test_forked_samples_record_exact_versions_across_updates(setup, mode, kv_policy, cache):
  v0, v1 = setup["sampler_params"]
  groups, engine = _groups(setup, ScriptedPublisher(v0, v1, switch_after=3), mode, n=4,
                           kv_policy=kv_policy, **cache)
  assert engine.stats.forked_rows > 0 and engine.stats.swaps == 1
  assert_exact_versions(setup, groups, kv_policy)
  if cache:
    _check_pages(engine)
