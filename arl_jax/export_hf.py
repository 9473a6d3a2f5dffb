r"""Exports a run's params as a Hugging Face folder that `transformers` loads.

  python -m arl_jax.export_hf --checkpoint=/tmp/run/checkpoints \
      --hf_path=/models/Qwen2.5-0.5B-Instruct --out=/tmp/run/hf

`--hf_path` is the folder the run started from (`model.hf_path`): its
`config.json` gives the model's shapes and is the base of the exported one, and
its tokenizer files are copied along, so `--out` is a complete model folder.
The params of the checkpoint's latest step (or `--step`) are written as
safetensors in `--dtype` (float32 or bfloat16; sharded with an index past 5 GiB).
"""

from __future__ import annotations

import os
import shutil

import jax
import numpy as np
from absl import app, flags
from jax.sharding import Mesh

from arl_jax import checkpointing
from arl_jax.models import hf_config, hf_params, init_lib
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


def export(checkpoint_dir: str, hf_path: str, out: str, step: int | None = None,
           dtype: str = "float32") -> int:
  """Writes checkpoint `step`'s params (default: the latest) to `out` in
  `dtype`; returns the step."""
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
  _, abstract = init_lib.abstract_model(cfg)
  shardings = rules_lib.state_shardings(abstract, mesh, rules_lib.LEARNER_RULES)
  params = reader.restore_params(checkpointing.abstract_like(abstract, shardings), step)
  reader.close()
  hf_params.save_params(params, cfg, out, family, base_config=base, dtype=dtype)
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(hf_path, name)):
      shutil.copy(os.path.join(hf_path, name), os.path.join(out, name))
  return step


def main(argv):
  del argv
  step = export(_CHECKPOINT.value, _HF_PATH.value, _OUT.value, _STEP.value, _DTYPE.value)
  print(f"exported step {step} of {_CHECKPOINT.value} to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
