"""What a model judge costs: verdicts per second of a frozen Hugging Face
judge (`arl_jax/judges/model_judge.py`) asked one question at a time and by
eight threads at once (batched into one pass), and a tiny run's learner
with and without the judge on (the share of the run's time it was busy,
and updates a second), side by side.

  python benchmarks/judge.py [--folder=HF_FOLDER] [--quick] [--out=rows.jsonl]

Without `--folder` the judge is a small random Llama written here (a GGUF
file converted), which measures the machinery, not a real judge's speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl_jax.judges import judge_config, model_judge  # noqa: E402
from arl_jax.testing import tiny  # noqa: E402
from arl_jax.training import run_lib  # noqa: E402
from benchmarks import report  # noqa: E402

QUESTION = ("Ann has 12 apples and gets 7 more. How many apples now?", "She has 19 apples.")


def _small_folder(root: str) -> str:
  from arl_jax.models import gguf_convert  # noqa: PLC0415
  from arl_jax.testing import gguf_files  # noqa: PLC0415

  gguf_files.write_llama(os.path.join(root, "m.gguf"), "F32", d_model=128, num_heads=4,
                         num_kv_heads=2, mlp_dim=256, num_layers=4)
  gguf_convert.convert(os.path.join(root, "m.gguf"), os.path.join(root, "hf"))
  return os.path.join(root, "hf")


def _verdict_rows(folder: str, count: int) -> list[dict]:
  judge = model_judge.ModelJudge(judge_config.JudgeConfig(kind="hf", path=folder, max_batch=8))
  judge.verdict(*QUESTION)  # (compiles the batch shape)
  rows = []
  for threads in (1, 8):
    batches = judge.batches
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
      list(pool.map(lambda _: judge.verdict(*QUESTION), range(count)))
    seconds = time.perf_counter() - start
    rows.append({"benchmark": "judge", "part": "verdicts", "threads": threads,
                 "questions": count, "passes": judge.batches - batches,
                 "verdicts_per_s": round(count / seconds, 1),
                 "question_tokens": len(judge.question_ids(*QUESTION))})
  judge.close()
  return rows


def _run_rows(folder: str, steps: int) -> list[dict]:
  rows = []
  for judged in (None, False, True):  # (None: a first run that fills the compile cache)
    config = tiny.load_config("arith", "tiny")
    config.update(num_steps=2 if judged is None else steps, eval_every=0)
    if judged:
      config.judge.update(kind="hf", path=folder, weight=0.5)
    with tempfile.TemporaryDirectory() as workdir:
      start = time.perf_counter()
      run_lib.run(config, workdir, print_fn=lambda _: None)
      seconds = time.perf_counter() - start
      records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    rl = [r for r in records if r.get("phase") == "rl" and "loss" in r]
    if judged is None:
      continue
    rows.append({"benchmark": "judge", "part": "run", "judge": "hf" if judged else "none",
                 "updates": len(rl), "seconds": round(seconds, 1),
                 "learner_busy_fraction": round(rl[-1]["learner_busy_fraction"], 3),
                 "updates_per_s": round(len(rl) / rl[-1]["wall_s"], 2)})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--folder", default="", help="the judge's Hugging Face folder")
  parser.add_argument("--quick", action="store_true", help="a few questions and updates")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as root:
    folder = args.folder or _small_folder(root)
    verdicts = _verdict_rows(folder, 16 if args.quick else 64)
    report.print_table(verdicts, "verdicts of one judge, one thread and eight")
    run = _run_rows(folder, 3 if args.quick else 20)
    report.print_table(run, "a tiny arith run, without and with the judge")
  report.append_jsonl(verdicts + run, args.out)


if __name__ == "__main__":
  main()
