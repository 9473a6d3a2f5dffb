r"""Writes the sample JSONL files shipped in `arl_jax/envs/data/`, one per
built-in environment (schema in `jsonl_source.py` and the README).

  python -m arl_jax.envs.sample_data            # rewrites arl_jax/envs/data/*.jsonl
  python -m arl_jax.envs.sample_data --out=DIR  # elsewhere

Deterministic: the same files on every machine (a test checks that the shipped
files are exactly what this script writes).

- `math_answer.jsonl`: short arithmetic word problems (add, take away,
  multiply, share) in GSM8K's format, with integer answers;
- `larger.jsonl`: "which of two 2-digit numbers is larger" in the
  `math_answer` schema, for a pretrained chat model (`configs/smollm2.py`);
- `arith.jsonl`, `tool_agent.jsonl`: records in the JSONL schema for the
  procedurally generated environments, to show (and test) that their prompts
  can come from a file too (`data.train_path`).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from arl_jax.envs import arith, tool_agent

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

_NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo")
_ITEMS = ("apple", "book", "coin", "pen", "shell", "stamp", "card", "egg")


def math_word_problems(num: int, seed: int = 0) -> list[dict]:
  rng = np.random.default_rng(seed)
  records = []
  for i in range(num):
    name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
    kind = ("add", "sub", "mul", "div")[i % 4]
    a, b = int(rng.integers(2, 20)), int(rng.integers(2, 10))
    if kind == "add":
      text, answer = f"{name} has {a} {item}s and gets {b} more. How many {item}s now?", a + b
    elif kind == "sub":
      a += b
      text, answer = f"{name} had {a} {item}s and gave away {b}. How many are left?", a - b
    elif kind == "mul":
      text, answer = f"{name} buys {a} bags of {b} {item}s. How many {item}s in all?", a * b
    else:
      text, answer = (f"{name} shares {a * b} {item}s equally among {b} friends. How many "
                      f"does each get?"), a
    records.append({"id": i, "prompt": text, "answer": str(answer), "env": "math_answer"})
  return records


def larger_records(num: int, seed: int = 0) -> list[dict]:
  """Distinct ordered pairs of distinct 2-digit numbers; the answer is the larger."""
  rng = np.random.default_rng(seed)
  pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a != b]
  chosen = rng.choice(len(pairs), num, replace=False)
  return [{"id": i, "prompt": f"Which number is larger, {pairs[k][0]} or {pairs[k][1]}? Reply "
           "with only the larger number.", "answer": str(max(pairs[k])), "env": "math_answer"}
          for i, k in enumerate(chosen)]


def arith_records(num: int, seed: int = 0) -> list[dict]:
  prompts = arith.make_prompts(arith.ArithConfig(), "train")
  chosen = np.random.default_rng(seed).choice(len(prompts), num, replace=False)
  return [{"id": prompts[i].prompt_id, "prompt": prompts[i].text, "answer": prompts[i].answer,
           "env": "arith"} for i in sorted(chosen)]


def tool_agent_records() -> list[dict]:
  prompts = tool_agent.make_prompts(tool_agent.ToolAgentConfig(), "train")
  return [{"id": p.prompt_id, "prompt": p.text, "answer": p.answer, "env": "tool_agent"}
          for p in prompts]


def files() -> dict[str, list[dict]]:
  """File name -> records, for every shipped sample."""
  return {"math_answer.jsonl": math_word_problems(400), "arith.jsonl": arith_records(200),
          "tool_agent.jsonl": tool_agent_records(), "larger.jsonl": larger_records(2000)}


def render(records: list[dict]) -> str:
  return "".join(json.dumps(r) + "\n" for r in records)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=DATA_DIR)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  for name, records in files().items():
    path = os.path.join(args.out, name)
    with open(path, "w", encoding="utf-8") as f:
      f.write(render(records))
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
  main()
