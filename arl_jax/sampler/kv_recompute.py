"""`recompute_cache`: a live slot's keys and values computed again under new
params, after an in-flight swap (`EngineConfig.kv_policy="recompute"`), so
that the tokens it samples next attend to a cache of the params that score them."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.sampler.sampling import SlotState


def recompute_cache(graphdef, params, state: SlotState, rows, *,
                    width: int | None = None) -> SlotState:
  """Re-prefills the KV cache of `rows` under `params` (the `recompute` KV policy).

  Every token already fed to the model (columns before each slot's last
  sampled token) gets keys/values from `params`, as a fresh prefill would;
  recorded tokens, log-probs and versions stay as sampled. Only the first
  `width` columns are computed (None: all L): the engine passes a width that
  holds every live slot's last column, as for `decode_step`.
  """
  model = nnx.merge(graphdef, params)
  b, length = state.tokens.shape
  width = length if width is None else width
  tokens = state.tokens[:, :width]
  fed = state.token_mask[:, :width] & (jnp.arange(width)[None, :] < state.index[:, None])
  positions = decoder_lib.positions_from_mask(fed)
  live = rows & ~state.done
  _, cache = model(tokens, positions, decoder_lib.causal_mask(fed), state.cache,
                   jnp.zeros((b,), jnp.int32), write_mask=live)
  return state.replace(cache=cache)
