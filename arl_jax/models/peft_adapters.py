"""LoRA adapters as PEFT writes and reads them, and adapters merged into their base.

A PEFT LoRA folder holds `adapter_config.json` (`r`, `lora_alpha`,
`target_modules`, ...) and `adapter_model.safetensors`, one pair of tensors
per adapted `torch.nn.Linear`: `<module>.lora_A.weight` `[r, in_features]`
and `<module>.lora_B.weight` `[out_features, r]`, under
`base_model.model.model.layers.<i>.<self_attn|mlp>.<name>`. Ours
(`models/lora.py`) keep the decoder's head layout (`A` `[D, r]` and `B`
`[r, H, Dh]` for q_proj; `A` `[H, Dh, r]` for o_proj), flattened here the way
`hf_params` flattens the base's heads, so `peft` applies them onto the
Hugging Face base to the same logits.
"""

from __future__ import annotations

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arl_jax.models import hf_config, hf_params, init_lib, lora
from arl_jax.models import model_config as model_config_lib
from arl_jax.sharding import rules as rules_lib

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
_SUBMODULE = {"attn": "self_attn", "mlp": "mlp"}


def _paths(cfg: model_config_lib.ModelConfig):
  """`(layer, target, PEFT module name, adapter path in the State)` of every adapter."""
  for i in range(cfg.num_layers):
    for target in cfg.lora.targets:
      module, name = lora.TARGETS[target]
      yield (i, target, f"{_PREFIX}.{i}.{_SUBMODULE[module]}.{target}",
             ("blocks", i, module, lora.adapter_name(name)))


