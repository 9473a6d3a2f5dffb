"""Math word problems with a verifiable final answer (GSM8K-style JSONL data).

The completion is free text; the environment extracts its final answer and
compares it numerically with the record's `answer`:

1. the last `#### <answer>` (GSM8K's convention);
2. else the last `\\boxed{<answer>}` (MATH's convention, nested braces allowed);
3. unless `strict`, the last `answer is <answer>` / `answer: <answer>`, and
   finally the last number in the text.

Numbers compare exactly as fractions after removing thousands separators, `$`,
`%` and a trailing period (`1,000` == `1000.0` == `$1000`; `3/4` == `0.75`). A
completion cut off by the length limit (no EOS) scores 0, as does one with no
extractable or unparsable answer. Records come from a JSONL file (schema in
`jsonl_source.py`); the default is the sample shipped with the package
(`envs/data/math_answer.jsonl`, written by `python -m arl_jax.envs.sample_data`).
"""

from __future__ import annotations

import dataclasses
import fractions
import os
import re
import zlib

from arl_jax.envs import env_api, jsonl_source
from arl_jax.envs import tokenizer as tokenizer_lib

SAMPLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                           "math_answer.jsonl")

# Thousands separators only in groups of three ("1,000" but not "1,2").
_NUMBER = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?%?|-?\$?\.\d+%?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_IS = re.compile(r"answer(?:\s+is|\s*:)\s*(" + _NUMBER + r")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathAnswerConfig:
  """Attributes:
    path: JSONL file of records (`prompt`, `answer`[, `id`, `env`]).
    heldout_fraction: share of records (by a hash of their id) held out.
    strict: accept only `####` and `\\boxed{}` answers.
  """

  path: str = SAMPLE_PATH
  heldout_fraction: float = 0.1
  strict: bool = False

  def __post_init__(self):
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"env.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if not os.path.isfile(self.path):
      raise ValueError(f"env.path: no such file {self.path!r}")


_GROUPED = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LATEX_FRAC = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")
_LATEX_TEXT = re.compile(r"\\text\{[^{}]*\}")


def parse_number(text: str) -> fractions.Fraction | None:
  """`"1,000"`, `"$5"`, `"12.50"`, `"3/4"`, `"40%"`, `"7."`, `"\\frac{3}{4}"`,
  `"50\\%"` -> an exact Fraction."""
  cleaned = _LATEX_FRAC.sub(r"(\1)/(\2)", text.strip())
  cleaned = _LATEX_TEXT.sub("", cleaned).replace("\\%", "%").replace("\\$", "$")
  cleaned = cleaned.replace("(", "").replace(")", "")
  cleaned = cleaned.replace("$", "").strip().rstrip(".").rstrip("%").strip()
  if "," in cleaned:
    if not _GROUPED.fullmatch(cleaned):
      return None  # "1,2" is not a number
    cleaned = cleaned.replace(",", "")
  try:
    return fractions.Fraction(cleaned)
  except (ValueError, ZeroDivisionError):
    return None


def _last_boxed(text: str) -> str | None:
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 0, start + len("\\boxed")
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1:j]
  return None  # unbalanced


def extract_answer(text: str, strict: bool = False) -> str | None:
  """The final answer written in `text` (see the module docstring), or None."""
  found = _HASHES.findall(text)
  if found:
    return found[-1]
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed
  if strict:
    return None
  found = _ANSWER_IS.findall(text) or _ANY_NUMBER.findall(text)
  return found[-1] if found else None


def make_prompts(cfg: MathAnswerConfig, split: str) -> list[env_api.TextPrompt]:
  """The records of one split (a hash of the id decides, so the split never
  depends on file order or an RNG)."""
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  records = jsonl_source.load(cfg.path, env_name="math_answer").prompts
  for p in records:
    if parse_number(p.answer) is None:
      raise ValueError(f"{cfg.path}: record id {p.prompt_id}: answer {p.answer!r} is not a "
                       "number (GSM8K files: keep only what follows '####')")
  heldout = lambda p: zlib.crc32(str(p.prompt_id).encode()) % 10_000 < cfg.heldout_fraction * 1e4
  return [p for p in records if heldout(p) == (split == "heldout")]


class MathAnswerEnv(env_api.Environment):
  """Reward 1.0 when the extracted final answer equals the record's answer."""

  name = "math_answer"

  def __init__(self, cfg: MathAnswerConfig, tokenizer: tokenizer_lib.Tokenizer):
    self._cfg = cfg
    self._tokenizer = tokenizer

  def encode_prompt(self, prompt: env_api.TextPrompt) -> list[int]:
    return env_api.encode_user_prompt(self._tokenizer, prompt.text)

  def score(self, prompt: env_api.TextPrompt, completion_ids) -> float:
    ids = [int(i) for i in completion_ids]
    if not env_api.ended_turn(self._tokenizer, ids):
      return 0.0  # cut off by the length limit
    answer = extract_answer(self._tokenizer.decode(ids), self._cfg.strict)
    if answer is None:
      return 0.0
    want = parse_number(prompt.answer)
    if want is None:  # a data error, not a wrong answer: counted as an env error
      raise ValueError(f"prompt {prompt.prompt_id}: reference answer {prompt.answer!r} is not a "
                       "number")
    got = parse_number(answer)
    return float(got is not None and got == want)

  def demonstration(self, prompt: env_api.TextPrompt) -> env_api.Demonstration:
    target = [*self._tokenizer.encode(f"#### {prompt.answer}"), self._tokenizer.end_of_turn_id]
    return env_api.Demonstration(completion_ids=tuple(target), loss_mask=(1.0,) * len(target))
