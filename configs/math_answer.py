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


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.num_steps = 500
  config.log_every = 25
  config.eval_every = 100
  config.eval_size = 40
  # Metric sinks: JSON lines always; "jsonl,tensorboard" adds TensorBoard event files.
  config.writers = "jsonl"
  config.compilation_cache = "auto"  # (~/.cache/arl_jax/jit; "": off)

  config.model = ml_collections.ConfigDict(dict(
      d_model=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
      max_seq_len=96, rope_theta=10_000.0, tie_embeddings=True, param_dtype="float32",
      value_head=False))

  config.mesh = ml_collections.ConfigDict(dict(
      placement="auto", learner_devices=-1,
      learner=(("fsdp", -1), ("tp", 1)), sampler=(("data", -1), ("tp", 1))))

  # path "" would be invalid: the default is the shipped sample (MathAnswerConfig.path).
  config.env = ml_collections.ConfigDict(dict(
      name="math_answer", heldout_fraction=0.1, strict=False, num_workers=2, timeout_s=30.0))

  config.sampler = ml_collections.ConfigDict(dict(
      num_slots=64, prompt_len=80, prompt_buckets=(48, 64), max_new_tokens=12,
      temperature=1.0, top_k=0, top_p=1.0, weight_update="in_flight", kv_policy="keep",
      param_dtype="float32",
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
      batch_size=64, group_size=8, max_async_level=1, max_off_policy_steps=8,
      staleness_reference="dispatch", assembly="fifo", window_fraction=0.3,
      requeue_dropped=0, mask_truncated_completions=False))

  config.learner = ml_collections.ConfigDict(dict(
      loss="clipped_ratio", eps_low=0.2, eps_high=0.2, dual_clip=0.0, rho_bar=1.0, c_bar=1.0,
      lam=1.0, vf_coef=0.5, tau=0.04,
      tis_cap=0.0, age_decay=0.0, decoupled=False, aggregation="token_mean", kl_coef=0.0,
      entropy_coef=0.0, advantage="grpo", num_epochs=1, num_minibatches=1, num_microbatches=1,
      lr=3e-4, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
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

  config.warmup = ml_collections.ConfigDict(dict(steps=300, batch_size=64, lr=1e-3,
                                                 fraction=0.3))

  if arg == "sync":
    config.orchestrator.max_async_level = 0
    config.orchestrator.max_off_policy_steps = 0
    config.sampler.weight_update = "drain"
  elif arg == "tiny":
    config.sampler.precompile = False  # (a few updates: a late compile cannot stall them)
    config.checkpoint.update(every_steps=0, save_final=False)  # (tests save when they test it)
    # (Tests time their waits by decode steps; tests/sampler covers bursts.)
    config.sampler.decode_burst = 1
    config.num_steps = 3
    config.log_every = 1
    config.eval_every = 3
    config.eval_size = 8
    config.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                        mlp_dim=64)
    config.sampler.update(num_slots=16)
    config.orchestrator.update(batch_size=16, group_size=4)
    config.warmup.update(steps=2, batch_size=16)
  elif arg:
    raise ValueError(f"configs/math_answer.py: unknown variant {arg!r}; use '', 'sync' or "
                     "'tiny'")
  config.lock()
  return config
