r"""Asynchronous GRPO on the `tool_agent` lookup task: multi-turn, slow tools.

Command:

  python -m arl_jax.launch --config=configs/tool_agent.py --workdir=/tmp/tool_agent

Each episode is `k37?` -> `[37]` (a tool call; `]` ends the segment) -> the
tool answers `=482;` after a lognormal latency (median 50 ms, p99 0.5 s, capped
at 2 s: the minutes-long tail of real agent tools, scaled down for a CPU) ->
`482<eos>`. While an episode waits on its tool it holds no sampler slot; it is
re-admitted under the newest weights, so its segments carry different policy
versions and the learner corrects each token against its own behaviour
log-prob.

Variants (the `:ARG` after the file name):
  (none)  ~0.5M-parameter decoder, 1000 keys, 100 supervised warm-up steps on
          the ideal episodes of half of the training keys, then 300 steps of
          asynchronous RL (max_async_level=2, K=4, in-flight weight updates).
          Hardware: 2 CPU cores.
  sync    the synchronous on-policy baseline (max_async_level=0, K=0, drain).
  mixed   half the prompts from `tool_agent`, half from `arith` (2-digit
          sums), in one run (`env.name="mixture"`): rewards, errors and drops
          are reported per environment.
  tiny    a few steps of a tiny model, for tests (seconds).

Held-out keys can only be answered by calling the tool and copying its answer,
so evaluation measures whether the agent behaviour generalises.

What to expect (measured on a 2-core CPU, one JAX device, colocated): greedy
reward on 64 held-out keys is 0 at initialisation, 0.81 after the warm-up and
0.86 after 300 RL updates (+-0.04 at this eval size); the mean training reward
rises from 0.88 (first 50 updates) to 0.93 (last 150). Lag is 2 for most
batches, and about 47% of the trained rows hold tokens of two or more policy
versions (`multi_version_fraction`: episodes re-admitted after their tool
answered, or swapped in flight); no tool call timed out. The whole run takes
about 2 minutes (108 and 112 s in two runs). The warm-up
does most of the work here; RL mainly fixes copying slips. A longer warm-up
(400 steps) reached 0.89 before RL, and RL at lr 3e-4 then drifted to 0.80.
"""

import ml_collections

from arl_jax.config import base_config, sweep


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  # Every key not set here is at its default (`base_config.py`; what each key
  # means: the schema's dataclasses, `schema.SECTIONS`).
  config = base_config.make("tool_agent")
  config.update(num_steps=300, log_every=10, eval_every=50, eval_size=64)
  config.model.update(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      mlp_dim=384, max_seq_len=32, rope_theta=10_000.0, tie_embeddings=True)
  # Many workers: each waiting tool call holds one (a blocking call, as in a
  # real agent), and up to (max_async_level + 1) batches of episodes wait at once.
  config.env.update(num_workers=64, timeout_s=10.0, num_keys=1000)
  config.sampler.update(num_slots=64, prompt_len=8, max_new_tokens=24)
  config.orchestrator.update(batch_size=64, group_size=8, max_async_level=2,
                             max_off_policy_steps=4)
  config.learner.lr = 1e-4
  config.warmup.update(steps=100, fraction=0.5)

  if arg == "sync":
    config.orchestrator.max_async_level = 0
    config.orchestrator.max_off_policy_steps = 0
    config.sampler.weight_update = "drain"
  elif arg == "mixed":
    tool = {k: v for k, v in config.env.items() if k not in ("name", "num_workers", "timeout_s")}
    config.env = ml_collections.ConfigDict(dict(
        name="mixture", num_workers=config.env.num_workers, timeout_s=config.env.timeout_s,
        components=dict(tool_agent=dict(weight=0.5, **tool),
                        arith=dict(weight=0.5, max_operand=99, operator="+",
                                   heldout_fraction=0.1))))
  elif arg == "tiny":
    base_config.make_tiny(config, num_steps=6, warmup_steps=60)
    config.env.update(num_workers=32, num_keys=40)
  elif arg:
    raise ValueError(f"configs/tool_agent.py: unknown variant {arg!r}; use '', 'sync', 'mixed' "
                     "or 'tiny'")
  config.lock()
  return config


def get_sweep(arg: str | None = None) -> list[dict]:
  """Synchronous against asynchronous, each with 2 seeds (what
  benchmarks/async_vs_sync.py measures, as separate runs with plots).

    python -m launch.local_sweep --config=configs/tool_agent.py --workdir=/tmp/ta --from_config
  """
  del arg
  return sweep.product(
      sweep.zip_(sweep.axis("orchestrator.max_async_level", [0, 2]),
                 sweep.axis("orchestrator.max_off_policy_steps", [0, 4]),
                 sweep.axis("sampler.weight_update", ["drain", "in_flight"])),
      sweep.axis("seed", [0, 1]))
