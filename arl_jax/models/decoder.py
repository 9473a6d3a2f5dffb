"""One flax.nnx decoder for the Llama/Qwen family: RMSNorm, RoPE, GQA, SwiGLU,
with the options of Qwen2 (QKV biases) and Qwen3 (QK-norm) and the RoPE
scalings of Llama 3 (`rope.py`), so that Hugging Face checkpoints of these
families import exactly (`hf_config.py`, `hf_params.py`).

The same module computes the sampler's and the learner's log-probabilities, so
that at zero lag the importance ratio differs from 1 only by float rounding.

Every parameter carries `logical_axes` metadata (names such as `embed`, `mlp`,
`q_heads`); `arl_jax.sharding.rules` maps them to mesh axes per role.

Shape legend: B batch, T tokens in this call, S cache length, D model width,
H query heads, K key/value heads, Dh head width, F mlp width, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from arl_jax.models import cache_protocol
from arl_jax.models import lora as lora_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.models import paged_blocks as paged_blocks_lib
from arl_jax.models import rope as rope_lib
from arl_jax.models import segment_attention as segment_attention_lib

# Large negative instead of -inf: a row whose keys are all masked (a pad query)
# then gets a uniform softmax instead of NaN, and its output is ignored anyway.
_MASK_VALUE = -1e30


def _param(rngs: nnx.Rngs, shape, logical_axes, dtype, stddev,
           kind: type[nnx.Param] = nnx.Param) -> nnx.Param:
  value = stddev * jax.random.normal(rngs.params(), shape, jnp.float32)
  return kind(value.astype(dtype), logical_axes=logical_axes)


def _adapter(cfg: model_config_lib.ModelConfig, module: str, name: str, in_shape, out_shape,
             in_axes, out_axes, rngs: nnx.Rngs) -> lora_lib.Adapter | None:
  """The LoRA adapter of projection `module`.`name`, or None when `cfg.lora`
  gives it none (`lora.py`)."""
  lora = cfg.lora
  if not lora.adapts(module, name):
    return None
  return lora_lib.Adapter(in_shape, out_shape, in_axes, out_axes, lora.rank, lora.scale,
                          jnp.dtype(cfg.param_dtype), rngs)


def _plus(adapter: lora_lib.Adapter | None, x: jax.Array, y: jax.Array) -> jax.Array:
  """`y` (a projection of `x`) plus its adapter's delta, if it has one."""
  return y if adapter is None else y + adapter(x, y)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=("norm",))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    # Normalise in float32: the mean of squares loses precision in bfloat16.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with an optional KV cache."""

  def __init__(self, cfg: model_config_lib.ModelConfig, rngs: nnx.Rngs, dtype):
    d, h, k, dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    std = 1.0 / math.sqrt(d)
    embed, heads, kv = ("embed",), ("q_heads", "head_dim"), ("kv_heads", "head_dim")
    self.q_lora = _adapter(cfg, "attn", "q_proj", (d,), (h, dh), embed, heads, rngs)
    self.k_lora = _adapter(cfg, "attn", "k_proj", (d,), (k, dh), embed, kv, rngs)
    self.v_lora = _adapter(cfg, "attn", "v_proj", (d,), (k, dh), embed, kv, rngs)
    self.o_lora = _adapter(cfg, "attn", "o_proj", (h, dh), (d,), heads, embed, rngs)
    self.q_proj = _param(rngs, (d, h, dh), ("embed", "q_heads", "head_dim"), dtype, std)
    self.k_proj = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), dtype, std)
    self.v_proj = _param(rngs, (d, k, dh), ("embed", "kv_heads", "head_dim"), dtype, std)
    self.o_proj = _param(rngs, (h, dh, d), ("q_heads", "head_dim", "embed"), dtype,
                         1.0 / math.sqrt(h * dh))
    if cfg.qkv_bias:
      self.q_bias = _param(rngs, (h, dh), ("q_heads", "head_dim"), dtype, 0.0)
      self.k_bias = _param(rngs, (k, dh), ("kv_heads", "head_dim"), dtype, 0.0)
      self.v_bias = _param(rngs, (k, dh), ("kv_heads", "head_dim"), dtype, 0.0)
    if cfg.out_bias:
      self.o_bias = _param(rngs, (d,), ("norm",), dtype, 0.0)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.norm_eps, dtype)
      self.k_norm = RMSNorm(dh, cfg.norm_eps, dtype)
    self.cfg = cfg
    self.num_kv_heads = k
    self.head_dim = dh

  def __call__(self, x, positions, attn_mask,
               layer_cache: cache_protocol.LayerCache | None = None, cache_index=None,
               write_mask=None):
    """Attends `x` `[B, T, D]` to itself, or to the cache when one is given.

    Args:
      x: `[B, T, D]` normalised hidden states.
      positions: `[B, T]` RoPE positions.
      attn_mask: `[B, T, S]` bool, True where query t may attend to key s
        (S = T without a cache, the cache length with one); or, without a
        cache, `segment_attention.Segments` (training rows: causal within
        each segment, a block of queries at a time); or, with a paged
        cache, `paged_blocks.Blocks` (its pages read a block at a time, as
        many blocks as the call says).
      layer_cache: optional layer view of a cache (`kv_cache.KVCache.layer`
        or `paged_kv_cache.PagedKVCache.layer`); attention runs over its
        first S columns, S the mask's width.
      cache_index: `[B]` int32 cache offset of this call's first token.
      write_mask: optional `[B]` bool, rows whose cache entries may change.

    Returns:
      `([B, T, D] output, updated layer view or None)`.
    """
    q = _plus(self.q_lora, x, jnp.einsum("btd,dhe->bthe", x, self.q_proj[...]))
    k = _plus(self.k_lora, x, jnp.einsum("btd,dke->btke", x, self.k_proj[...]))
    v = _plus(self.v_lora, x, jnp.einsum("btd,dke->btke", x, self.v_proj[...]))
    if self.cfg.qkv_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    # A numpy constant of the static config (not state: nothing to learn or shard).
    inv_freq = rope_lib.inverse_frequencies(self.head_dim, self.cfg.rope_theta,
                                            self.cfg.rope_scaling)
    scale = rope_lib.attention_factor(self.cfg.rope_scaling)
    q = rope_lib.apply_rope(q, positions, inv_freq, scale)
    k = rope_lib.apply_rope(k, positions, inv_freq, scale)
    k = k.transpose(0, 2, 1, 3)  # [B, K, T, Dh], the cache layout
    v = v.transpose(0, 2, 1, 3)
    b, t, h, dh = q.shape
    if isinstance(attn_mask, segment_attention_lib.Segments):
      out = segment_attention_lib.attend(q, k, v, attn_mask).astype(x.dtype)
      new_cache = None
    elif isinstance(attn_mask, paged_blocks_lib.Blocks):
      # A paged cache read a block of pages at a time (`paged_blocks.py`).
      out, new_cache = layer_cache.attend_blocks(q / math.sqrt(dh), k, v, cache_index,
                                                 write_mask, attn_mask)
      out = out.astype(x.dtype)
    elif t == 1 and layer_cache is not None and layer_cache.attends:
      # A decode step through a paged attention kernel, which reads the
      # cache's pages itself (`paged_kv_cache.PagedLayer.attend`).
      out, new_cache = layer_cache.attend(q[:, 0] / math.sqrt(dh), k, v, cache_index,
                                          write_mask, width=attn_mask.shape[-1])
      out = out[:, None].astype(x.dtype)  # [B, 1, H, Dh]
    else:
      out, new_cache = self._attend(q, k, v, attn_mask, layer_cache, cache_index, write_mask)
      out = out.astype(x.dtype)
    out = _plus(self.o_lora, out, jnp.einsum("bthe,hed->btd", out, self.o_proj[...]))
    if self.cfg.out_bias:
      out = out + self.o_bias[...]
    return out, new_cache

  def _attend(self, q, k, v, attn_mask, layer_cache, cache_index, write_mask):
    """XLA attention of `q` `[B, T, H, Dh]` over `k`, `v` `[B, K, T, Dh]`, or
    over the cache's columns once they are written: `([B, T, H, Dh] float32, cache)`."""
    new_cache = None
    if layer_cache is not None:
      k, v, new_cache = layer_cache.update(k, v, cache_index, write_mask,
                                           width=attn_mask.shape[-1])
    b, t, h, dh = q.shape
    group = h // self.num_kv_heads
    q = q.reshape(b, t, self.num_kv_heads, group, dh).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,Dh]
    # Scores and softmax in float32: bfloat16 logits would add a per-token
    # sampler/learner mismatch that looks like policy lag in the ratio logs.
    scores = jnp.einsum("bkgtd,bksd->bkgts", q.astype(jnp.float32), k.astype(jnp.float32))
    scores = scores / math.sqrt(dh)
    scores = jnp.where(attn_mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v.astype(jnp.float32))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh), new_cache


