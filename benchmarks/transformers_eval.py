r"""A trained model outside arl_jax: greedy held-out accuracy of a Hugging Face
folder in `transformers`, on a config's evaluation prompts, scored by the
config's environment.

A learning claim holds when the exported model does in transformers what
arl_jax's evaluator measured. The prompts are made as a deployment makes them
(`apply_chat_template(..., tokenize=True)`, or `tokenizer(text)` for a model
without a chat template); `--formats` adds `extra_bos` (the same ids behind
one more BOS token, the prompt format arl_jax used before issue 52) to show
what a prompt-format mismatch costs. Completions stop at the tokenizer's
stop tokens (EOS and the template's end of turn) or at the config's
`sampler.max_new_tokens`; the environment's `score` gives the reward.
Beside each row, arl_jax's own greedy evaluation of the same run at the same
update, read from `--workdir`'s `metrics.jsonl` when given.

  python -m arl_jax.export_hf --checkpoint=/tmp/smol_s0/checkpoints \
      --hf_path=/tmp/smollm2 --out=/tmp/smol_s0_hf
  python benchmarks/transformers_eval.py --folder=/tmp/smol_s0_hf \
      --config=configs/smollm2.py:/tmp/smollm2 --workdir=/tmp/smol_s0 --out=/tmp/tf_eval.jsonl
  python benchmarks/transformers_eval.py --folder=/tmp/smollm2 \
      --config=configs/smollm2.py:/tmp/smollm2      # the model before RL
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

FORMATS = ("model", "extra_bos")


def _prompt_ids(tokenizer, text: str) -> list[int]:
  """The prompt as a deployment of the folder makes it."""
  if tokenizer.chat_template:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  return list(tokenizer(text).input_ids)


def _arl_jax_accuracy(workdir: str | None, step: int | None):
  """arl_jax's greedy held-out reward at `step` (the last evaluation when
  None) from the run's metrics.jsonl: `(step, reward)`, or None."""
  if not workdir:
    return None
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  evals = [r for r in rows if "eval_reward" in r and (step is None or r.get("step") == step)]
  return (evals[-1]["step"], evals[-1]["eval_reward"]) if evals else None


def _quick_folder(tmp: str):
  """A tiny model as a converted GGUF folder (SmolLM2's layout, the test vocabulary)
  and `configs/smollm2.py` sized for it: the script end to end in seconds."""
  import arl_jax  # noqa: PLC0415
  from arl_jax.models import gguf_convert  # noqa: PLC0415
  from arl_jax.testing import gguf_files  # noqa: PLC0415

  gguf_files.write_llama(os.path.join(tmp, "m.gguf"), "Q8_0", d_model=64, num_heads=2,
                         num_kv_heads=1, mlp_dim=64, num_layers=1)
  folder = os.path.join(tmp, "hf")
  gguf_convert.convert(os.path.join(tmp, "m.gguf"), folder)
  config = arl_jax.load_config("smollm2", folder)
  # (few merges: a prompt is about a token a character)
  config.sampler.update(prompt_len=200, max_new_tokens=8)
  config.model.max_seq_len = 256
  return folder, config


def evaluate(folder: str, config, formats, batch_size: int, limit: int | None):
  import numpy as np  # noqa: PLC0415
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  from arl_jax.config import run_spec  # noqa: PLC0415

  resolved = run_spec.resolve(config)
  env, prompts = resolved.inputs.eval_env, resolved.inputs.eval_prompts[:limit]
  budget = resolved.spec.engine.max_new_tokens
  ours = resolved.inputs.tokenizer
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  stop_ids = list(ours.stop_ids)
  pad = ours.pad_id
  rows = []
  for fmt in formats:
    start = time.perf_counter()
    rewards, lengths, bos_first = [], [], 0
    for lo in range(0, len(prompts), batch_size):
      batch = prompts[lo:lo + batch_size]
      ids = [_prompt_ids(tokenizer, p.text) for p in batch]
      if fmt == "extra_bos":
        ids = [[ours.bos_id, *x] for x in ids]
      bos_first += sum(x[:2] == [ours.bos_id] * 2 for x in ids)
      width = max(map(len, ids))
      # Left padding: every prompt ends where generation starts.
      tokens = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
      mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
      with torch.no_grad():
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=budget,
                             do_sample=False, eos_token_id=stop_ids, pad_token_id=pad)
      for p, row in zip(batch, out[:, width:].tolist()):
        # A row that stopped is padded after its stop token: cut there.
        end = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        completion = row[:end]
        rewards.append(float(env.score(p, completion)))
        lengths.append(len(completion))
    rows.append({"benchmark": "transformers_eval", "folder": folder, "format": fmt,
                 "prompts": len(prompts), "accuracy": round(float(np.mean(rewards)), 3),
                 "standard_error": round(float(np.std(rewards) / np.sqrt(len(rewards))), 3),
                 "double_bos_prompts": bos_first,
                 "mean_completion_tokens": round(float(np.mean(lengths)), 1),
                 "seconds": round(time.perf_counter() - start, 1)})
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--folder", help="a Hugging Face model folder")
  parser.add_argument("--config", help="CONFIG[:ARG] whose held-out prompts and environment "
                      "to use (as --config of arl_jax.launch)")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny converted GGUF model on 4 prompts (keeps the script working)")
  parser.add_argument("--workdir", help="the run's workdir: its arl_jax evaluation beside")
  parser.add_argument("--step", type=int, help="which of the run's evaluations (default: last)")
  parser.add_argument("--formats", default="model,extra_bos")
  parser.add_argument("--batch_size", type=int, default=50)
  parser.add_argument("--limit", type=int, help="evaluate only the first N prompts")
  parser.add_argument("--out", help="append JSON rows here")
  args = parser.parse_args(argv)
  formats = [f for f in args.formats.split(",") if f]
  bad = sorted(set(formats) - set(FORMATS))
  if bad:
    parser.error(f"--formats: unknown {bad}; known: {FORMATS}")
  if args.quick:
    tmp = tempfile.mkdtemp()
    args.folder, config = _quick_folder(tmp)
    args.limit = 4
  elif not (args.folder and args.config):
    parser.error("--folder and --config are required (or --quick)")
  else:
    import arl_jax  # noqa: PLC0415

    path, _, arg = args.config.partition(":")
    config = arl_jax.load_config(path, arg or None)
  rows = evaluate(args.folder, config, formats, args.batch_size, args.limit)
  if args.quick:
    shutil.rmtree(tmp, ignore_errors=True)
  ours = _arl_jax_accuracy(args.workdir, args.step)
  for row in rows:
    if ours is not None:
      row["arl_jax_step"], row["arl_jax_accuracy"] = ours[0], round(ours[1], 3)
  report.print_table(rows, "greedy held-out accuracy in transformers")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
