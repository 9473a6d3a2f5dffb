"""Hugging Face `config.json` <-> `ModelConfig` for the Llama, Qwen2 and Qwen3 families.

Reads both layouts `transformers` has written: `rope_theta` / `rope_scaling`
at the top level (what the published Qwen2.5 and Llama 3 folders hold) and the
`rope_parameters` dict of transformers 5. Anything this decoder cannot run
exactly (another activation, MLP biases, sliding-window attention, partial
rotary, a RoPE type it does not implement, quantised weights) is an error that
names the key, never a silent approximation. So is a missing key or a value of
the wrong JSON type: values are checked, never coerced (`bool("false")` is
True), and errors name the file, the key and the value.
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
      hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise HfConfigError(f"{path}: not JSON: {e}") from e
  if not isinstance(hf, dict):
    raise HfConfigError(f"{path}: must hold a JSON object, got {_describe(hf)}")
  return hf


# Python type -> how an error message names the JSON value that produced it.
_JSON_KINDS = {bool: "a boolean", int: "an integer", float: "a number with a fraction",
               str: "a string", list: "a list", dict: "an object", type(None): "null"}


def _describe(value) -> str:
  """`"false" (a string)`: the value as config.json spells it, and its JSON kind."""
  try:
    text = json.dumps(value)
  except (TypeError, ValueError):
    text = repr(value)
  if len(text) > 60:
    text = text[:57] + "..."
  return f"{text} ({_JSON_KINDS.get(type(value), type(value).__name__)})"


_REQUIRED = object()  # the default of a key that has none


def _get(d: dict, key: str, where: str, default, what: str):
  """`d[key]`, `default` when absent or null; a required key that is absent
  (or null) is an error naming it. `what` names the dict in errors."""
  value = d.get(key)
  if value is None:
    if default is _REQUIRED:
      raise HfConfigError(f"{where}: missing key {key!r}{what}")
    return default, False
  return value, True


def _int(d: dict, key: str, where: str, default=_REQUIRED, what: str = "") -> int:
  """A JSON integer. `bool()`/`int()` would turn `"32"`, `2.7` or `true` into
  a plausible shape; those are errors instead."""
  value, present = _get(d, key, where, default, what)
  # bool is an int subclass in Python, but `true` is not a size.
  if present and (isinstance(value, bool) or not isinstance(value, int)):
    raise HfConfigError(f"{where}: {key}{what} must be an integer, got {_describe(value)}")
  return value


def _float(d: dict, key: str, where: str, default=_REQUIRED, what: str = "") -> float:
  """A JSON number (integer or not), as a float."""
  value, present = _get(d, key, where, default, what)
  if present and (isinstance(value, bool) or not isinstance(value, (int, float))):
    raise HfConfigError(f"{where}: {key}{what} must be a number, got {_describe(value)}")
  return float(value) if present else default


def _bool(d: dict, key: str, where: str, default=_REQUIRED, what: str = "") -> bool:
  """JSON `true` or `false`: `bool("false")` is True, which would import an
  untied checkpoint as tied."""
  value, present = _get(d, key, where, default, what)
  if present and not isinstance(value, bool):
    raise HfConfigError(f"{where}: {key}{what} must be true or false, got {_describe(value)}")
  return value


def _dict(d: dict, key: str, where: str) -> dict:
  """An optional JSON object (`{}` when absent or null)."""
  value = d.get(key)
  if value is None:
    return {}
  if not isinstance(value, dict):
    raise HfConfigError(f"{where}: {key} must be an object, got {_describe(value)}")
  return value


def family_of(hf: dict, where: str = "config.json") -> str:
  architectures = hf.get("architectures") or []
  if not isinstance(architectures, list):
    raise HfConfigError(f"{where}: architectures must be a list, got "
                        f"{_describe(architectures)}")
  arch = architectures[0] if architectures else None
  if arch in ARCHITECTURES:
    return ARCHITECTURES[arch]
  if arch is None and hf.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf["model_type"]]
  raise HfConfigError(f"{where}: architecture {arch or hf.get('model_type')!r} is not "
                      f"supported; supported: {sorted(ARCHITECTURES)}")


def _rope(hf: dict, where: str) -> tuple[float, rope_lib.RopeScaling | None]:
  params = dict(_dict(hf, "rope_parameters", where))
  scaling = _dict(hf, "rope_scaling", where)
  if params and scaling:
    # transformers 5 then reads rope_scaling alone (and drops rope_parameters'
    # rope_theta); neither version writes both.
    raise HfConfigError(f"{where}: both rope_scaling and rope_parameters are set; keep one")
  theta = _float(params, "rope_theta", where, 10_000.0, " (in rope_parameters)")
  if hf.get("rope_theta") is not None:
    top = _float(hf, "rope_theta", where)
    if params.get("rope_theta") is not None and top != theta:
      raise HfConfigError(f"{where}: rope_theta {top} disagrees with rope_parameters' "
                          f"rope_theta {theta}")
    theta = top
  kind = (scaling.get("rope_type") or scaling.get("type")
          or params.get("rope_type") or "default")
  # Names, in errors, the dict the scaling keys were read from.
  what = f" (in {'rope_scaling' if scaling else 'rope_parameters'}, rope type {kind!r})"
  params.update(scaling)
  if hf.get("original_max_position_embeddings") is not None:
    # transformers gives a top-level one priority over the rope keys' (Phi-3's layout).
    params["original_max_position_embeddings"] = _int(hf, "original_max_position_embeddings",
                                                      where)
  # (transformers also reads a top-level one.)
  for d, in_what in ((params, what), (hf, "")):
    partial = _float(d, "partial_rotary_factor", where, 1.0, in_what)
    if partial != 1.0:
      raise HfConfigError(f"{where}: partial_rotary_factor {partial} is not supported")
  if kind == "default":
    return theta, None
  if kind not in rope_lib.SCALING_KINDS:
    raise HfConfigError(f"{where}: rope type {kind!r} is not supported; supported: "
                        f"default, {', '.join(rope_lib.SCALING_KINDS)}")
  fields = {"factor": _float(params, "factor", where, what=what)}
  if kind == "llama3":
    fields.update(low_freq_factor=_float(params, "low_freq_factor", where, what=what),
                  high_freq_factor=_float(params, "high_freq_factor", where, what=what),
                  original_max_position_embeddings=_int(
                      params, "original_max_position_embeddings", where, what=what))
  if kind == "yarn":
    # transformers falls back to the model's own context when the rope keys
    # do not name the pretraining one.
    original = _int(params, "original_max_position_embeddings", where, None, what)
    if original is None:
      if hf.get("max_position_embeddings") is None:
        raise HfConfigError(f"{where}: missing key 'original_max_position_embeddings'{what} "
                            "(nor max_position_embeddings)")
      original = _int(hf, "max_position_embeddings", where)
    fields["original_max_position_embeddings"] = original
    for name in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
      if params.get(name) is not None:
        fields[name] = _float(params, name, where, what=what)
    fields["truncate"] = _bool(params, "truncate", where, True, what)
  try:
    return theta, rope_lib.RopeScaling(kind=kind, **fields)
  except ValueError as e:
    raise HfConfigError(f"{where}: {e}") from e


def model_config_from_hf(hf: dict, *, param_dtype: str = "float32",
                         max_seq_len: int | None = None, value_head: bool = False,
                         where: str = "config.json") -> model_config_lib.ModelConfig:
  """The decoder a Hugging Face config describes.

  Every value is checked for its JSON type, never coerced: `"false"` is not
  false, `"32"` and `2.7` are not layer counts.

  Args:
    hf: the parsed `config.json`.
    param_dtype: what the learner stores and computes in (`float32` or
      `bfloat16`, whatever the checkpoint's dtype).
    max_seq_len: the context the run needs (default: the model's
      `max_position_embeddings`).
    value_head: add a (zero-initialised) value head.
    where: names the file in errors.

  Raises:
    HfConfigError: a missing key, a value of the wrong type, or an option this
      decoder cannot run exactly (named, with `where`).
  """
  family = family_of(hf, where)
  quantization = hf.get("quantization_config")
  if quantization:
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    raise HfConfigError(f"{where}: quantised checkpoints are not supported ({method})")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise HfConfigError(f"{where}: hidden_act {act!r} is not supported (SwiGLU needs 'silu')")
  if _bool(hf, "mlp_bias", where, False):
    raise HfConfigError(f"{where}: mlp_bias=true is not supported")
  if _bool(hf, "use_sliding_window", where, False):
    raise HfConfigError(f"{where}: use_sliding_window=true is not supported")
  theta, scaling = _rope(hf, where)
  heads = _int(hf, "num_attention_heads", where)
  d_model = _int(hf, "hidden_size", where)
  attention_bias = _bool(hf, "attention_bias", where, False)
  return model_config_lib.ModelConfig(
      vocab_size=_int(hf, "vocab_size", where), d_model=d_model,
      num_layers=_int(hf, "num_hidden_layers", where), num_heads=heads,
      num_kv_heads=_int(hf, "num_key_value_heads", where, heads),
      head_dim=_int(hf, "head_dim", where, d_model // heads if heads else 0),
      mlp_dim=_int(hf, "intermediate_size", where),
      max_seq_len=int(max_seq_len or _int(hf, "max_position_embeddings", where, 2048)),
      rope_theta=theta, rope_scaling=scaling,
      norm_eps=_float(hf, "rms_norm_eps", where, 1e-6),
      tie_embeddings=_bool(hf, "tie_word_embeddings", where, False),
      qkv_bias=family == "qwen2" or attention_bias, out_bias=attention_bias,
      qk_norm=family == "qwen3", param_dtype=param_dtype, value_head=value_head)


def hf_config_from_model(cfg: model_config_lib.ModelConfig, family: str,
                         base: dict | None = None) -> dict:
  """The `config.json` of an export: `base` (the imported folder's config)
  with the shapes and RoPE of `cfg`, or a fresh config of `family`. Either way
  it reads back (`model_config_from_hf`) as `cfg`'s RoPE."""
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
  _write_rope(hf, cfg.rope_theta, cfg.rope_scaling)
  hf.pop("torch_dtype", None)
  return hf


def _hf_scaling(s: rope_lib.RopeScaling) -> dict:
  """`s` as the keys of a Hugging Face `rope_scaling` / `rope_parameters`."""
  keys = {"rope_type": s.kind, "factor": s.factor}
  if s.kind == "llama3":
    keys.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings)
  if s.kind == "yarn":
    keys.update(original_max_position_embeddings=s.original_max_position_embeddings,
                beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate,
                **{k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                   if getattr(s, k) is not None})
  return keys


def _write_rope(hf: dict, theta: float, scaling: rope_lib.RopeScaling | None):
  """Makes `hf`'s RoPE keys say `theta` and `scaling`, in the layout `hf`
  already uses (`rope_parameters` of transformers 5, else top-level
  `rope_theta` / `rope_scaling`). A base whose scaling already reads as
  `scaling` keeps its own spelling of it."""
  hf.pop("original_max_position_embeddings", None)  # (would override the written one)
  layout_5 = bool(hf.get("rope_parameters")) and not hf.get("rope_scaling")
  if layout_5:
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": theta}
    if "rope_theta" in hf:  # (a base may spell it in both places)
      hf["rope_theta"] = theta
  else:
    hf["rope_theta"] = theta
    hf.pop("rope_parameters", None)
  try:
    written = _rope(hf, "config.json")[1]
  except HfConfigError:  # a base spelling this decoder does not read: replaced below
    written = object()
  if written == scaling:
    return
  keys = {"rope_type": "default"} if scaling is None else _hf_scaling(scaling)
  if layout_5:
    hf["rope_parameters"] = {"rope_theta": theta, **keys}
  else:
    hf["rope_scaling"] = None if scaling is None else keys