class SwiGLU(nnx.Module):

  def __init__(self, cfg: model_config_lib.ModelConfig, rngs: nnx.Rngs, dtype):
    d, f = cfg.d_model, cfg.mlp_dim
    self.gate = _param(rngs, (d, f), ("embed", "mlp"), dtype, 1.0 / math.sqrt(d))
    self.up = _param(rngs, (d, f), ("embed", "mlp"), dtype, 1.0 / math.sqrt(d))
    self.down = _param(rngs, (f, d), ("mlp", "embed"), dtype, 1.0 / math.sqrt(f))
    self.gate_lora = _adapter(cfg, "mlp", "gate", (d,), (f,), ("embed",), ("mlp",), rngs)
    self.up_lora = _adapter(cfg, "mlp", "up", (d,), (f,), ("embed",), ("mlp",), rngs)
    self.down_lora = _adapter(cfg, "mlp", "down", (f,), (d,), ("mlp",), ("embed",), rngs)

  def __call__(self, x):
    gate = _plus(self.gate_lora, x, x @ self.gate[...])
    hidden = jax.nn.silu(gate) * _plus(self.up_lora, x, x @ self.up[...])
    return _plus(self.down_lora, hidden, hidden @ self.down[...])


class Block(nnx.Module):

  def __init__(self, cfg: model_config_lib.ModelConfig, rngs: nnx.Rngs, dtype):
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
    self.attn = Attention(cfg, rngs, dtype)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
    self.mlp = SwiGLU(cfg, rngs, dtype)

  def __call__(self, x, positions, attn_mask, layer_cache, cache_index, write_mask):
    attn_out, layer_cache = self.attn(self.attn_norm(x), positions, attn_mask, layer_cache,
                                      cache_index, write_mask)
    x = x + attn_out
    x = x + self.mlp(self.mlp_norm(x))
    return x, layer_cache


