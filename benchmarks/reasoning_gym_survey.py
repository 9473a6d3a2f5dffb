r"""Which reasoning-gym task a model could learn: its greedy held-out accuracy
in `transformers` beside what trivial policies score on the same questions.

A learning claim counts only above the best trivial policy's line (a model
that learns to always name the first number scores ~0.5 on "which is
larger"). For each task (reasoning-gym's defaults, or `TASK{key=value,...}`)
this scores, on the first `--limit` held-out questions of
`configs/reasoning_gym.py:TASK:FOLDER`:

- `model`: the folder's greedy answers, as a deployment prompts it
  (`transformers_eval.evaluate`), with the standard error;
- `model T=...` (with `--temperature`): `--samples` answers a question drawn
  at the training temperature, their mean reward and `groups_with_signal`,
  the fraction of questions whose answers do not all score alike. Greedy
  accuracy can hide a task a run cannot learn: if sampled answers all score
  0, every group's advantage is 0;
- `constant`: the best single answer (the most common training answer, the
  best constant a policy could learn from training rewards);
- `first_number`: the first number in the question;
- `random_answer`: a training answer drawn at random (the right format, a
  value from the right distribution).

Each trivial answer is scored by the environment as a completion
`<answer>X</answer>` ending the turn. A task whose model accuracy is
between 5% and 50% and well above every trivial line is a candidate for a
learning run (issue 55).

  python benchmarks/reasoning_gym_survey.py --folder=/tmp/smollm2 \
      --tasks="chain_sum{max_terms=2,max_digits=1},basic_arithmetic{max_terms=2,max_digits=1}"
  python benchmarks/reasoning_gym_survey.py --quick   # a tiny random model, 4 questions
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)
import transformers_eval  # noqa: E402


def _parse_tasks(text: str) -> list[tuple[str, dict]]:
  """`a,b{k=v,k2=v2}` -> [(a, {}), (b, {k: v, k2: v2})] (values as Python literals)."""
  import ast  # noqa: PLC0415

  out = []
  for name, options in re.findall(r"([a-z_0-9]+)(?:\{([^}]*)\})?", text):
    fields = {}
    for pair in filter(None, (options or "").split(",")):
      key, _, value = pair.partition("=")
      try:
        fields[key.strip()] = ast.literal_eval(value.strip())
      except (ValueError, SyntaxError):
        fields[key.strip()] = value.strip()
    out.append((name, fields))
  return out


def _score_answer(env, prompt, answer: str | None) -> float:
  """The reward of `answer` written as the environment's demonstration of
  it (between tags or bare, ending the turn); no answer scores 0."""
  shown = env.demonstration(dataclasses.replace(prompt, answer=answer or ""))
  return 0.0 if shown is None else float(env.score(prompt, list(shown.completion_ids)))


def _trivial_rows(config, limit: int, seed: int) -> list[dict]:
  from arl_jax.config import run_spec  # noqa: PLC0415
  from arl_jax.envs import reasoning_gym_env  # noqa: PLC0415

  resolved = run_spec.resolve(config)
  env = resolved.inputs.eval_env
  prompts = resolved.inputs.eval_prompts[:limit]
  train_answers = [p.answer for p in resolved.inputs.train.prompts if p.answer]
  constant = collections.Counter(train_answers).most_common(1)[0][0]
  rng = np.random.default_rng(seed)
  policies = {
      "constant": lambda p: constant,
      "first_number": lambda p: next(iter(reasoning_gym_env.NUMBER.findall(p.text)), None),
      "random_answer": lambda p: train_answers[int(rng.integers(len(train_answers)))],
  }
  rows = []
  for name, policy in policies.items():
    rewards = [_score_answer(env, p, policy(p)) for p in prompts]
    rows.append({"policy": name, "prompts": len(prompts),
                 "accuracy": round(float(np.mean(rewards)), 3),
                 "standard_error": round(float(np.std(rewards) / np.sqrt(len(rewards))), 3)}
                | ({"answer": constant} if name == "constant" else {}))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--folder", help="a Hugging Face chat model folder")
  parser.add_argument("--tasks", help="TASK[{key=value,...}][,TASK...]")
  parser.add_argument("--quick", action="store_true",
                      help="a tiny converted GGUF model on 4 questions (keeps the script working)")
  parser.add_argument("--limit", type=int, default=100, help="held-out questions per task")
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--answer_format", default="tags",
                      help="env.answer_format: tags, raw or last_number")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="> 0: also score --samples sampled answers a question at it")
  parser.add_argument("--samples", type=int, default=8)
  parser.add_argument("--batch_size", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="append JSON rows here")
  args = parser.parse_args(argv)
  import arl_jax  # noqa: PLC0415

  if args.quick:
    import tempfile  # noqa: PLC0415

    args.folder, _ = transformers_eval._quick_folder(tempfile.mkdtemp())  # noqa: SLF001
    args.tasks, args.limit, args.max_new_tokens = "chain_sum{max_terms=2,max_digits=1}", 4, 24
    args.temperature, args.samples = args.temperature or 1.0, 2
  elif not (args.folder and args.tasks):
    parser.error("--folder and --tasks are required (or --quick)")
  rows = []
  for task, options in _parse_tasks(args.tasks):
    config = arl_jax.load_config("reasoning_gym", f"{task}:{args.folder}")
    config.unlock()
    config.env.tasks[task].update(options)
    config.update(eval_size=args.limit)
    config.env.answer_format = args.answer_format
    config.sampler.max_new_tokens = args.max_new_tokens
    label = task + ("{" + ",".join(f"{k}={v}" for k, v in options.items()) + "}"
                    if options else "") + ("" if args.answer_format == "tags"
                                           else f" ({args.answer_format})")
    start = time.perf_counter()
    (model,) = transformers_eval.evaluate(args.folder, config, ["model"], args.batch_size,
                                          args.limit)
    model_rows = [("model", model, start)]
    if args.temperature > 0:
      start = time.perf_counter()
      (drawn,) = transformers_eval.evaluate(args.folder, config, ["model"], args.batch_size,
                                            args.limit, args.temperature, args.samples)
      model_rows.append((f"model T={args.temperature:g}", drawn, start))
    first = len(rows)
    for policy, row, began in model_rows:
      rows.append({"benchmark": "reasoning_gym_survey", "part": "survey", "task": label,
                   "policy": policy, "prompts": row["prompts"], "accuracy": row["accuracy"],
                   "standard_error": row["standard_error"],
                   "mean_completion_tokens": row["mean_completion_tokens"],
                   "seconds": round(time.perf_counter() - began, 1)}
                  | {k: row[k] for k in ("samples", "groups_with_signal") if k in row})
    rows += [{"benchmark": "reasoning_gym_survey", "part": "survey", "task": label, **row}
             for row in _trivial_rows(config, args.limit, args.seed)]
    report.print_table(rows[first:], f"{label}: held-out accuracy and trivial policies")
  report.print_table(rows, "reasoning-gym tasks: the model against trivial policies")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
