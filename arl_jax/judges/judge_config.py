"""The `judge` section: whether a model judges completions, which, and how
its verdict joins the environment's reward."""

from __future__ import annotations

import dataclasses

KINDS = ("", "hf", "openai")
DEFAULT_TEMPLATE = ("Here is a task and an answer to it.\n\nTask:\n{prompt}\n\nAnswer:\n"
                    "{completion}\n\nIs the answer correct? Reply with Yes or No.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """Attributes:
    kind: "" (no judge), "hf" (a Hugging Face model folder, run here) or
      "openai" (an OpenAI-compatible server).
    path: the Hugging Face folder (`hf`).
    url: the server's base URL, up to `/v1` (`openai`).
    model: the model name the server is asked for (`openai`).
    api_key_env: the environment variable holding the server's key ("": none).
    template: the question, with `{prompt}` and `{completion}` (the task's
      text and the completion's), asked as a user turn of the judge's chat
      template.
    yes_words: the answers that mean yes; the verdict is P(yes) / (P(yes)
      + P(no)) over the first token of each word (and of each with a
      leading space), from the judge's next-token distribution.
    no_words: the answers that mean no.
    weight: the judge's verdict's weight in the reward.
    rule_weight: the environment's own reward's weight.
    max_batch: questions the `hf` judge answers in one forward pass.
    max_len: the longest question in tokens; a longer one is a counted
      environment fault, not cut.
    timeout_s: the longest an `openai` request may take.
    device: the index of the JAX device the `hf` judge runs on (it may be
      one the sampler uses: it then shares it).
  """

  kind: str = ""
  path: str = ""
  url: str = ""
  model: str = ""
  api_key_env: str = ""
  template: str = DEFAULT_TEMPLATE
  yes_words: tuple[str, ...] = ("Yes", "yes")
  no_words: tuple[str, ...] = ("No", "no")
  weight: float = 1.0
  rule_weight: float = 1.0
  max_batch: int = 8
  max_len: int = 1024
  timeout_s: float = 60.0
  device: int = 0

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"judge.kind must be one of {KINDS}, got {self.kind!r}")
    if self.kind == "hf" and not self.path:
      raise ValueError("judge.path must name the judge's Hugging Face folder (judge.kind='hf')")
    if self.kind == "openai" and not self.url.startswith(("http://", "https://")):
      raise ValueError(f"judge.url must be an http(s) URL (judge.kind='openai'), got "
                       f"{self.url!r}")
    for key in ("{prompt}", "{completion}"):
      if key not in self.template:
        raise ValueError(f"judge.template must hold {key}")
    try:  # (other braces must be doubled: the template is a str.format string)
      self.template.format(prompt="", completion="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"judge.template: {e!r} (write a literal brace as {{{{ or }}}})") from e
    if not self.yes_words or not self.no_words:
      raise ValueError("judge.yes_words and judge.no_words must each name at least one word")
    for key in ("max_batch", "max_len"):
      if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
        raise ValueError(f"judge.{key} must be an int >= 1, got {getattr(self, key)!r}")
    if self.timeout_s <= 0:
      raise ValueError(f"judge.timeout_s must be > 0, got {self.timeout_s}")

  @property
  def enabled(self) -> bool:
    return bool(self.kind)