class Decoder(nnx.Module):
  """The policy: token ids in, float32 logits out."""

  def __init__(self, cfg: model_config_lib.ModelConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.base_dtype)  # (adapters keep cfg.param_dtype)
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), dtype,
                        1.0 / math.sqrt(cfg.d_model))
    self.blocks = nnx.List([Block(cfg, rngs, dtype) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, dtype)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), dtype,
                            1.0 / math.sqrt(cfg.d_model))
    if cfg.value_head:
      # Zero-initialised: the critic starts predicting 0 and learns from targets.
      # No Hugging Face base has one: with LoRA it trains in full beside the
      # adapters (`lora.TrainsBesideAdapters`), in their dtype, `param_dtype`.
      self.value_head = _param(rngs, (cfg.d_model,), ("embed",), jnp.dtype(cfg.param_dtype),
                               0.0, lora_lib.TrainsBesideAdapters)

  def __call__(self, tokens, positions, attn_mask,
               cache: cache_protocol.DecodeCache | None = None, cache_index=None,
               write_mask=None, last_only=False, with_values=False, hidden_only=False,
               remat: str = "none", scan_layers: bool = False):
    """Runs the decoder.

    Args:
      tokens: `[B, T]` int32 token ids.
      positions: `[B, T]` int32 RoPE positions.
      attn_mask: `[B, T, S]` bool attention mask, or `Segments` (see
        `Attention`).
      cache: optional `KVCache` or `PagedKVCache`; when given, this call's
        keys/values are written at `cache_index` and attention runs over the
        cache's first S columns (S: the mask's width).
      cache_index: `[B]` int32, required with a cache.
      write_mask: optional `[B]` bool; rows where it is False leave the cache
        as it was (their outputs are still computed, and ignored).
      last_only: return logits for the last position only (`[B, 1, V]`): a
        prefill needs no others, and at a large vocabulary they dominate memory.
      with_values: also return the value head's output (needs `value_head`).
      hidden_only: return the final hidden states `[B, T, D]` (normed, in
        the parameter dtype) in place of the logits: `head_logits` turns
        them into logits (with `head_weight`) a chunk of tokens at a time
        (`learner/logprobs.py`), never `[B, T, V]` at once.
      remat: what the backward pass keeps of each block (without a cache):
        `none` (what XLA keeps), `block` (only the block's input: its
        insides are recomputed) or `dots` (the matmul outputs, recomputing
        the rest): `REMAT_POLICIES`.
      scan_layers: without a cache, run the blocks as one `lax.scan` over
        their stacked parameters (`_scan_blocks`) instead of one copy of the
        block per layer: the same numbers from one block's program, so the
        backward pass's scratch (a block's attention scores) is planned
        once instead of once per layer.

    Returns:
      `(logits [B, T, V] float32, updated KVCache or None)`, plus
      `values [B, T] float32` (the value of the prefix up to and including
      each position) when `with_values`.
    """
    x = jnp.take(self.embed[...], tokens, axis=0)
    new_layers = []
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    policy = REMAT_POLICIES[remat] if cache is None else None
    if scan_layers and cache is None:
      x = _scan_blocks(list(self.blocks), x, positions, attn_mask, policy)
    else:
      for i, block in enumerate(self.blocks):
        layer_cache = None if cache is None else cache.layer(i)
        if policy is None:
          x, layer_cache = block(x, positions, attn_mask, layer_cache, cache_index, write_mask)
        else:
          x, layer_cache = nnx.remat(Block.__call__, policy=policy)(
              block, x, positions, attn_mask, None, None, None)
        new_layers.append(layer_cache)
    if last_only:
      x = x[:, -1:]
    x = self.final_norm(x)
    logits = x if hidden_only else head_logits(x, self.head_weight())
    new_cache = None if cache is None else cache.with_layers(new_layers)
    if not with_values:
      return logits, new_cache
    if not self.cfg.value_head:
      raise ValueError("with_values=True needs a model built with value_head=True")
    values = jnp.einsum("btd,d->bt", x.astype(jnp.float32),
                        self.value_head[...].astype(jnp.float32))
    return logits, new_cache, values

  def head_weight(self) -> jax.Array:
    """The output projection `[D, V]` (the embedding's transpose when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]


def _scan_blocks(blocks, x, positions, attn_mask, policy):
  """`x` through `blocks` (no cache) as one `lax.scan` over their parameters
  stacked along a new leading axis.

  Why: XLA compiles an unrolled stack of blocks into one program per layer,
  and on CPU it plans each copy's temporaries (the backward pass's attention
  blocks, ~1 GiB per layer for a 16k-token row) apart; a scan has one body,
  so they exist once. The stacked copy of the parameters costs one trunk's
  bytes, built inside the step (the stored layout, its sharding, checkpoints
  and the HF mapping stay per layer).

  A LoRA run's frozen base is not stacked: each step of the scan picks its
  layer's base weights with a `lax.switch` (a copy of one layer, not of the
  trunk: SmolLM2's update held 0.45 GiB less). Nothing differentiates the
  base, so no gradient flows through the switch; the adapters, which train,
  are stacked (their gradients come back stacked, then per layer).
  """
  if any(jax.tree.leaves(nnx.state(block, lora_lib.LoraParam)) for block in blocks):
    split = [nnx.split(block, lora_lib.TrainsBesideAdapters, ...) for block in blocks]
    bases = [base for _, _, base in split]
  else:
    split = [nnx.split(block) for block in blocks]
    bases = None
  graphdef = split[0][0]
  stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *[parts[1] for parts in split])

  def body(x, layer):
    index, state = layer
    states = (state,) if bases is None else (
        state, jax.lax.switch(index, [lambda base=base: base for base in bases]))
    y, _ = nnx.merge(graphdef, *states)(x, positions, attn_mask, None, None, None)
    return y, None

  if policy is not None:
    body = jax.checkpoint(body, policy=policy, prevent_cse=False)
  return jax.lax.scan(body, x, (jnp.arange(len(blocks)), stacked))[0]


# What the backward pass keeps of a decoder block (`Decoder.__call__`'s remat).
REMAT_POLICIES = {
    "none": None,
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
  """Logits `[..., V]` float32 of final hidden states `x` `[..., D]` through
  `head` `[D, V]`. Float32 whatever the parameter dtype: log-softmax of
  bfloat16 logits is off by ~0.02 nats, which would pollute every ratio
  statistic."""
  return jnp.einsum("...d,dv->...v", x.astype(jnp.float32), head.astype(jnp.float32))


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """RoPE positions `[B, T]` counting only real tokens, so left padding is invisible."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=1) - 1, 0)


def causal_mask(token_mask: jax.Array) -> jax.Array:
  """`[B, T, T]` attention mask for a full sequence: causal and no pad keys."""
  t = token_mask.shape[1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  return causal[None, :, :] & token_mask[:, None, :].astype(jnp.bool_)


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """`[B, T, T]` attention mask for rows of segments (`segment_ids` `[B, T]`,
  0 on padding): causal within each segment, nothing across segments, no pad
  keys. With one segment per row (the row's `token_mask`) it equals
  `causal_mask` on every real query."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return causal[None, :, :] & same & (segment_ids[:, None, :] > 0)
