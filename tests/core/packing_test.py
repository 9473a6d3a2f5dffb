"""The packer (`packing.py`) and the packed TrainBatch layout (`train_batch.assemble`)."""

import numpy as np
import pytest

from arl_jax.core import packing as packing_lib
from arl_jax.core import rollout as rollout_lib
from arl_jax.core import train_batch as train_batch_lib


def _no_overlap(lengths, layout):
  cover = np.zeros((layout.rows, layout.width), np.int32)
  for n, r, s in zip(lengths, layout.row, layout.start):
    assert 0 <= s and s + n <= layout.width
    cover[r, s:s + n] += 1
  assert cover.max() <= 1
  assert cover.sum() == np.sum(lengths)


def test_first_fit_decreasing_fills_rows_in_order():
  row, start, rows = packing_lib.first_fit_decreasing([5, 3, 8, 2, 6], 10)
  # 8 -> row 0; 6 -> row 1; 5 -> row 2; 3 -> row 1 after the 6; 2 -> row 0 after the 8.
  assert rows == 3
  np.testing.assert_array_equal(row, [2, 1, 0, 0, 1])
  np.testing.assert_array_equal(start, [0, 6, 0, 8, 0])
  with pytest.raises(ValueError, match="11 tokens does not fit rows of 10"):
    packing_lib.first_fit_decreasing([11], 10)


@pytest.mark.parametrize("seed", range(3))
def test_packed_layouts_hold_every_sequence_once_and_keep_minibatches(seed):
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.lognormal(4, 1, 64).astype(int) + 1, 300)
  packing = packing_lib.Packing(pack_len=256, num_slices=2, row_multiple=4)
  layout = packing_lib.packed(lengths, packing)
  _no_overlap(lengths, layout)
  assert layout.width in packing_lib.candidate_widths(lengths.max(), 256)
  assert layout.rows % (2 * 4) == 0
  # Sequence i belongs to minibatch i % 2, whose rows are j, j + 2, ...
  np.testing.assert_array_equal(layout.row % 2, np.arange(64) % 2)
  # The first-fit bound: never more rows per slice than 11/9 OPT + 1, rounded up.
  per_slice = max(np.sum(lengths[j::2]) for j in range(2)) / layout.width
  assert layout.rows // 2 <= packing_lib.row_bucket(int(11 / 9 * np.ceil(per_slice)) + 2, 4)
  assert packing_lib.utilisation(lengths, layout) > 0.5


def test_widths_rows_and_buckets():
  assert packing_lib.candidate_widths(100, 1024) == [1024, 512, 256, 128]
  assert packing_lib.candidate_widths(2000, 1024) == [2048]  # a longer rollout widens its batch
  assert packing_lib.candidate_widths(300, 768) == [768, 384]
  assert [packing_lib.row_bucket(r, 1) for r in (1, 2, 3, 4, 5, 7, 9, 13, 17)] == [
      1, 2, 3, 4, 6, 8, 12, 16, 24]
  assert packing_lib.row_bucket(5, 4) == 8
  # Short rollouts take the narrowest width that covers the fewest columns.
  layout = packing_lib.packed([10] * 6, packing_lib.Packing(pack_len=64))
  assert (layout.rows, layout.width) == (1, 64)
  layout = packing_lib.packed([30, 30], packing_lib.Packing(pack_len=256))
  assert (layout.rows, layout.width) == (1, 64)
  with pytest.raises(ValueError, match="pack_len must be >= 1"):
    packing_lib.Packing(pack_len=0)


def _rollout(group_id, i, prompt, completion, rng):
  n = len(completion)
  loss_mask = np.ones(n, np.float32)
  loss_mask[1:n:3] = 0  # observation tokens between sampled ones (multi-turn)
  versions = np.where(loss_mask > 0, rng.integers(0, 3, n), rollout_lib.NO_VERSION)
  return rollout_lib.Rollout(
      group_id=group_id, sample_index=i, prompt_ids=np.asarray(prompt, np.int32),
      completion_ids=np.asarray(completion, np.int32), loss_mask=loss_mask,
      behaviour_logprobs=np.where(loss_mask > 0, rng.normal(-5, 1, n), 0).astype(np.float32),
      token_versions=versions.astype(np.int32), dispatch_version=0, finish_reason="stop",
      reward=float(rng.normal()))


def random_groups(rng, num_groups=4, group_size=2, prompt=(2, 9), completion=(1, 24)):
  """Groups of rollouts with ragged prompts and completions, observation
  tokens inside the completions and tokens of mixed versions."""
  groups = []
  for g in range(num_groups):
    p = rng.integers(0, 256, rng.integers(*prompt))
    rollouts = [_rollout(g, i, p, rng.integers(0, 256, rng.integers(*completion)), rng)
                for i in range(group_size)]
    groups.append(rollout_lib.Group(group_id=g, prompt_id=g, dispatch_version=0,
                                    rollouts=rollouts))
  return groups


def rollout_views(batch):
  """Each segment's per-token fields, in (row, segment) order."""
  views = []
  for r in range(batch.tokens.shape[0]):
    for k in range(1, batch.segment_ids[r].max(initial=0) + 1):
      cols = batch.segment_ids[r] == k
      views.append({name: np.asarray(getattr(batch, name))[r, cols]
                    for name in train_batch_lib.FIELDS if name != "segment_ids"})
  return views


def test_packed_rows_carry_each_rollouts_tokens_as_padded_rows_do():
  groups = random_groups(np.random.default_rng(0), num_groups=6)
  kw = dict(prompt_len=8, max_new_tokens=24, pad_id=300, advantage_estimator="grpo")
  padded = train_batch_lib.assemble(groups, **kw)
  packed = train_batch_lib.assemble(groups, packing=packing_lib.Packing(pack_len=64), **kw)
  assert packed.tokens.shape[0] < padded.tokens.shape[0]
  assert packed.token_mask.sum() == padded.token_mask.sum()
  key = lambda v: tuple(v["tokens"])
  for a, b in zip(sorted(rollout_views(padded), key=key), sorted(rollout_views(packed), key=key)):
    for name in a:
      np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    np.testing.assert_array_equal(b["positions"], np.arange(len(b["tokens"])))
  # Padding holds no token, no loss, no version, no advantage.
  off = packed.segment_ids == 0
  assert np.all(packed.tokens[off] == 300) and not packed.token_mask[off].any()
  assert np.all(packed.loss_mask[off] == 0) and np.all(packed.token_versions[off] == -1)
  assert np.all(packed.advantages[off] == 0)
