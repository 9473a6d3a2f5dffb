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

SCALING_KINDS = ("linear", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """A RoPE frequency scaling (Hugging Face `rope_scaling` / `rope_parameters`).

  Attributes:
    kind: `linear` (positions divided by `factor`) or `llama3` (Llama 3.1:
      low frequencies divided by `factor`, high ones kept, a smooth ramp between).
    factor: context extension factor.
    low_freq_factor, high_freq_factor, original_max_position_embeddings: the
      `llama3` ramp (wavelengths above `original / low_freq_factor` are scaled
      fully, below `original / high_freq_factor` not at all).
  """

  kind: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

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


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates queries or keys, half-split convention of Llama/Qwen.

  Args:
    x: `[B, T, N, Dh]` queries or keys.
    positions: `[B, T]` int32 position of each token (pads excluded from the count).
    inv_freq: `[Dh / 2]` inverse frequencies (`inverse_frequencies`).

  Returns:
    `x` rotated, same shape and dtype.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
