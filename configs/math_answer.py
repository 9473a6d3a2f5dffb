r"""Asynchronous GRPO on short math word problems with free-text answers.

Command:

  python -m arl_jax.launch --config=configs/math_answer.py --workdir=/tmp/math_answer

The prompts are the 400 word problems shipped in
`arl_jax/envs/data/math_answer.jsonl` (add, take away, multiply, share; written
by `python -m arl_jax.envs.sample_data`); point `env.path` at any GSM8K-style
JSONL file (`{"prompt": ..., "answer": ...}` per line) to use your own. The
environment extracts the final answer (`#### 42`, `\boxed{42}`, ...) and
compares it numerically.

Variants (the `:ARG` after the file name):
  (none)  ~0.8M-parameter decoder (byte tokens, prompts up to 80 bytes), 300
          supervised warm-up steps on `#### <answer>` for 30% of the training
          problems, then asynchronous RL (max_async_level=1, K=8, in-flight
          weight updates). Hardware: 2 CPU cores.
  sync    the synchronous on-policy baseline (max_async_level=0, K=0, drain).
  tiny    a few steps of a tiny model, for tests (seconds).

A byte-level model this small cannot read these problems; the run shows the
data path and the answer checking end to end, not a math solver. Measured on
a 2-core CPU (one device, colocated; 376 s for the whole run): greedy reward
on 40 held-out problems is 0 at initialisation, 0.025 after the warm-up (the
`#### <number>` format is learned, the arithmetic is not) and 0.025-0.05 over
500 RL updates; the training reward moves from 0.31 (first 50 updates) to
0.33 (last 100), mostly on the problems memorised in the warm-up.
"""

import ml_collections

from arl_jax.config import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Every key not set here is at its default (`base_config.py`; what each key
  # means: the schema's dataclasses, `schema.SECTIONS`).
  # (env.path: the shipped sample, MathAnswerConfig.path)
  config = base_config.make("math_answer")
  config.update(num_steps=500, log_every=25, eval_every=100, eval_size=40)
  config.model.update(d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                      mlp_dim=384, max_seq_len=96, rope_theta=10_000.0, tie_embeddings=True)
  config.sampler.update(num_slots=64, prompt_len=80, prompt_buckets=(48, 64), max_new_tokens=12)
  config.orchestrator.update(batch_size=64, group_size=8)
  config.warmup.steps = 300

  if arg == "sync":
    config.orchestrator.max_async_level = 0
    config.orchestrator.max_off_policy_steps = 0
    config.sampler.weight_update = "drain"
  elif arg == "tiny":
    base_config.make_tiny(config, num_steps=3)
  elif arg:
    raise ValueError(f"configs/math_answer.py: unknown variant {arg!r}; use '', 'sync' or "
                     "'tiny'")
  config.lock()
  return config
