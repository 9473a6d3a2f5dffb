"""Helpers to drive the sampler's slot functions directly in tests and benchmarks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arl_jax.core import rows as rows_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.sampler import slot_fns, token_draw


class SlotDriver:
  """Inserts prompts into chosen slots and decodes, with explicit versions."""

  def __init__(self, *, graphdef, model_cfg, mesh, settings, num_slots, bucket, max_new_tokens,
               seed=0):
    self.fns = slot_fns.make_sampler_fns(
        graphdef=graphdef, model_cfg=model_cfg, mesh=mesh, settings=settings,
        num_slots=num_slots, length=bucket + max_new_tokens)
    self.state = self.fns.init()
    self.num_slots, self.bucket, self.max_new, self.seed = num_slots, bucket, max_new_tokens, seed
    self.pad_id = settings.pad_id

  def insert(self, params, version, slots, prompts, group_ids, sample_indices=None,
             stop_mask=None):
    r = len(slots)
    tokens, mask = rows_lib.left_pad(prompts, self.bucket, self.pad_id)
    sample_indices = np.zeros(r) if sample_indices is None else sample_indices
    keys = token_draw.row_keys(self.seed, group_ids, sample_indices)
    self.state = self.fns.insert(params, jnp.int32(version), self.state,
                                 np.asarray(slots, np.int32), tokens, mask, keys,
                                 np.full((r,), self.max_new, np.int32), stop_mask)

  def decode(self, params, version, rows=None, stop=None):
    rows = np.ones((self.num_slots,), bool) if rows is None else np.asarray(rows, bool)
    stop = np.zeros((self.num_slots,), bool) if stop is None else np.asarray(stop, bool)
    self.state = self.fns.decode(params, jnp.int32(version), self.state, stop, rows)

  def recompute(self, params, rows=None):
    rows = np.ones((self.num_slots,), bool) if rows is None else np.asarray(rows, bool)
    self.state = self.fns.recompute(params, self.state, rows)

  def row(self, slot):
    """Host copy of one slot: tokens, mask, logprobs, versions (full rows)."""
    s = self.state
    return {name: np.asarray(getattr(s, name))[slot]
            for name in ("tokens", "token_mask", "logprobs", "versions")}


def teacher_forced_logprobs(graphdef, params, tokens, token_mask, temperature=1.0):
  """Learner log-probs of one or more host rows `[B, L]` (or `[L]`)."""
  tokens, token_mask = np.atleast_2d(tokens), np.atleast_2d(token_mask)
  logp, _ = logprobs_lib.token_logprobs_and_entropy(
      graphdef, params, tokens, token_mask.astype(np.int32),
      decoder_lib.positions_from_mask(token_mask), temperature)
  return np.asarray(logp)


def teacher_forced_distributions(graphdef, params, tokens) -> np.ndarray:
  """The learner's log-softmax `[L, V]` after each token of one host row `[L]`
  (row i: the distribution of token i + 1), at temperature 1."""
  model = nnx.merge(graphdef, params)
  tokens = np.atleast_2d(np.asarray(tokens, np.int32))
  mask = np.ones(tokens.shape, bool)
  logits, _ = model(tokens, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
