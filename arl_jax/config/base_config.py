"""The base every experiment config derives from.

`make(env)` is a ConfigDict with every section and every key the schema
(`schema.SECTIONS`) declares with a default, at that default, and
the environment's own keys at theirs. A config file states what differs:

  config = base_config.make("arith")
  config.num_steps = 3000
  config.sampler.update(num_slots=128, prompt_len=8, max_new_tokens=5)

so a key added to the schema reaches every config, and `--config.KEY=...`,
with its default, without touching them. Keys without a default (the
model's shape, the batch, the prompt length) are the config's to give.

`make_tiny(config, ...)` turns any config into its `tiny` variant (a few
updates of a tiny model, seconds on a CPU), the one the tests run; its model
is `TINY_MODEL`, which the benchmarks' tiny rows use too.
"""

from __future__ import annotations

import ml_collections

from arl_jax.config import schema
from arl_jax.core import settings
from arl_jax.envs import registry


def make(env: str) -> ml_collections.ConfigDict:
  """An unlocked ConfigDict of the schema's defaults, with environment `env`
  (a name of `registry.ENVS`) at its config class's defaults.

  Raises:
    ValueError: for an unknown environment, naming the known ones.
  """
  if env not in registry.ENVS:
    raise ValueError(f"unknown environment {env!r}; known: {sorted(registry.ENVS)}")
  config = ml_collections.ConfigDict(settings.defaults(schema.RunSection))
  for name, classes in schema.SECTIONS.items():
    section = {}
    for cls in classes:
      section.update(settings.defaults(cls))
    if name == "env":
      section.update(name=env, **settings.defaults(registry.ENVS[env].config_cls))
    parent, _, key = name.rpartition(".")  # (`learner.lora`: inside `learner`)
    (config[parent] if parent else config)[key] = ml_collections.ConfigDict(section)
  return config


# The tiny decoder of every config's `tiny` variant and of the benchmarks'
# tiny rows (with the config's vocabulary and context length).
TINY_MODEL = dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                  mlp_dim=64)


def make_tiny(config: ml_collections.ConfigDict, *, num_steps: int, eval_every: int = 3,
              eval_size: int = 8, num_slots: int = 16, batch_size: int = 16,
              warmup_steps: int = 2) -> None:
  """Shrinks `config` in place to a tiny variant: `TINY_MODEL`, groups of 4,
  `num_steps` updates, a progress line each, no checkpoints (tests save when
  they test it), the sampler compiling on first use (a few updates: a late
  compile cannot stall them) and one decode step a call (tests time their
  waits by decode steps; tests/sampler covers bursts)."""
  config.update(num_steps=num_steps, log_every=1, eval_every=eval_every, eval_size=eval_size)
  config.model.update(TINY_MODEL)
  config.sampler.update(precompile=False, decode_burst=1, num_slots=num_slots)
  config.orchestrator.update(batch_size=batch_size, group_size=4)
  config.checkpoint.update(every_steps=0, save_final=False)
  config.warmup.update(steps=warmup_steps, batch_size=16)


def use_hf_chat_model(config: ml_collections.ConfigDict, folder: str) -> None:
  """Points `config` at a Hugging Face chat model folder (a small one, as
  SmolLM2-135M-Instruct), with what a 2-core CPU run of it needs: shapes and
  weights from the folder, its tokenizer, special tokens and chat template,
  logits scored in chunks, rollouts packed into learner rows."""
  # Shapes and starting weights from the folder's config.json and safetensors.
  config.model.hf_path = folder
  # Special tokens and the chat template from the folder's tokenizer_config.json
  # (<|im_end|> ends a turn; the template's default system turn is rendered).
  config.tokenizer.update(kind="hf", path=folder, eos_token="auto", bos_token="auto",
                          pad_token="auto", chat_template="auto")
  config.learner.update(
      # Tokens whose float32 logits (49,152 wide) exist at once when scoring.
      logprob_chunk=1024,
      # Rollouts packed several to a learner row of up to this many tokens.
      pack_len=512, attention="auto")
