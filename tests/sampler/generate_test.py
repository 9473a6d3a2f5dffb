"""`generate.Generator`: the engine's scheduler and runner, called synchronously."""

import numpy as np
import pytest

from arl_jax.sampler import engine_config, sampling
from arl_jax.sampler import generate as generate_lib
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny

PAD, EOS = 256, 258
NEW = 8


@pytest.fixture(scope="module")
def setup():
  return tiny.two_published_versions()


def _generator(setup, stop_ids=(), **options):
  cfg = engine_config.EngineConfig(
      **{**dict(num_slots=8, group_size=4, prompt_len=8, max_new_tokens=NEW, kv_cache="dense",
                decode_burst=1, precompile=False), **options})
  settings = sampling.SamplingSettings(eos_id=EOS, pad_id=PAD, stop_ids=stop_ids)
  return generate_lib.Generator(cfg=cfg, settings=settings, graphdef=setup["graphdef"],
                                model_cfg=setup["cfg"], mesh=setup["meshes"].sampler)


def _prompts(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, rng.integers(3, 9)).tolist() for _ in range(n)]


def test_samples_carry_the_learner_s_logprobs_and_their_version(setup):
  """5 groups of 4 through 8 slots (admitted as slots free up): each sample's
  log-probs are the learner's teacher-forced ones, every token records the
  version it was given, and the samples of a group differ."""
  prompts = _prompts(5)
  groups = _generator(setup)(setup["sampler_params"][1], prompts, version=7)
  assert len(groups) == 5 and all(len(g) == 4 for g in groups)
  rows = [(prompt, c) for prompt, group in zip(prompts, groups) for c in group]
  # Every row teacher-forced in one call (right-padded: one program).
  width = max(len(p) + len(c.tokens) for p, c in rows)
  tokens, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), bool)
  for i, (prompt, c) in enumerate(rows):
    n = len(prompt) + len(c.tokens)
    tokens[i, :n], mask[i, :n] = np.concatenate([prompt, c.tokens]), True
  want = slots_lib.teacher_forced_logprobs(setup["graphdef"], setup["params"][1], tokens, mask)
  for i, (prompt, completion) in enumerate(rows):
    assert 1 <= len(completion.tokens) <= NEW
    assert set(completion.versions.tolist()) == {7}
    np.testing.assert_allclose(completion.logprobs,
                               want[i, len(prompt):len(prompt) + len(completion.tokens)],
                               atol=1e-5)
  for group in groups:
    assert len({tuple(c.tokens.tolist()) for c in group}) > 1


@pytest.mark.parametrize("options", [
    dict(kv_cache="paged", page_size=4, attention_block=8),
    dict(kv_cache="paged", page_size=4, kv_pages=13, attention_block=8),  # preempts
    dict(prefill_chunk=4),
    dict(share_prompts=False, decode_burst=4),
    dict(share_prompts=False, max_insert_rows=3),
], ids=["paged", "paged_small_pool", "chunked", "unshared_burst", "unshared_insert_rows"])
def test_every_way_of_sampling_draws_the_same_tokens(setup, options):
  """Draws depend on (seed, group, sample, turn, offset) only: a paged cache,
  preemption, chunked prefill, unshared prompts, bursts and inserts split
  (`max_insert_rows`) sample the dense engine's tokens."""
  prompts, params = _prompts(4, seed=1), setup["sampler_params"][0]
  dense = _generator(setup)(params, prompts)
  other = _generator(setup, **options)(params, prompts)
  for a_group, b_group in zip(dense, other):
    for a, b in zip(a_group, b_group):
      np.testing.assert_array_equal(a.tokens, b.tokens)
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_an_observation_continues_the_episode(setup):
  """`on_segment` appending an observation re-admits the episode; its next
  segment follows the observation, which records no version."""
  # Most tokens end a segment, so first segments leave room for a second.
  generator = _generator(setup, stop_ids=tuple(range(200)), group_size=1, multi_turn=True,
                         context_bucket=4, max_new_tokens=12)
  turns = []

  def answer(episode):
    turns.append(episode.group_id)
    if episode.turns > 1 or episode.length + 2 >= 12:
      return False
    episode.add_observation([5, 6])
    return True

  episodes = generator.episodes(setup["sampler_params"][0], _prompts(3, seed=2),
                                on_segment=answer)
  for (episode,) in episodes:
    assert episode.turns == 2 and turns.count(episode.group_id) == 2
    versions = np.array(episode.versions)
    first, second = np.flatnonzero(versions < 0)
    assert second == first + 1 and episode.completion_ids[first:second + 1] == [5, 6]
    assert first >= 1 and np.all(versions[second + 1:] == 0) and len(versions) > second + 1
    assert episode.length <= 12


def test_a_prompt_too_long_is_named_before_anything_runs(setup):
  generator = _generator(setup)
  with pytest.raises(ValueError, match="group 1: prompt has 9 tokens"):
    generator(setup["sampler_params"][0], [[1, 2], list(range(9))])
  assert generator.runner.state is None
