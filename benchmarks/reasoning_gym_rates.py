"""How fast reasoning-gym feeds a run: prompts generated per second (the
questions of a split, with the held-out check that keeps them apart) and
completions scored per second by the task's own scorer, for a few tasks of
different kinds, through `envs/reasoning_gym_env.py` as a run uses it.

  python benchmarks/reasoning_gym_rates.py [--quick] [--out=rows.jsonl]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arl_jax.envs import reasoning_gym_env as rg_env  # noqa: E402
from arl_jax.envs import tokenizer as tokenizer_lib  # noqa: E402
from benchmarks import report  # noqa: E402

TASKS = ("chain_sum", "gcd", "basic_arithmetic", "letter_counting", "propositional_logic",
         "maze")


def _row(task: str, size: int, heldout: int) -> dict:
  options = rg_env.task_options(task)
  cfg = rg_env.ReasoningGymConfig(tasks={task: options}, size=size, heldout_size=heldout,
                                  seed=1)
  rg_env._dataset.cache_clear()  # (generate from scratch: the cache would hide the work)
  start = time.perf_counter()
  prompts = rg_env.make_prompts(cfg, "train")
  generate_s = time.perf_counter() - start
  tokenizer = tokenizer_lib.make_tokenizer(tokenizer_lib.TokenizerConfig(kind="byte"))
  env = rg_env.ReasoningGymEnv(cfg, tokenizer)
  completions = [tokenizer.encode(f"<answer>{p.answer}</answer>") + [tokenizer.eos_id]
                 for p in prompts]
  start = time.perf_counter()
  rewards = [env.score(p, c) for p, c in zip(prompts, completions)]
  score_s = time.perf_counter() - start
  return {"benchmark": "reasoning_gym", "part": "rates", "task": task,
          "prompts": len(prompts), "prompts_per_s": round(len(prompts) / generate_s),
          "scored_per_s": round(len(prompts) / score_s),
          "reference_reward": round(sum(rewards) / len(rewards), 3)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="two tasks, few prompts")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  tasks = TASKS[:2] if args.quick else TASKS
  size, heldout = (50, 10) if args.quick else (2000, 200)
  rows = [_row(task, size, heldout) for task in tasks]
  report.print_table(rows, "reasoning-gym prompts generated and scored, one core")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
