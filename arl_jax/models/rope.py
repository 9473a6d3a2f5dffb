"""Rotary position embedding (Su et al., 2021) and the frequency scalings of
the Llama and Qwen families.

The inverse frequencies are computed on the host once per model, in float32
exactly as Hugging Face `transformers` does (`modeling_rope_utils.py`), so that
an imported checkpoint sees the same rotation angles it was trained with.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

SCALING_KINDS = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """A RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).

  Attributes:
    kind: `linear` (positions divided by `factor`), `llama3` (Llama 3.1:
      low frequencies divided by `factor`, high ones kept, a smooth ramp
      between) or `yarn` (YaRN, Peng et al. 2023, as the Qwen families use it
      for long contexts: a ramp over dimensions between `beta_fast` and
      `beta_slow` rotations, and cos/sin scaled by an attention factor).
    factor: context extension factor.
    low_freq_factor, high_freq_factor: the `llama3` ramp (wavelengths above
      `original / low_freq_factor` are scaled fully, below
      `original / high_freq_factor` not at all).
    original_max_position_embeddings: the pretraining context (`llama3`, `yarn`).
    beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate:
      the `yarn` parameters, defaults as in `transformers`.
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.kind not in SCALING_KINDS:
      raise ValueError(f"model.rope_scaling kind {self.kind!r} is not supported; "
                       f"supported: {SCALING_KINDS}")
    if self.factor <= 0:
      raise ValueError(f"model.rope_scaling factor must be > 0, got {self.factor}")
    if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError("model.rope_scaling: high_freq_factor must exceed low_freq_factor")


@functools.lru_cache(maxsize=64)  # called at every trace; the arguments are static
def inverse_frequencies(head_dim: int, theta: float,
                        scaling: RopeScaling | None = None) -> np.ndarray:
  """`[head_dim / 2]` float32 inverse frequencies, scaled as configured."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
  if scaling.kind == "yarn":
    return _yarn_inverse_frequencies(head_dim, theta, scaling)
  # llama3
  old = scaling.original_max_position_embeddings
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inverse_frequencies(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
  dim = head_dim

  def correction_dim(rotations):
    return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # (as transformers: no zero-width ramp)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = (1 - ramp).astype(np.float32)
  pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
  inv_extrapolation = np.float32(1.0) / pos_freqs
  inv_interpolation = np.float32(1.0) / (np.float32(s.factor) * pos_freqs)
  return (inv_interpolation * (1 - extrapolation)
          + inv_extrapolation * extrapolation).astype(np.float32)


def attention_factor(scaling: RopeScaling | None) -> float:
  """What cos and sin are multiplied by: 1, except under YaRN (its attention
  temperature, `0.1 ln(factor) + 1` by default)."""
  if scaling is None or scaling.kind != "yarn":
    return 1.0
  if scaling.attention_factor is not None:
    return float(scaling.attention_factor)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if scaling.mscale and scaling.mscale_all_dim:
    return float(mscale(scaling.factor, scaling.mscale)
                 / mscale(scaling.factor, scaling.mscale_all_dim))
  return mscale(scaling.factor)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray,
               scale: float = 1.0) -> jax.Array:
  """Rotates queries or keys, half-split convention of Llama/Qwen.

  Args:
    x: `[B, T, N, Dh]` queries or keys.
    positions: `[B, T]` int32 position of each token (pads excluded from the count).
    inv_freq: `[Dh / 2]` inverse frequencies (`inverse_frequencies`).
    scale: multiplies cos and sin (`attention_factor`).

  Returns:
    `x` rotated, same shape and dtype.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
