r"""Asynchronous GRPO on HumanEval, each completion scored by running the
problem's tests in a sandbox.

Commands (`pip install -e ".[code]"` first):

  python -m arl_jax.launch --config=configs/humaneval.py --workdir=/tmp/humaneval
  python -m arl_jax.launch --config=configs/humaneval.py:/tmp/smollm2 \
      --config.env.reward=fraction --config.eval_samples=8 --workdir=/tmp/he_smollm2

The argument is optional: a Hugging Face chat model folder (as
`configs/smollm2.py` converts; the model is asked for the function in a
```python block), or `tiny` (a few updates of a tiny model, for tests).

Programs run in the local sandbox (`arl_jax/sandbox`: Linux namespaces, no
network, read-only files but their own directory, CPU, memory, file-size,
process and output limits, a wall limit): keys under `env.sandbox`
(`--config.env.sandbox.wall_s=5`). Where the machine cannot isolate a
program the run refuses to start, unless `env.sandbox.require_isolation=False`;
`env.sandbox.backend=sandbox_fusion` with `env.sandbox.url` sends them to a
SandboxFusion service instead. The reward is `env.reward`: `all_passed`
(default) or `fraction` of the tests; both, and how each program ended
(`passed`, `failed_tests`, `timeout`, ...), are in the step records
(`reward_parts`, `env_outcomes`). Every fourth problem is held out; with
`eval_samples=N` evaluation reports pass@k of the held-out problems.

Without a folder the model is a ~0.8M-parameter byte-level decoder, warmed
up on the canonical solutions of the problems that fit its context
(`env.max_chars`), continuing the bare prompt (`env.prompt_format=
completion`): it shows the sandboxed reward end to end on 2 CPU cores, not
programming.
"""

import ml_collections

from arl_jax.config import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  variant = arg or ""
  config = base_config.make("humaneval")
  config.update(num_steps=300, log_every=25, eval_every=100, eval_size=41)
  config.orchestrator.update(batch_size=32, group_size=8)
  if variant and variant != "tiny":
    base_config.use_hf_chat_model(config, variant)
    config.update(num_steps=40, log_every=5, eval_every=10)
    config.env.update(prompt_format="chat")
    config.model.max_seq_len = 1024
    # (rows of up to 1024 tokens: 16 rollouts an update, in 8 microbatches,
    # keep the learner's activations near 4 GiB; `--dry_run` prints the plan)
    config.sampler.update(num_slots=32, prompt_len=640, max_new_tokens=384)
    config.orchestrator.update(batch_size=16, max_off_policy_steps=4,
                               mask_truncated_completions=True)
    config.learner.update(eps_high=0.28, tis_cap=2.0, num_microbatches=8, lr=1e-5,
                          pack_len=1024)
    config.checkpoint.update(every_steps=10, keep=2)
    config.warmup.update(steps=0, lr=1e-5)
  else:
    # Problems of at most 350 characters with their solution: 22 to train on, 5 held out.
    config.env.update(prompt_format="completion", max_chars=350, reward="fraction")
    config.model.update(d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                        mlp_dim=384, max_seq_len=480, rope_theta=10_000.0, tie_embeddings=True)
    config.sampler.update(num_slots=64, prompt_len=320, max_new_tokens=160)
    config.warmup.steps = 300
    config.eval_size = 5
    if variant == "tiny":
      base_config.make_tiny(config, num_steps=3, eval_size=5)
      config.env.sandbox.update(wall_s=5.0, cpu_s=2)
  config.lock()
  return config
