"""Hugging Face `config.json` <-> `ModelConfig` for the Llama, Qwen2 and Qwen3 families.

Reads both layouts `transformers` has written: `rope_theta` / `rope_scaling`
at the top level (what the published Qwen2.5 and Llama 3 folders hold) and the
`rope_parameters` dict of transformers 5. Anything this decoder cannot run
exactly (another activation, MLP biases, sliding-window attention, partial
rotary, a RoPE type it does not implement, quantised weights) is an error that
names the key, never a silent approximation.
"""

from __future__ import annotations

import json
import os

from arl_jax.models import model_config as model_config_lib
from arl_jax.models import rope as rope_lib

# `architectures[0]` -> family.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class HfConfigError(ValueError):
  """A Hugging Face folder or config this code cannot import exactly."""


def read_config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no such file (a Hugging Face model folder holds "
                            "config.json and *.safetensors)")
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise HfConfigError(f"{path}: not JSON: {e}") from e


def family_of(hf: dict, where: str = "config.json") -> str:
  architectures = hf.get("architectures") or []
  arch = architectures[0] if architectures else None
  if arch in ARCHITECTURES:
    return ARCHITECTURES[arch]
  if arch is None and hf.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf["model_type"]]
  raise HfConfigError(f"{where}: architecture {arch or hf.get('model_type')!r} is not "
                      f"supported; supported: {sorted(ARCHITECTURES)}")


def _rope(hf: dict, where: str) -> tuple[float, rope_lib.RopeScaling | None]:
  params = dict(hf.get("rope_parameters") or {})
  scaling = hf.get("rope_scaling") or {}
  theta = hf.get("rope_theta", params.get("rope_theta", 10_000.0))
  kind = (scaling.get("rope_type") or scaling.get("type")
          or params.get("rope_type") or "default")
  if scaling:
    params.update(scaling)
  if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
    raise HfConfigError(f"{where}: partial_rotary_factor "
                        f"{params['partial_rotary_factor']} is not supported")
  if kind == "default":
    return float(theta), None
  if kind not in rope_lib.SCALING_KINDS:
    raise HfConfigError(f"{where}: rope type {kind!r} is not supported; supported: "
                        f"default, {', '.join(rope_lib.SCALING_KINDS)}")
  fields = {"factor": float(params["factor"])}
  if kind == "llama3":
    fields.update(low_freq_factor=float(params["low_freq_factor"]),
                  high_freq_factor=float(params["high_freq_factor"]),
                  original_max_position_embeddings=int(
                      params["original_max_position_embeddings"]))
  if kind == "yarn":
    fields["original_max_position_embeddings"] = int(
        params.get("original_max_position_embeddings") or hf["max_position_embeddings"])
    for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
      if params.get(name) is not None:
        fields[name] = float(params[name])
    fields["truncate"] = bool(params.get("truncate", True))
  try:
    return float(theta), rope_lib.RopeScaling(kind=kind, **fields)
  except ValueError as e:
    raise HfConfigError(f"{where}: {e}") from e


def model_config_from_hf(hf: dict, *, param_dtype: str = "float32",
                         max_seq_len: int | None = None, value_head: bool = False,
                         where: str = "config.json") -> model_config_lib.ModelConfig:
  """The decoder a Hugging Face config describes.

  Args:
    hf: the parsed `config.json`.
    param_dtype: what the learner stores and computes in (`float32` or
      `bfloat16`, whatever the checkpoint's dtype).
    max_seq_len: the context the run needs (default: the model's
      `max_position_embeddings`).
    value_head: add a (zero-initialised) value head.
    where: names the file in errors.
  """
  family = family_of(hf, where)
  if hf.get("quantization_config"):
    raise HfConfigError(f"{where}: quantised checkpoints are not supported "
                        f"({hf['quantization_config'].get('quant_method', '?')})")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise HfConfigError(f"{where}: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
  if hf.get("mlp_bias"):
    raise HfConfigError(f"{where}: mlp_bias=true is not supported")
  if hf.get("use_sliding_window"):
    raise HfConfigError(f"{where}: use_sliding_window=true is not supported")
  theta, scaling = _rope(hf, where)
  heads = int(hf["num_attention_heads"])
  attention_bias = bool(hf.get("attention_bias", False))
  try:
    return model_config_lib.ModelConfig(
        vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        mlp_dim=int(hf["intermediate_size"]),
        max_seq_len=int(max_seq_len or hf.get("max_position_embeddings", 2048)),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias, out_bias=attention_bias,
        qk_norm=family == "qwen3", param_dtype=param_dtype, value_head=value_head)
  except KeyError as e:
    raise HfConfigError(f"{where}: missing key {e.args[0]!r}") from e


def hf_config_from_model(cfg: model_config_lib.ModelConfig, family: str,
                         base: dict | None = None) -> dict:
  """The `config.json` of an export: `base` (the imported folder's config)
  with the shapes of `cfg`, or a fresh config of `family`."""
  arch = {v: k for k, v in ARCHITECTURES.items()}[family]
  hf = dict(base or {})
  hf.update({
      "architectures": [arch], "model_type": family, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "hidden_act": "silu", "dtype": "float32",
  })
  hf.setdefault("max_position_embeddings", cfg.max_seq_len)
  if family != "qwen2":
    hf["attention_bias"] = cfg.qkv_bias
  if "rope_theta" in hf or not hf.get("rope_parameters"):
    hf["rope_theta"] = cfg.rope_theta
  if hf.get("rope_parameters"):
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": cfg.rope_theta}
  if base is None and cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    hf["rope_scaling"] = {"rope_type": s.kind, "factor": s.factor}
    if s.kind == "llama3":
      hf["rope_scaling"].update(
          low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
          original_max_position_embeddings=s.original_max_position_embeddings)
    if s.kind == "yarn":
      hf["rope_scaling"].update(
          original_max_position_embeddings=s.original_max_position_embeddings,
          beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate,
          **{k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
             if getattr(s, k) is not None})
  hf.pop("torch_dtype", None)
  return hf
