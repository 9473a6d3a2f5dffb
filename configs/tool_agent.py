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

from arl_jax import sweep


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.num_steps = 300
  config.log_every = 10
  config.eval_every = 50
  config.eval_size = 64
  # Metric sinks: JSON lines always; "jsonl,tensorboard" adds TensorBoard event files.
  config.writers = "jsonl"
  config.compilation_cache = "auto"  # (~/.cache/arl_jax/jit; "": off)

  config.model = ml_collections.ConfigDict(dict(
      d_model=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
      max_seq_len=32, rope_theta=10_000.0, tie_embeddings=True, param_dtype="float32",
      value_head=False))

  config.mesh = ml_collections.ConfigDict(dict(
      placement="auto", learner_devices=-1,
      learner=(("fsdp", -1), ("tp", 1)), sampler=(("data", -1), ("tp", 1))))

  # Many workers: each waiting tool call holds one (a blocking call, as in a
  # real agent), and up to (max_async_level + 1) batches of episodes wait at once.
  config.env = ml_collections.ConfigDict(dict(
      name="tool_agent", num_workers=64, timeout_s=10.0, num_keys=1000, max_value=999,
      table_seed=0, heldout_fraction=0.1, max_calls=2, latency_median_s=0.05,
      latency_p99_s=0.5, latency_max_s=2.0))

  config.sampler = ml_collections.ConfigDict(dict(
      num_slots=64, prompt_len=8, prompt_buckets=(), max_new_tokens=24, temperature=1.0,
      top_k=0, top_p=1.0, weight_update="in_flight", kv_policy="keep", param_dtype="float32",
      # Compile every program shape the engine can use when it starts, so that no
      # rare batch shape compiles late in a long run.
      precompile=True,
      # KV cache: "dense" (slot x full length), "paged" (pages of page_size
      # columns from a pool of kv_pages, 0: every slot at full length; or of
      # kv_memory_fraction of a sampler device's memory, 0: off) or "auto"
      # (paged from 1,024 columns a slot; the header says what was chosen).
      kv_cache="auto", page_size=16, kv_pages=0, kv_memory_fraction=0.0,
      # One prefill per group: its samples start from it (share the prompt pages).
      share_prompts=True,
      # Decode steps per device call while nothing waits between them (0: auto,
      # 4 where a decode step is estimated under a host round trip).
      decode_burst=0,
      # Contexts longer than this are prefilled a chunk per engine iteration,
      # between decode steps of the other slots (0: in one call).
      prefill_chunk=0,
      # Paged decode attention: "xla", "pallas" (JAX's GPU paged attention kernel) or
      # "ragged" (JAX's TPU ragged paged attention kernel).
      paged_attention="xla"))

  config.orchestrator = ml_collections.ConfigDict(dict(
      batch_size=64, group_size=8, max_async_level=2, max_off_policy_steps=4,
      staleness_reference="dispatch", assembly="fifo", window_fraction=0.3,
      requeue_dropped=0, mask_truncated_completions=False))

  config.learner = ml_collections.ConfigDict(dict(
      loss="clipped_ratio", eps_low=0.2, eps_high=0.2, dual_clip=0.0, rho_bar=1.0, c_bar=1.0,
      lam=1.0, vf_coef=0.5, tau=0.04,
      tis_cap=0.0, age_decay=0.0, decoupled=False, aggregation="token_mean", kl_coef=0.0,
      entropy_coef=0.0, advantage="grpo", num_epochs=1, num_minibatches=1, num_microbatches=1,
      lr=1e-4, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
      # Tokens whose float32 logits exist at once when scoring (0: all of a
      # microbatch); at a large vocabulary they dominate the learner's memory.
      logprob_chunk=0,
      # Rollouts packed several to a learner row of up to this many tokens
      # (0: one rollout a row, padded to the batch's longest): packing.py.
      pack_len=0,
      # Queries whose attention scores exist at once (0: a row's), what the
      # backward pass keeps of each block (none | block | dots), and the
      # blocks as one lax.scan (a block's scratch once, not per layer).
      attention_chunk=0, remat="none", scan_layers=False))

  # `hf`: a local tokenizer.json (path, eos_token, ...); see README "Tokenizers".
  config.tokenizer = ml_collections.ConfigDict(dict(
      kind="byte", path="", eos_token="", bos_token="", pad_token="", chat_template="none"))

  # Prompts: "" uses the environment's own; JSONL schema in the README.
  config.data = ml_collections.ConfigDict(dict(train_path="", heldout_path="",
                                               on_malformed="error", num_epochs=0))

  # Learner checkpoints in <workdir>/checkpoints: every N updates (0: none) and
  # when the run ends or is stopped (SIGTERM, Ctrl-C), so the same command resumes
  # it; see README "Checkpoints".
  config.checkpoint = ml_collections.ConfigDict(dict(every_steps=0, keep=3, save_final=True,
                                                     resume_from="",
                                                     init_from=""))
  # Sampling in separate processes that join over the network (README "Sampler
  # processes"): python -m arl_jax.distributed.sampler_worker --learner=ADDRESS.
  config.fleet = ml_collections.ConfigDict(dict(remote=False, host="127.0.0.1", port=0,
                                                heartbeat_s=0.5, timeout_s=20.0))

  config.warmup = ml_collections.ConfigDict(dict(steps=100, batch_size=64, lr=1e-3,
                                                 fraction=0.5))

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
    config.sampler.precompile = False  # (a few updates: a late compile cannot stall them)
    config.checkpoint.update(every_steps=0, save_final=False)  # (tests save when they test it)
    # (Tests time their waits by decode steps; tests/sampler covers bursts.)
    config.sampler.decode_burst = 1
    config.num_steps = 6
    config.log_every = 1
    config.eval_every = 3
    config.eval_size = 8
    config.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                        mlp_dim=64)
    config.env.update(num_workers=32, num_keys=40)
    config.sampler.update(num_slots=16)
    config.orchestrator.update(batch_size=16, group_size=4)
    config.warmup.update(steps=60, batch_size=16)
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
