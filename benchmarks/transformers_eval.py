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

`--forms=N` prints the N commonest completion forms beside their reward: a
completion with each number replaced by what it is (`{answer}` the
reference answer, `{1}`, `{2}` the prompt's other numbers in order, `{#}`
any other). A reward that reads part of the text can be earned by a
statement that is false, and an accuracy is not learning until its forms
say so: on "which number is larger", "{1} is larger than {answer}." scoring
1 is a false claim the reward read as right (it reads the last number).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
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
  # (an update's row repeats the evaluation before it under its own step:
  # the evaluation's own row, without `reward_mean`, names the update it scored)
  evals = [r for r in rows if "eval_reward" in r and "reward_mean" not in r
           and (step is None or r.get("step") == step)]
  if not evals:
    return None
  return evals[-1]["step"], evals[-1]["eval_reward"], evals[-1].get("eval_reward_by_env")


def run_config(workdir: str):
  """The config a run trained with, as its newest checkpoint saved it (with
  every command-line override), so the held-out set and the scorer are the
  run's own."""
  import ml_collections  # noqa: PLC0415

  root = os.path.join(workdir, "checkpoints")
  steps = sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []
  if not steps:
    raise SystemExit(f"--workdir={workdir}: no checkpoint to read the run's config from")
  with open(os.path.join(root, str(steps[-1]), "run", "metadata")) as f:
    return ml_collections.ConfigDict(json.load(f)["config"])


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


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def completion_form(prompt_text: str, completion_text: str, answer: str = "") -> str:
  """The completion with each number replaced by what it is: `{answer}` (the
  reference `answer`), `{1}`, `{2}`, ... (the prompt's other numbers in
  order) or `{#}` (a number from neither)."""
  places = {answer.strip(): "{answer}"} if answer.strip() else {}
  others = 0
  for number in _NUMBER.findall(prompt_text):
    if number not in places:
      others += 1
      places[number] = f"{{{others}}}"
  return _NUMBER.sub(lambda m: places.get(m.group(), "{#}"), completion_text.strip())


def form_rows(forms: list[tuple[str, str, float]], top: int) -> list[dict]:
  """The `top` commonest forms of `(form, completion text, reward)` triples:
  how many, their mean reward, one example."""
  by_form = collections.defaultdict(list)
  for form, text, reward in forms:
    by_form[form].append((text, reward))
  ranked = sorted(by_form.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:top]
  return [{"benchmark": "transformers_eval_forms", "form": form[:80], "count": len(items),
           "mean_reward": round(sum(r for _, r in items) / len(items), 3),
           "example": items[0][0][:80]} for form, items in ranked]


