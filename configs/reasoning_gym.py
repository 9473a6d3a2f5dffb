r"""Asynchronous GRPO on reasoning-gym's procedural tasks.

Commands (`pip install -e ".[reasoning-gym]"` first):

  python -m arl_jax.launch --config=configs/reasoning_gym.py:chain_sum --workdir=/tmp/rg
  python -m arl_jax.launch --config=configs/reasoning_gym.py:chain_sum,gcd:/tmp/smollm2 \
      --config.env.tasks.chain_sum.max_terms=3 --config.env.tasks.gcd.weight=0.5 \
      --workdir=/tmp/rg_smollm2

The argument is `TASK[,TASK...]` (any of reasoning-gym's tasks by name; a
mistyped one is refused with the list), then optionally `:FOLDER` (a Hugging
Face chat model folder, as `configs/smollm2.py` converts; its settings) or
`:tiny` (a few updates of a tiny model, for tests). Each task's own config
keys are under `env.tasks.TASK` at reasoning-gym's defaults, beside its
sampling `weight` (1); `env.size` training questions are split between the
tasks by weight, and `env.heldout_size` held-out questions per task (from
another seed, none of them a training question) are what evaluation scores.
The reward is the task's own scorer on the answer the completion gives
between `<answer>` tags (`env.answer_format`). `--config.env.curriculum.enabled=True`
draws training questions at each task's difficulty level, moved by the
measured reward (keys under `env.curriculum`: window, promote_at, demote_at,
start_level).

Without a folder, the model is a ~0.8M-parameter byte-level decoder with a
supervised warm-up on the reference answers: it shows the data path and the
scorer end to end on 2 CPU cores, not reasoning.
"""

import ml_collections

from arl_jax.config import base_config
from arl_jax.envs import reasoning_gym_env


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  tasks_arg, _, variant = (arg or "").partition(":")
  tasks = [t.strip() for t in tasks_arg.split(",") if t.strip()]
  if not tasks:
    raise ValueError("configs/reasoning_gym.py needs the task names as its argument: "
                     "--config=configs/reasoning_gym.py:chain_sum[,gcd...][:FOLDER|:tiny]")
  config = base_config.make("reasoning_gym")
  # Each task at reasoning-gym's own defaults, so `--config.env.tasks.T.KEY=` reaches its keys
  # (a mistyped task is refused by the environment's config, with the list).
  known = reasoning_gym_env.task_names()
  config.env.tasks = {t: {"weight": 1.0, **(reasoning_gym_env.task_options(t) if t in known
                                             else {})} for t in tasks}
  config.update(num_steps=300, log_every=25, eval_every=100, eval_size=200)
  config.orchestrator.update(batch_size=32, group_size=8, mask_truncated_completions=True)
  if variant and variant != "tiny":
    base_config.use_hf_chat_model(config, variant)
    config.update(num_steps=40, log_every=5, eval_every=10)
    config.model.max_seq_len = 384
    config.sampler.update(num_slots=64, prompt_len=256, max_new_tokens=128)
    config.orchestrator.max_off_policy_steps = 4
    config.learner.update(eps_high=0.28, tis_cap=2.0, num_microbatches=2, lr=1e-5)
    config.checkpoint.update(every_steps=10, keep=2)
    config.warmup.update(steps=0, lr=1e-5)
  else:
    config.model.update(d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                        mlp_dim=384, max_seq_len=320, rope_theta=10_000.0, tie_embeddings=True)
    config.sampler.update(num_slots=64, prompt_len=288, max_new_tokens=32)
    config.warmup.steps = 300
    if variant == "tiny":
      base_config.make_tiny(config, num_steps=3)
      config.env.update(size=64, heldout_size=8)
  config.lock()
  return config
