r"""Asynchronous GRPO on 2-digit addition, sized for a 2-core CPU.

Command:

  python -m arl_jax.launch --config=configs/arith.py --workdir=/tmp/arith

Variants (the `:ARG` after the file name):
  (none)  the default run: ~0.5M-parameter Llama-style decoder, 200 supervised
          warm-up steps on the correct answers of 30% of the training pairs,
          then asynchronous RL (max_async_level=1, K=8, in-flight weight
          updates) with groups of 8. Hardware: 2 CPU cores.
  sync    the same run as the synchronous on-policy baseline
          (max_async_level=0, K=0, drain).
  tiny    a few steps of a tiny model, for tests (seconds).
  accelerator  for a TPU or GPU runtime (the quickstart notebook picks it
          there): 3-digit sums, a ~25M-parameter decoder, disaggregated
          learner and sampler meshes (half the devices each), batches of 512
          rollouts. Planned with `--dry_run --dry_run_devices=8` in the tests;
          its learning and speed were not measured on an accelerator here.

Why the warm-up: a model trained from scratch almost never samples a correct
sum, so RL would have no signal. The warm-up teaches the answer on a subset of
the pairs; RL then has to generalise to the rest (docs/jax_notes.md: a warm-up on
the answer format alone made RL collapse onto one answer).

What to expect (measured on a 2-core CPU, one JAX device, so learner and
sampler are colocated): greedy exact-match accuracy on 300 held-out pairs is 0
at initialisation, 0.18 after the warm-up, 0.51 after 500 RL updates, 0.78
after 1000 and 0.90 after 3000; the whole run (warm-up included) takes about
4 minutes (226 s measured, 3:48 wall with start-up) and ~0.9 GB of host
memory. Lag is 1 for most batches (max_async_level=1), 0 for the rest.
"""

import ml_collections

from arl_jax.config import base_config, sweep


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Every key not set here is at its default (`base_config.py`; what each key
  # means: the schema's dataclasses, `schema.SECTIONS`).
  config = base_config.make("arith")
  config.update(num_steps=3000, log_every=100, eval_every=250, eval_size=300)
  config.model.update(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      mlp_dim=384, max_seq_len=32, rope_theta=10_000.0, tie_embeddings=True)
  config.sampler.update(num_slots=128, prompt_len=8, max_new_tokens=5)
  config.orchestrator.update(batch_size=128, group_size=8)
  # Learner checkpoints in <workdir>/checkpoints every 500 updates, and when the
  # run ends or is stopped (SIGTERM, Ctrl-C), so the same command resumes it.
  config.checkpoint.every_steps = 500
  config.warmup.steps = 200

  if arg == "sync":
    config.orchestrator.max_async_level = 0
    config.orchestrator.max_off_policy_steps = 0
    config.sampler.weight_update = "drain"
  elif arg == "tiny":
    base_config.make_tiny(config, num_steps=4, eval_every=2, eval_size=16, num_slots=32,
                          batch_size=32)
    config.log_every = 100
    config.env.max_operand = 9
    config.sampler.update(prompt_len=6, max_new_tokens=3)
  elif arg == "accelerator":
    config.mesh.placement = "disaggregated"
    config.model.update(d_model=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                        mlp_dim=1536)
    config.env.max_operand = 999
    config.sampler.update(num_slots=512, prompt_len=10, max_new_tokens=6)
    config.orchestrator.update(batch_size=512, group_size=8)
    config.warmup.update(steps=300, batch_size=256)
    config.num_steps = 1000
  elif arg:
    raise ValueError(f"configs/arith.py: unknown variant {arg!r}; use '', 'sync', 'tiny' or "
                     "'accelerator'")
  config.lock()
  return config


def get_sweep(arg: str | None = None) -> list[dict]:
  """How much lag arith tolerates: K (with max_async_level = K) x 2 seeds.

    python -m launch.local_sweep --config=configs/arith.py --workdir=/tmp/k --from_config
  """
  del arg  # the same sweep for every variant
  return sweep.product(
      sweep.zip_(sweep.axis("orchestrator.max_off_policy_steps", [0, 2, 8]),
                 sweep.axis("orchestrator.max_async_level", [0, 2, 8]),
                 sweep.axis("sampler.weight_update", ["drain", "in_flight", "in_flight"])),
      sweep.axis("seed", [0, 1]))
