"""`train_batch.FIELDS` is the one layout of a batch: `assemble` makes it, `zeros` and the
multi-controller broadcast read it."""

import dataclasses

import numpy as np

from arl_jax.core import rollout as rollout_lib
from arl_jax.core import train_batch


def _group(group_id, lengths):
  rollouts = [rollout_lib.Rollout(
      group_id=group_id, sample_index=i, prompt_ids=np.array([1, 2], np.int32),
      completion_ids=np.full(n, 3, np.int32), loss_mask=np.ones(n, np.float32),
      behaviour_logprobs=np.full(n, -0.5, np.float32), token_versions=np.zeros(n, np.int32),
      dispatch_version=0, finish_reason="stop", reward=float(i), env_name="arith")
      for i, n in enumerate(lengths)]
  return rollout_lib.Group(group_id=group_id, prompt_id=group_id, dispatch_version=0,
                           rollouts=rollouts)


def test_assemble_and_zeros_follow_one_layout():
  assert set(train_batch.FIELDS) == {f.name for f in dataclasses.fields(train_batch.TrainBatch)}
  batch = train_batch.assemble([_group(0, [3, 5]), _group(1, [2, 4])], prompt_len=4,
                               max_new_tokens=8, pad_id=0, advantage_estimator="grpo")
  zeros = train_batch.zeros(4, 12)
  for name, (dtype, _) in train_batch.FIELDS.items():
    got = np.asarray(getattr(batch, name))
    assert got.dtype == np.dtype(dtype), name
    assert got.shape == (4, 12), name
    assert getattr(zeros, name).dtype == got.dtype and getattr(zeros, name).shape == got.shape
