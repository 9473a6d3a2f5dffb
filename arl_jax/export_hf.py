r"""Exports a run's params as a Hugging Face folder that `transformers` loads.

  python -m arl_jax.export_hf --checkpoint=/tmp/run/checkpoints \
      --hf_path=/models/Qwen2.5-0.5B-Instruct --out=/tmp/run/hf

`--hf_path` is the folder the run started from (`model.hf_path`): its
`config.json` gives the model's shapes and is the base of the exported one, and
its tokenizer files are copied along, so `--out` is a complete model folder.
The params of the checkpoint's latest step (or `--step`) are written as
safetensors in `--dtype` (float32 or bfloat16; sharded with an index past 5 GiB).

A LoRA run's checkpoint holds its adapters only: they are merged into the
base read from `--hf_path` (which must be the base they were trained on: its
fingerprint is checked against the checkpoint's), and `--peft_out` also
writes them as a PEFT adapter folder (`models/peft_adapters.py`) that `peft`
loads onto that base.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import numpy as np
from absl import app, flags
from jax.sharding import Mesh

from arl_jax.core import settings
from arl_jax.learner import checkpointing
from arl_jax.models import fingerprint, hf_config, hf_params, init_lib, lora, peft_adapters
from arl_jax.sharding import rules as rules_lib

# Files of a Hugging Face folder that are not weights or config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja")

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a run's checkpoints folder", required=True)
_HF_PATH = flags.DEFINE_string("hf_path", None, "the Hugging Face folder the run started from",
                               required=True)
_OUT = flags.DEFINE_string("out", None, "folder to write", required=True)
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "dtype of the tensors")
_PEFT_OUT = flags.DEFINE_string("peft_out", None, "a LoRA run: also write its adapters as a "
                                "PEFT folder here")


def export(checkpoint_dir: str, hf_path: str, out: str, step: int | None = None,
           dtype: str = "float32", peft_out: str | None = None) -> int:
  """Writes checkpoint `step`'s params (default: the latest) to `out` in
  `dtype` (a LoRA run's merged into its base, and with `peft_out` its
  adapters as a PEFT folder there too); returns the step."""
  base = hf_config.read_config(hf_path)
  where = os.path.join(hf_path, "config.json")
  family = hf_config.family_of(base, where)
  cfg = hf_config.model_config_from_hf(base, where=where)
  if not os.path.isdir(checkpoint_dir):
    raise FileNotFoundError(f"--checkpoint={checkpoint_dir!r}: no such folder")
  reader = checkpointing.Checkpointer(checkpoint_dir, checkpointing.CheckpointConfig())
  step = reader.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"--checkpoint={checkpoint_dir!r}: no checkpoint there")
  # One device is enough: every parameter is gathered to the host to be written anyway.
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  run = reader.read_run(step)
  adapters = _saved_lora(run)
  if adapters.enabled:  # (in the dtype the run trained them in)
    dtype_trained = run.get("config", {}).get("model", {}).get("param_dtype", cfg.param_dtype)
    cfg = dataclasses.replace(cfg, param_dtype=dtype_trained)
    params = _with_adapters(reader, step, run, dataclasses.replace(cfg, lora=adapters), hf_path,
                            mesh)
  elif peft_out:
    raise ValueError(f"--peft_out: {checkpoint_dir} step {step} holds no LoRA adapters (its run "
                     "trained the whole model)")
  else:
    _, abstract = init_lib.abstract_model(cfg)
    shardings = rules_lib.state_shardings(abstract, mesh, rules_lib.LEARNER_RULES)
    params = reader.restore_params(checkpointing.abstract_like(abstract, shardings), step)
  reader.close()
  if adapters.enabled and peft_out:
    peft_adapters.save(params, dataclasses.replace(cfg, lora=adapters), peft_out, hf_path)
  if adapters.enabled:
    params = peft_adapters.merged(params, dataclasses.replace(cfg, lora=adapters))
  hf_params.save_params(params, cfg, out, family, base_config=base, dtype=dtype)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(hf_path, name)):
      shutil.copy(os.path.join(hf_path, name), os.path.join(out, name))
  return step


def _saved_lora(run: dict) -> lora.LoraConfig:
  """The `learner.lora` section of the config a checkpoint's run record saved."""
  section = run.get("config", {}).get("learner", {}).get("lora", {})
  return lora.LoraConfig(**{k: v for k, v in section.items()
                            if k in settings.keys(lora.LoraConfig)})


def _with_adapters(reader, step: int, run: dict, cfg, hf_path: str, mesh):
  """A LoRA checkpoint's adapters beside the base read from `hf_path`,
  which must be the base they were trained on."""
  _, abstract = init_lib.abstract_model(cfg)
  abstract_adapters, _ = lora.split(abstract)
  shardings = rules_lib.state_shardings(abstract_adapters, mesh, rules_lib.LEARNER_RULES)
  adapters = reader.restore_params(checkpointing.abstract_like(abstract_adapters, shardings),
                                   step)
  _, base = hf_params.load_params(hf_path, cfg.base, mesh, rules_lib.LEARNER_RULES)
  # (`cfg` is the Hugging Face folder's: no value head, so a critic's is not
  # restored, and the policy exported has none)
  params = lora.merge(adapters, base)
  trained_on = run.get("base", {})
  if trained_on.get("fingerprint") not in (None, fingerprint.fingerprint(lora.split(params)[1])):
    raise ValueError(f"--hf_path={hf_path} is not the base the adapters of {reader.directory} "
                     f"step {step} were trained on ({trained_on.get('source')})")
  return params


def main(argv):
  del argv
  step = export(_CHECKPOINT.value, _HF_PATH.value, _OUT.value, _STEP.value, _DTYPE.value,
                _PEFT_OUT.value)
  print(f"exported step {step} of {_CHECKPOINT.value} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
