r"""Asynchronous GRPO on GSM8K-style problems from Qwen2.5-0.5B-Instruct on a TPU v5e-8.

Command (the `:ARG` is a local Hugging Face folder: `config.json`,
`*.safetensors` and `tokenizer.json`; `data.*_path` are your GSM8K-style JSONL
files, schema in the README):

  python -m arl_jax.launch --config=configs/math_tpu.py:/models/Qwen2.5-0.5B-Instruct \
      --workdir=gs://BUCKET/math_tpu \
      --config.data.train_path=gsm8k_train.jsonl --config.data.heldout_path=gsm8k_test.jsonl

The model's shapes come from the folder's `config.json` (`model.hf_path`) and
its weights start the run (imported straight into the learner's sharded
layout; `arl_jax/models/hf_params.py`); the tokenizer and chat template come
from the same folder. Export the result with
`python -m arl_jax.export_hf --checkpoint=WORKDIR/checkpoints --hf_path=ARG --out=DIR`.
Any Llama, Qwen2 or Qwen3 folder of a similar size works the same way.

Hardware: one TPU v5e-8 host (8 chips, 16 GiB HBM each). The default
disaggregated split gives the learner 4 chips (fsdp=4) and the sampler the
other 4 (data=4: each decodes its own 64 slots with a bfloat16 copy of the
weights, published device to device after every update).

What was checked (on a CPU machine, with a stand-in folder holding
Qwen2.5-0.5B-Instruct's config.json and a tokenizer of its vocabulary size):
`--dry_run --dry_run_devices=8 --dry_run_device=tpu-v5e` validates the config
and plans about 6.2 GiB per learner chip (params 0.46, Adam moments 0.92,
gradients 0.46 and their accumulator 0.46, activations ~2.8 rough: one packed
row of 2,048 tokens per microbatch per chip, logits in chunks of 1,024 tokens,
attention in blocks of 512 queries, blocks rematerialised and scanned; the
held-out evaluation's cache 1.15 for `eval_slots=64`) and 2.4 GiB per sampler
chip (two bfloat16 weight versions 1.84, KV cache 0.57): inside 16 GiB, with
room for a batch of ~7,400 rollouts or completions of ~4,000 tokens
(`docs/scaling.md`, with the larger Qwen2.5 shapes). The batch of 256 rollouts (32
prompts x 8) trains in 32 microbatches for that reason. Import and logit parity
with `transformers` are tested on small random models of each family
(`tests/models/hf_parity_test.py`).

Expected throughput (an estimate from the hardware's published peaks, NOT a
measurement: no TPU was available): an update trains 256 rollouts of ~550
tokens (prompt + completion, columns trimmed to the batch's longest), about
6 x 494M x 141k = 4.2e14 FLOPs: ~1.3 s on the 4 learner chips at 40% of
v5e's 197 bf16 TFLOP/s (float32 params make the matmuls slower than that;
expect a few seconds). The sampler reads its 0.99 GB of bfloat16 weights per
decode step per chip (819 GB/s HBM): at most ~800 steps/s x 64 slots, so
~50k tokens/s per chip at best and the 77k completion tokens of an update in
~0.5-2 s over 4 chips. So roughly one update every few seconds, with
sampler and learner of the same order (the regime asynchrony pays off in).
The held-out accuracy should rise over the first few hundred updates, as
GSM8K GRPO does at this size; not verified here.
"""

import ml_collections

from arl_jax.config import base_config, sweep


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if not arg:
    raise ValueError("configs/math_tpu.py needs a Hugging Face model folder as its argument: "
                     "--config=configs/math_tpu.py:/path/to/Qwen2.5-0.5B-Instruct")
  # Every key not set here is at its default (`base_config.py`; what each key
  # means: the schema's dataclasses, `schema.SECTIONS`).
  config = base_config.make("math_answer")
  config.update(num_steps=1000, log_every=50, eval_every=100, eval_size=256,
                # 64 held-out prompts at a time: a greedy slot for each of the
                # 256 would hold a 4.6 GiB cache on every learner chip.
                eval_slots=64, writers="jsonl,tensorboard")
  # Shapes (Qwen2.5-0.5B: d_model 896, 24 layers, 14 query / 2 KV heads of 64,
  # QKV biases, SwiGLU 4864, tied 151,936-row embedding, RoPE base 1e6: 494M
  # parameters) and the starting weights come from the folder.
  config.model.update(hf_path=arg, max_seq_len=768)
  config.env.num_workers = 8
  config.sampler.update(num_slots=256, prompt_len=256, prompt_buckets=(128,), max_new_tokens=512,
                        param_dtype="bfloat16")
  config.orchestrator.update(batch_size=256, group_size=8, max_off_policy_steps=4,
                             assembly="windowed_fifo", requeue_dropped=1,
                             mask_truncated_completions=True)
  config.learner.update(
      eps_high=0.28, tis_cap=2.0, num_microbatches=32, lr=1e-6,
      # Tokens whose float32 logits exist at once when scoring (0: all of a
      # microbatch); at a large vocabulary they dominate the learner's memory.
      logprob_chunk=1024,
      # Rollouts packed several to a learner row of up to this many tokens.
      pack_len=2048,
      # Queries whose attention scores exist at once, what the backward pass
      # keeps of each block, and the blocks as one lax.scan.
      attention_chunk=512, remat="block", scan_layers=True,
      # The training attention's kernel: auto picks splash on TPU (XLA when
      # planning on CPU), pallas_gpu on GPU.
      attention="auto")
  # Special tokens and chat template as the folder's tokenizer_config.json names
  # them (for Qwen2.5-Instruct: <|im_end|>, <|endoftext|>, no BOS, chatml).
  config.tokenizer.update(kind="hf", path=arg, eos_token="auto", bos_token="auto",
                          pad_token="auto", chat_template="auto")
  config.data.on_malformed = "skip"
  config.checkpoint.every_steps = 100
  # No supervised warm-up: an instruction-tuned checkpoint already answers.
  config.warmup.update(steps=0, lr=1e-5)
  config.lock()
  return config


def get_sweep(arg: str | None = None) -> list[dict]:
  """The lag tolerance at this size: K x loss."""
  del arg
  return sweep.product(sweep.axis("orchestrator.max_off_policy_steps", [1, 4, 8]),
                       sweep.axis("learner.loss", ["clipped_ratio", "m2po"]))