def evaluate(folder: str, config, formats, batch_size: int, limit: int | None,
             temperature: float = 0.0, samples: int = 1, forms: list | None = None):
  """Scores each format's completions of the first `limit` held-out prompts.

  Greedy at temperature 0. At a temperature > 0 each prompt gets `samples`
  completions drawn as the sampler draws them (plain softmax sampling at
  that temperature), and `groups_with_signal` is the fraction of prompts
  whose samples' rewards are not all equal: the groups a group-relative
  advantage can learn from. `forms`: a list that gets the first format's
  `(completion_form, completion text, reward)` of each completion.
  """
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
  sampled = temperature > 0
  samples = samples if sampled else 1
  rows = []
  for fmt in formats:
    start = time.perf_counter()
    rewards, lengths, bos_first = [], [], 0
    torch.manual_seed(0)
    per_batch = max(1, batch_size // samples)  # (prompts; `samples` rows each)
    for lo in range(0, len(prompts), per_batch):
      batch = prompts[lo:lo + per_batch]
      ids = [_prompt_ids(tokenizer, p.text) for p in batch]
      if fmt == "extra_bos":
        ids = [[ours.bos_id, *x] for x in ids]
      bos_first += sum(x[:2] == [ours.bos_id] * 2 for x in ids)
      width = max(map(len, ids))
      # Left padding: every prompt ends where generation starts.
      tokens = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
      mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
      with torch.no_grad():
        draw = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0,
                 "num_return_sequences": samples} if sampled else {"do_sample": False})
        out = model.generate(tokens, attention_mask=mask, max_new_tokens=budget,
                             eos_token_id=stop_ids, pad_token_id=pad, **draw)
      # (num_return_sequences repeats each prompt's rows next to each other)
      for p, row in zip([p for p in batch for _ in range(samples)], out[:, width:].tolist()):
        # A row that stopped is padded after its stop token: cut there.
        end = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        completion = row[:end]
        rewards.append(float(env.score(p, completion)))
        lengths.append(len(completion))
        if forms is not None and fmt == formats[0]:
          text = tokenizer.decode(completion, skip_special_tokens=True)
          forms.append((completion_form(p.text, text, p.answer), text, rewards[-1]))
    per_prompt = np.asarray(rewards).reshape(len(prompts), samples)
    by_env = collections.defaultdict(list)
    for p, prompt_rewards in zip(prompts, per_prompt):
      by_env[env.env_name_of(p)].append(float(prompt_rewards.mean()))
    rows.append({"benchmark": "transformers_eval", "folder": folder, "format": fmt,
                 "prompts": len(prompts), "accuracy": round(float(np.mean(rewards)), 3),
                 # (over prompts: a prompt's samples are not independent questions)
                 "standard_error": round(float(np.std(per_prompt.mean(1))
                                               / np.sqrt(len(prompts))), 3),
                 "double_bos_prompts": bos_first,
                 "mean_completion_tokens": round(float(np.mean(lengths)), 1),
                 "seconds": round(time.perf_counter() - start, 1)}
                | ({"accuracy_by_env": {k: round(float(np.mean(v)), 3)
                                        for k, v in sorted(by_env.items())}}
                   if len(by_env) > 1 else {})
                | ({"temperature": temperature, "samples": samples,
                    "groups_with_signal": round(float(np.mean(per_prompt.std(1) > 0)), 3)}
                   if sampled else {}))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--folder", help="a Hugging Face model folder")
  parser.add_argument("--config", help="CONFIG[:ARG] whose held-out prompts and environment "
                      "to use (as --config of arl_jax.launch; default: --workdir's run's own)")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny converted GGUF model on 4 prompts (keeps the script working)")
  parser.add_argument("--workdir", help="the run's workdir: its arl_jax evaluation beside")
  parser.add_argument("--step", type=int, help="which of the run's evaluations (default: last)")
  parser.add_argument("--formats", default="model,extra_bos")
  parser.add_argument("--batch_size", type=int, default=50)
  parser.add_argument("--limit", type=int, help="evaluate only the first N prompts")
  parser.add_argument("--forms", type=int, default=0,
                      help="print the N commonest completion forms and their reward")
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
  elif not (args.folder and (args.config or args.workdir)):
    parser.error("--folder and --config (or a run's --workdir) are required (or --quick)")
  elif not args.config:
    config = run_config(args.workdir)
  else:
    import arl_jax  # noqa: PLC0415

    path, _, arg = args.config.partition(":")
    config = arl_jax.load_config(path, arg or None)
  forms = [] if args.forms > 0 else None
  rows = evaluate(args.folder, config, formats, args.batch_size, args.limit, forms=forms)
  if args.quick:
    shutil.rmtree(tmp, ignore_errors=True)
  ours = _arl_jax_accuracy(args.workdir, args.step)
  for row in rows:
    if ours is not None:
      row["arl_jax_step"], row["arl_jax_accuracy"] = ours[0], round(ours[1], 3)
      if ours[2] and len(ours[2]) > 1:
        row["arl_jax_by_env"] = {k: round(v, 3) for k, v in sorted(ours[2].items())}
  report.print_table(rows, "greedy held-out accuracy in transformers")
  report.append_jsonl(rows, args.out)
  if forms is not None:
    form_table = form_rows(forms, args.forms)
    report.print_table(form_table, f"the {formats[0]} format's commonest completion forms "
                       "({answer}: the reference answer; {1}, {2}: the prompt's other numbers)")
    report.append_jsonl(form_table, args.out)


if __name__ == "__main__":
  main()
