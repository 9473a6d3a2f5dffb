"""Integer arithmetic with an exact-answer reward: a verifiable task for CPU runs.

A prompt is `"<bos>a+b="`; the completion must be the decimal sum followed by
`<eos>`. The (a, b) pairs are split deterministically into a training set and a
held-out set, so evaluation measures generalisation, not memorisation.

Prompt records from a file (`data.train_path`) must have an integer answer
(`check_record`): a completion is scored against its decimal text.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

from arl_jax.envs import env_api
from arl_jax.envs import tokenizer as tokenizer_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithConfig:
  """Attributes:
    max_operand: operands are drawn from [0, max_operand].
    operator: `+`, `-` or `*`.
    heldout_fraction: share of pairs reserved for evaluation.
  """

  max_operand: int = 99
  operator: str = "+"
  heldout_fraction: float = 0.1

  def __post_init__(self):
    if self.max_operand < 1:
      raise ValueError(f"env.max_operand must be >= 1, got {self.max_operand}")
    if self.operator not in _OPERATORS:
      raise ValueError(f"env.operator must be one of {sorted(_OPERATORS)}, got {self.operator!r}")
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"env.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")


_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


# One task instance; `prompt_id` is stable across runs (it names the pair).
Prompt = env_api.TextPrompt

# What `make_prompts` writes as an answer: `str(int)`.
_INTEGER = re.compile(r"-?[0-9]+")


def check_record(prompt: Prompt) -> None:
  """Raises ValueError unless the record's answer is an integer.

  Arith's answers are integers (as `make_prompts` writes them); anything
  else in a file is a typo or a record for another task, and would otherwise
  surface later as a confusing length error on `sampler.max_new_tokens`.
  """
  if not _INTEGER.fullmatch(prompt.answer):
    raise ValueError(f"field 'answer' must be an integer for env 'arith', got "
                     f"{prompt.answer!r}")


def _is_heldout(a: int, b: int, fraction: float) -> bool:
  # A hash, not a shuffle, so the split does not depend on any RNG or ordering.
  return zlib.crc32(f"{a},{b}".encode()) % 10_000 < fraction * 10_000


def make_prompts(cfg: ArithConfig, split: str) -> list[Prompt]:
  """All prompts of one split, in a fixed order."""
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  want_heldout = split == "heldout"
  n = cfg.max_operand + 1
  prompts = []
  for a in range(n):
    for b in range(n):
      if _is_heldout(a, b, cfg.heldout_fraction) == want_heldout:
        answer = str(_OPERATORS[cfg.operator](a, b))
        prompts.append(Prompt(prompt_id=a * n + b, text=f"{a}{cfg.operator}{b}=", answer=answer))
  return prompts


class ArithEnv(env_api.Environment):
  """Scores a completion: 1.0 for the exact answer, else 0.0."""

  name = "arith"

  def __init__(self, tokenizer: tokenizer_lib.Tokenizer):
    self._tokenizer = tokenizer

  def score(self, prompt: Prompt, completion_ids) -> float:
    ids = [int(i) for i in completion_ids]
    if not env_api.ended_turn(self._tokenizer, ids):
      return 0.0
    return float(self._tokenizer.decode(ids).strip() == prompt.answer)

  def encode_prompt(self, prompt: Prompt) -> list[int]:
    return env_api.encode_user_prompt(self._tokenizer, prompt.text)

  def encode_target(self, prompt: Prompt) -> list[int]:
    """The correct completion."""
    return [*self._tokenizer.encode(prompt.answer), self._tokenizer.end_of_turn_id]

  def demonstration(self, prompt: Prompt) -> env_api.Demonstration:
    target = self.encode_target(prompt)
    return env_api.Demonstration(completion_ids=tuple(target), loss_mask=(1.0,) * len(target))