def _leaves(state) -> dict[tuple, jax.Array]:
  return {hf_params.state_path(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def merged(params, cfg: model_config_lib.ModelConfig):
  """The base's params with every adapter folded in (`W + (alpha / r) A B`),
  laid out as a decoder without adapters (`cfg.base`): what a merged
  Hugging Face export writes. (A critic's value head, trained beside the
  adapters, stays as it is.)"""
  adapters, base = nnx.split_state(params, lora.LoraParam, ...)
  leaves, deltas = _leaves(adapters), {}
  for _, target, _, path in _paths(cfg):
    a, b = leaves[(*path, "a")], leaves[(*path, "b")]
    deltas[(*path[:3], lora.TARGETS[target][1])] = cfg.lora.scale * jnp.tensordot(
        a.astype(jnp.float32), b.astype(jnp.float32), axes=1)

  def fold(path, w):
    delta = deltas.get(hf_params.state_path(path))
    return w if delta is None else (w.astype(jnp.float32) + delta).astype(w.dtype)

  return jax.tree_util.tree_map_with_path(fold, base)


def save(params, cfg: model_config_lib.ModelConfig, folder: str, base_model: str = "") -> None:
  """Writes the adapters of `params` as a PEFT LoRA folder (float32 tensors);
  `base_model`: the base's Hugging Face folder or hub name, recorded as PEFT's
  `base_model_name_or_path`."""
  adapters = _leaves(lora.split(params)[0])
  tensors = {}
  for _, _, name, path in _paths(cfg):
    a = np.asarray(jax.device_get(adapters[(*path, "a")]), np.float32)
    b = np.asarray(jax.device_get(adapters[(*path, "b")]), np.float32)
    rank = cfg.lora.rank
    tensors[f"{name}.lora_A.weight"] = a.reshape(-1, rank).T
    tensors[f"{name}.lora_B.weight"] = b.reshape(rank, -1).T
  os.makedirs(folder, exist_ok=True)
  _write_safetensors(os.path.join(folder, WEIGHTS_FILE), tensors)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank,
            "lora_alpha": cfg.lora.alpha, "target_modules": sorted(cfg.lora.targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": base_model or None}
  with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)


def read_config(folder: str) -> lora.LoraConfig:
  """The `LoraConfig` a PEFT folder's `adapter_config.json` describes.

  Raises:
    hf_config.HfConfigError: naming the file, for what these adapters are not
      (another PEFT type, biases, DoRA, rsLoRA, per-module ranks, unknown
      modules).
  """
  path = os.path.join(folder, CONFIG_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except OSError as e:
    raise FileNotFoundError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder?)") from e
  except json.JSONDecodeError as e:
    raise hf_config.HfConfigError(f"{path}: not JSON ({e})") from e
  unsupported = {"peft_type": ("LORA",), "bias": ("none",), "use_dora": (False, None),
                 "use_rslora": (False, None), "fan_in_fan_out": (False, None),
                 "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
                 "modules_to_save": (None, [])}
  for key, allowed in unsupported.items():
    if config.get(key, allowed[0]) not in allowed:
      raise hf_config.HfConfigError(f"{path}: {key}={config[key]!r} is not supported "
                                    f"(only {allowed[0]!r})")
  targets = config.get("target_modules")
  targets = [targets] if isinstance(targets, str) else list(targets or ())
  try:
    return lora.LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                           targets=tuple(targets))
  except (KeyError, ValueError, TypeError) as e:
    raise hf_config.HfConfigError(f"{path}: {e}") from e


def check_matches(folder: str, mine: lora.LoraConfig) -> None:
  """Raises (naming both) unless the PEFT folder's adapters are `mine`'s
  shape: rank, alpha and targets."""
  saved = read_config(folder)
  if (saved.rank, saved.alpha, sorted(saved.targets)) != (mine.rank, mine.alpha,
                                                          sorted(mine.targets)):
    raise hf_config.HfConfigError(
        f"{folder}/{CONFIG_FILE}: rank {saved.rank}, alpha {saved.alpha}, targets "
        f"{sorted(saved.targets)}; the config's learner.lora has rank {mine.rank}, alpha "
        f"{mine.alpha}, targets {sorted(mine.targets)}")


def load(folder: str, cfg: model_config_lib.ModelConfig, mesh, rules):
  """The adapters of a PEFT folder as an adapter State of a decoder of `cfg`
  (whose `lora` must be the folder's: rank, alpha and targets), on `mesh`:
  the adapters only (a critic's value head, which trains beside them, is
  not in a PEFT folder: `start.initial_params` takes the base's).

  Raises:
    hf_config.HfConfigError: a folder for other adapters (named), a tensor
      missing or of another shape.
  """
  check_matches(folder, cfg.lora)
  source = hf_params.SafetensorsFolder(folder, WEIGHTS_FILE)
  _, abstract = init_lib.abstract_model(cfg)
  adapters, _ = nnx.split_state(abstract, lora.LoraParam, ...)
  shardings = rules_lib.state_shardings(adapters, mesh, rules)
  wanted = {}  # (both PEFT matrices are ours transposed, then shaped: save's inverse)
  for _, _, name, path in _paths(cfg):
    wanted[(*path, "a")] = f"{name}.lora_A.weight"
    wanted[(*path, "b")] = f"{name}.lora_B.weight"
  dtype = jnp.dtype(cfg.param_dtype)

  def read(path, leaf, sharding):
    name = wanted[hf_params.state_path(path)]
    if name not in source.files:
      raise hf_config.HfConfigError(f"{folder}/{WEIGHTS_FILE}: no tensor {name}")
    w = source.read(name)
    if w.size != int(np.prod(leaf.shape)) or w.ndim != 2:
      raise hf_config.HfConfigError(f"{folder}/{WEIGHTS_FILE}: {name} has shape "
                                    f"{tuple(w.shape)}, expected {leaf.shape} flattened")
    value = np.asarray(w, np.float32).T.reshape(leaf.shape).astype(dtype)
    return jax.device_put(value, sharding)

  return jax.tree_util.tree_map_with_path(read, adapters, shardings)


def _write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """A float32 safetensors file of `tensors` (the format: an 8-byte header
  length, a JSON header padded to 8 bytes, the tensors' bytes)."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, value in tensors.items():
    header[name] = {"dtype": "F32", "shape": list(value.shape),
                    "data_offsets": [offset, offset + value.nbytes]}
    offset += value.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob)
    for value in tensors.values():
      f.write(np.ascontiguousarray(value, np.float32).tobytes())
