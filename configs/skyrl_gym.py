r"""Asynchronous GRPO on a skyrl-gym text environment.

Commands (`pip install -e ".[skyrl-gym]"` first):

  python -m arl_jax.launch --config=configs/skyrl_gym.py:gsm8k_multi_turn --workdir=/tmp/sg
  python -m arl_jax.launch --config=configs/skyrl_gym.py:gsm8k:/tmp/smollm2 \
      --config.env.path=/data/gsm8k_train.jsonl --workdir=/tmp/sg_smollm2

The argument is `ENV_CLASS` (a skyrl-gym id: `gsm8k`, `gsm8k_multi_turn`,
`aime`, ...; or `module.path:Class` of one's own environment), then
optionally `:FOLDER` (a Hugging Face chat model folder, as
`configs/smollm2.py` converts) or `:tiny` (a few updates of a tiny model, for
tests). Rows come from `env.path` (SkyRL's dataset form, JSONL), or are the
400 word problems shipped for `math_answer` as gsm8k rows. Each episode is
one skyrl-gym environment: every turn the policy ends is stepped with its
text, the environment's observations join the completion as chat turns
(never trained on), the turn rewards add up to the reward
(`arl_jax/envs/skyrl_gym_env.py`).

Without a folder, the model is a ~0.8M-parameter byte-level decoder from
scratch: it shows the multi-turn data path end to end on 2 CPU cores, not
arithmetic.
"""

import os

import ml_collections

from arl_jax.config import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # (`module.path:Class` holds a colon of its own: the variant is what follows the last
  # colon, when it is `tiny` or a folder)
  env_class, variant = arg or "", ""
  head, _, tail = env_class.rpartition(":")
  if head and (tail == "tiny" or "/" in tail or os.path.isdir(tail)):
    env_class, variant = head, tail
  if not env_class:
    raise ValueError("configs/skyrl_gym.py needs the environment as its argument: "
                     "--config=configs/skyrl_gym.py:gsm8k[:FOLDER|:tiny]")
  config = base_config.make("skyrl_gym")
  config.env.env_class = env_class
  config.update(num_steps=300, log_every=25, eval_every=100, eval_size=40)
  config.orchestrator.update(batch_size=32, group_size=8, mask_truncated_completions=True)
  config.warmup.steps = 0  # (skyrl-gym environments know no correct completion)
  if variant and variant != "tiny":
    base_config.use_hf_chat_model(config, variant)
    config.update(num_steps=40, log_every=5, eval_every=10)
    config.model.max_seq_len = 640
    config.sampler.update(num_slots=64, prompt_len=192, max_new_tokens=448)
    config.orchestrator.max_off_policy_steps = 4
    config.learner.update(eps_high=0.28, tis_cap=2.0, num_microbatches=4, lr=1e-5,
                          pack_len=640)
    config.checkpoint.update(every_steps=10, keep=2)
  else:
    config.model.update(d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                        mlp_dim=384, max_seq_len=512, rope_theta=10_000.0, tie_embeddings=True)
    config.sampler.update(num_slots=64, prompt_len=256, max_new_tokens=256)
    if variant == "tiny":
      base_config.make_tiny(config, num_steps=3, warmup_steps=0)
      config.sampler.max_new_tokens = 64
  config.lock()
  return config
