"""Static description of the decoder: sizes and numerics, nothing learned."""

from __future__ import annotations

import dataclasses

from arl_jax.models import lora as lora_lib
from arl_jax.models import rope as rope_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Llama/Qwen-style decoder hyper-parameters (the Llama, Qwen2 and Qwen3
  families: `hf_config.model_config_from_hf` builds one from a `config.json`).

  Attributes:
    vocab_size: V, number of token ids the embedding and the output head cover.
    d_model: D, residual stream width.
    num_layers: number of decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention); divides num_heads.
    head_dim: width of one attention head.
    mlp_dim: hidden width of the SwiGLU feed-forward block.
    max_seq_len: context length the KV cache is allocated for.
    rope_theta: RoPE base frequency.
    rope_scaling: optional RoPE frequency scaling (`rope.RopeScaling`).
    qkv_bias: biases on the query, key and value projections (Qwen2).
    out_bias: a bias on the attention output projection.
    qk_norm: RMSNorm over each query and key head before RoPE (Qwen3).
    norm_eps: RMSNorm epsilon.
    tie_embeddings: reuse the input embedding as the output projection.
    param_dtype: dtype the parameters are stored and computed in.
    value_head: add a scalar value head on the final hidden state (the critic
      of V-trace actor-critic; it shares the trunk with the policy).
    lora: low-rank adapters on the projections (`lora.LoraConfig`; rank 0:
      none). The config's `learner.lora` section.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_seq_len: int
  rope_theta: float = 10_000.0
  rope_scaling: rope_lib.RopeScaling | None = None
  qkv_bias: bool = False
  out_bias: bool = False
  qk_norm: bool = False
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  param_dtype: str = "float32"
  value_head: bool = False
  lora: lora_lib.LoraConfig = lora_lib.OFF

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim", "max_seq_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads={self.num_heads} must be a multiple of "
          f"model.num_kv_heads={self.num_kv_heads} (grouped-query attention)")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim} must be even for RoPE")
    if self.param_dtype not in ("float32", "bfloat16"):
      raise ValueError(f"model.param_dtype must be float32 or bfloat16, got {self.param_dtype!r}")

  @property
  def base_dtype(self) -> str:
    """The frozen base's dtype (the adapters, and a critic's value head that
    trains beside them, keep `param_dtype`)."""
    if self.lora.enabled and self.lora.base_dtype != "auto":
      return self.lora.base_dtype
    return self.param_dtype

  @property
  def base(self) -> ModelConfig:
    """This decoder without adapters, its parameters in `base_dtype`: the
    frozen base a LoRA run loads (and what a Hugging Face folder holds)."""
    return dataclasses.replace(self, lora=lora_lib.OFF, param_dtype=self.base_dtype)

  @property
  def adapter_params(self) -> int:
    """Exact parameter count of the adapters (0 without LoRA)."""
    return lora_lib.num_params(self, self.lora)

  @property
  def trainable_params(self) -> int:
    """Exact count of what trains: every parameter without LoRA; with it the
    adapters and a critic's value head (`lora.TrainsBesideAdapters`)."""
    if not self.lora.enabled:
      return self.num_params
    return self.adapter_params + (self.d_model if self.value_head else 0)

  @property
  def block_params(self) -> int:
    """Exact parameter count of one decoder block."""
    attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    attn += self.qkv_bias * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    attn += self.out_bias * self.d_model + self.qk_norm * 2 * self.head_dim
    return attn + 3 * self.d_model * self.mlp_dim + 2 * self.d_model

  @property
  def num_params(self) -> int:
    """Exact parameter count, used by dry runs and progress lines."""
    head = 0 if self.tie_embeddings else self.d_model * self.vocab_size
    value = self.d_model if self.value_head else 0
    return (self.vocab_size * self.d_model + self.num_layers * self.block_params + self.d_model
            + head + value)
