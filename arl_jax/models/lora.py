"""Low-rank adapters (LoRA, Hu et al. 2021, arXiv:2106.09685) on the decoder's
projections, and the split of a model's params into what trains and what stays.

With `rank` r > 0, a target projection `W` (`[in..., out...]`) computes
`x W + (alpha / r) (x A) B`: `A` `[in..., r]` starts uniform in
+-1/sqrt(fan_in) as PEFT's does (Kaiming-uniform with a = sqrt(5)), `B`
`[r, out...]` at zero, so step 0 is exactly the base model. The adapters are
`LoraParam`s (an `nnx.Param` subclass): `split` filters them out of an
`nnx.State` as the trainable part, the rest (the base) is frozen; without
adapters everything trains (full fine-tuning).

The delta is applied unmerged, by the same module on the learner and the
sampler, so at lag 0 both compute the same log-probabilities.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from arl_jax.core import settings

# The projections that can carry adapters, named as a PEFT user writes them
# (`target_modules`), with the decoder attribute each adapts.
TARGETS = {
    "q_proj": ("attn", "q_proj"),
    "k_proj": ("attn", "k_proj"),
    "v_proj": ("attn", "v_proj"),
    "o_proj": ("attn", "o_proj"),
    "gate_proj": ("mlp", "gate"),
    "up_proj": ("mlp", "up"),
    "down_proj": ("mlp", "down"),
}
_DTYPES = ("auto", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
  """Low-rank adapters (the config's `learner.lora` section).

  Attributes:
    rank: r, the adapters' rank; 0 trains every parameter (full fine-tuning).
    alpha: the adapters' scale is alpha / rank (PEFT's `lora_alpha`).
    targets: the projections that get adapters, by their PEFT names
      (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`,
      `down_proj`), or "all" for every one of them.
    base_dtype: the frozen base's dtype, "float32" or "bfloat16" ("auto":
      `model.param_dtype`, which the adapters always keep).
    init_from: a PEFT LoRA folder (`adapter_config.json`,
      `adapter_model.safetensors`) whose adapters the run starts from, in
      place of fresh ones; its rank, alpha and targets must be these ("":
      fresh adapters, B = 0).
  """

  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                              "down_proj")
  base_dtype: str = "auto"
  init_from: str = ""

  def __post_init__(self):
    settings.check(settings.is_int(self.rank) and self.rank >= 0, "rank",
                   f"must be an int >= 0 (0: full fine-tuning), got {self.rank!r}")
    settings.check(isinstance(self.alpha, (int, float)) and self.alpha > 0, "alpha",
                   f"must be > 0, got {self.alpha!r}")
    targets = (tuple(TARGETS) if self.targets in ("all", ("all",)) else
               (self.targets,) if isinstance(self.targets, str) else tuple(self.targets))
    unknown = [t for t in targets if t not in TARGETS]
    settings.check(not unknown, "targets",
                   f"unknown module(s) {unknown}; known: {list(TARGETS)} or 'all'")
    settings.check(bool(targets), "targets", "names no module")
    object.__setattr__(self, "targets", targets)
    settings.check(self.base_dtype in _DTYPES, "base_dtype",
                   f"must be one of {list(_DTYPES)}, got {self.base_dtype!r}")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def adapts(self, module: str, name: str) -> bool:
    """Whether the decoder's `module`.`name` projection ("attn", "q_proj") has adapters."""
    return self.enabled and any(TARGETS[t] == (module, name) for t in self.targets)


OFF = LoraConfig()


def adapter_name(projection: str) -> str:
  """The decoder attribute holding the adapter of its `projection` attribute
  ("q_proj" -> "q_lora", "gate" -> "gate_lora")."""
  return f"{projection.removesuffix('_proj')}_lora"


class TrainsBesideAdapters(nnx.Param):
  """A parameter a LoRA run trains in full beside its adapters (PEFT's
  `modules_to_save`): the critic's value head, which no Hugging Face base
  has (a run starts it at zero, or from a full fine-tuning checkpoint's
  critic), so no low-rank delta of a frozen weight could stand for it.
  Without adapters it trains as every parameter does."""


class LoraParam(TrainsBesideAdapters):
  """An adapter matrix: the parameters a LoRA run trains."""


class Adapter(nnx.Module):
  """`A` and `B` of one projection whose input dims are `in_shape` and output
  dims `out_shape` (`[D]` -> `[H, Dh]` for q_proj); `in_axes` and
  `out_axes` are their logical axes."""

  def __init__(self, in_shape, out_shape, in_axes, out_axes, rank: int, scale: float,
               dtype, rngs: nnx.Rngs):
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32, -bound, bound)
    self.a = LoraParam(a.astype(dtype), logical_axes=(*in_axes, "lora_rank"))
    self.b = LoraParam(jnp.zeros((rank, *out_shape), dtype),
                       logical_axes=("lora_rank", *out_axes))
    self.scale = scale
    self.in_dims = len(in_shape)

  def __call__(self, x: jax.Array, like: jax.Array) -> jax.Array:
    """The delta `scale (x A) B` for inputs `x` `[B, T, in...]`, in `like`'s dtype."""
    a, b = self.a[...], self.b[...]
    down = jnp.tensordot(x, a.astype(x.dtype), axes=self.in_dims)  # [B, T, r]
    up = jnp.tensordot(down, b.astype(down.dtype), axes=1)
    return (self.scale * up).astype(like.dtype)


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """`(trainable, frozen)` of a model's params: its adapters (and any
  `TrainsBesideAdapters`, a critic's value head) and the base when it has
  adapters, else everything and an empty State."""
  adapters, base = nnx.split_state(params, LoraParam, ...)
  if not jax.tree.leaves(adapters):
    return base, adapters  # (everything, nothing)
  return nnx.split_state(params, TrainsBesideAdapters, ...)


def merge(trainable: nnx.State, frozen: nnx.State) -> nnx.State:
  """The whole params from `split`'s two parts."""
  if not jax.tree.leaves(frozen):
    return trainable
  return nnx.merge_state(frozen, trainable)


def num_params(cfg, lora: LoraConfig) -> int:
  """Exact adapter parameter count of a decoder of `cfg` (a ModelConfig)."""
  if not lora.enabled:
    return 0
  d, h, k, dh, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  sizes = {"q_proj": (d, h * dh), "k_proj": (d, k * dh), "v_proj": (d, k * dh),
           "o_proj": (h * dh, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
  return cfg.num_layers * sum(lora.rank * sum(sizes[t]) for t in lora.targets)
