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
extractable or unparsable answer.

With `checker="symbolic"` (the `[math]` extra) answers that are not plain
numbers compare as mathematics with math-verify (`\\frac{1}{\\sqrt{2}}` ==
`\\sqrt{2}/2`, `(x+1)^2` == `x^2+2x+1`, sets, intervals), the reference may
be any expression, and `answer is ...` takes the rest of its line. The check
runs in child processes with a wall timeout (`checker_timeout_s`) and a
memory cap (`child_calls.py`): a model's `2^{2^{2^{20}}}` costs its timeout
and scores 0, never a hung worker. Two numbers still compare exactly here,
without a child. Records come from a JSONL file (schema in
`jsonl_source.py`); the default is the sample shipped with the package
(`envs/data/math_answer.jsonl`, written by `python -m arl_jax.envs.sample_data`).
"""

from __future__ import annotations

import dataclasses
import fractions
import importlib.util
import os
import re
import threading
import zlib

from arl_jax.envs import child_calls, env_api, jsonl_source
from arl_jax.envs import tokenizer as tokenizer_lib

SAMPLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                           "math_answer.jsonl")

# Thousands separators only in groups of three ("1,000" but not "1,2").
_NUMBER = r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?%?|-?\$?\.\d+%?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_IS = re.compile(r"answer(?:\s+is|\s*:)\s*(" + _NUMBER + r")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_ANSWER_IS_ANYTHING = re.compile(r"answer(?:\s+is|\s*:)\s*([^\n]+)", re.IGNORECASE)
CHECKERS = ("number", "symbolic")
_MAX_SYMBOLIC_CHARS = 1000  # (an answer longer than any reference is cut before parsing)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MathAnswerConfig:
  """Attributes:
    path: JSONL file of records (`prompt`, `answer`[, `id`, `env`]).
    heldout_fraction: share of records (by a hash of their id) held out.
    strict: accept only `####` and `\\boxed{}` answers.
    checker: "number" (exact fractions) or "symbolic" (math-verify, in
      child processes; see the module docstring).
    checker_timeout_s: the longest one symbolic check may take.
  """

  path: str = SAMPLE_PATH
  heldout_fraction: float = 0.1
  strict: bool = False
  checker: str = "number"
  checker_timeout_s: float = 5.0

  def __post_init__(self):
    if self.checker not in CHECKERS:
      raise ValueError(f"env.checker must be one of {CHECKERS}, got {self.checker!r}")
    if self.checker == "symbolic" and importlib.util.find_spec("math_verify") is None:
      raise ValueError('env.checker: "symbolic" needs math-verify: pip install -e ".[math]"')
    if not self.checker_timeout_s > 0:
      raise ValueError(f"env.checker_timeout_s must be > 0, got {self.checker_timeout_s!r}")
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


def extract_answer(text: str, strict: bool = False, expressions: bool = False) -> str | None:
  """The final answer written in `text` (see the module docstring), or None;
  `expressions`: `answer is ...` takes the rest of its line (the symbolic checker's)."""
  found = _HASHES.findall(text)
  if found:
    return found[-1]
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed
  if strict:
    return None
  if expressions:
    stated = _ANSWER_IS_ANYTHING.findall(text)
    if stated:
      return stated[-1].strip().rstrip(".").strip().strip("$").strip()
  found = _ANSWER_IS.findall(text) or _ANY_NUMBER.findall(text)
  return found[-1] if found else None


def make_prompts(cfg: MathAnswerConfig, split: str) -> list[env_api.TextPrompt]:
  """The records of one split (a hash of the id decides, so the split never
  depends on file order or an RNG)."""
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  records = jsonl_source.load(cfg.path, env_name="math_answer").prompts
  for p in records:
    if cfg.checker == "symbolic":
      if not p.answer.strip():
        raise ValueError(f"{cfg.path}: record id {p.prompt_id}: the answer is empty")
    elif parse_number(p.answer) is None:
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
    self._symbolic = None  # the checker's children, started at the first symbolic check
    self._lock = threading.Lock()

  def encode_prompt(self, prompt: env_api.TextPrompt) -> list[int]:
    return env_api.encode_user_prompt(self._tokenizer, prompt.text)

  def score(self, prompt: env_api.TextPrompt, completion_ids) -> float:
    ids = [int(i) for i in completion_ids]
    if not env_api.ended_turn(self._tokenizer, ids):
      return 0.0  # cut off by the length limit
    symbolic = self._cfg.checker == "symbolic"
    answer = extract_answer(self._tokenizer.decode(ids), self._cfg.strict, expressions=symbolic)
    if answer is None:
      return 0.0
    want, got = parse_number(prompt.answer), parse_number(answer)
    if want is not None and got is not None:
      return float(got == want)
    if not symbolic:
      if want is None:  # a data error, not a wrong answer: counted as an env error
        raise ValueError(f"prompt {prompt.prompt_id}: reference answer {prompt.answer!r} is "
                         "not a number")
      return 0.0
    # (A timeout, an exception or a child killed by its memory cap: not equal.)
    outcome = self.symbolic_checker().call(prompt.answer, answer[:_MAX_SYMBOLIC_CHARS])
    return float(outcome.ok and outcome.value is True)

  def symbolic_checker(self) -> child_calls.ChildPool:
    """The symbolic checks' child processes (their `counts` say how many
    timed out, raised or died)."""
    with self._lock:
      if self._symbolic is None:
        self._symbolic = child_calls.ChildPool("arl_jax.envs.symbolic_check:equivalent",
                                               workers=2, timeout_s=self._cfg.checker_timeout_s)
      return self._symbolic

  def demonstration(self, prompt: env_api.TextPrompt) -> env_api.Demonstration:
    target = [*self._tokenizer.encode(f"#### {prompt.answer}"), self._tokenizer.end_of_turn_id]
    return env_api.Demonstration(completion_ids=tuple(target), loss_mask=(1.0,) * len(target))
