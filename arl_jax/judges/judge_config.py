"""The `judge` section: whether a model judges completions, which, and how
its verdict joins the environment's reward."""

from __future__ import annotations

import dataclasses

KINDS = ("", "hf", "openai", "reward_model")
VERDICTS = ("yes_no", "score")
DEFAULT_TEMPLATE = ("Here is a task and an answer to it.\n\nTask:\n{prompt}\n\nAnswer:\n"
                    "{completion}\n\nIs the answer correct? Reply with Yes or No.")
DEFAULT_SCORE_TEMPLATE = ("Here is a task and an answer to it.\n\nTask:\n{prompt}\n\n"
                          "Answer:\n{completion}\n\nRate the answer from 0 (wrong) to "
                          "{max_score} (correct and complete). Reply with the number only.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """Attributes:
    kind: "" (no judge), "hf" (a Hugging Face model folder, run here),
      "openai" (an OpenAI-compatible server) or "reward_model" (a Hugging
      Face `...ForSequenceClassification` folder with one label: its score
      of the conversation is the verdict, unbounded).
    path: the Hugging Face folder (`hf`, `reward_model`).
    url: the server's base URL, up to `/v1` (`openai`).
    model: the model name the server is asked for (`openai`).
    api_key_env: the environment variable holding the server's key ("": none).
    verdict: how a judge's next-token distribution becomes a number in
      [0, 1]: "yes_no", P(yes) / (P(yes) + P(no)); or "score", the
      expected score over the digits 0..`max_score` it may answer with,
      divided by `max_score` (the probability-weighted score of G-Eval,
      which a greedy parse of the answer's number would round).
    max_score: the highest score ("score"; 1 to 9, one digit).
    template: the question, with `{prompt}` and `{completion}` (the task's
      text and the completion's; "score" may also name `{max_score}`),
      asked as a user turn of the judge's chat template ("": the verdict's
      default).
    yes_words: the answers that mean yes, each counted by its first token
      (and that of it with a leading space).
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
  verdict: str = "yes_no"
  max_score: int = 9
  template: str = ""
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
    if self.kind in ("hf", "reward_model") and not self.path:
      raise ValueError(f"judge.path must name the judge's Hugging Face folder "
                       f"(judge.kind={self.kind!r})")
    if self.verdict not in VERDICTS:
      raise ValueError(f"judge.verdict must be one of {VERDICTS}, got {self.verdict!r}")
    if type(self.max_score) is not int or not 1 <= self.max_score <= 9:
      raise ValueError(f"judge.max_score must be an int from 1 to 9 (one digit), got "
                       f"{self.max_score!r}")
    if self.kind == "openai" and not self.url.startswith(("http://", "https://")):
      raise ValueError(f"judge.url must be an http(s) URL (judge.kind='openai'), got "
                       f"{self.url!r}")
    for key in ("{prompt}", "{completion}"):
      if key not in self.question_template:
        raise ValueError(f"judge.template must hold {key}")
    try:  # (other braces must be doubled: the template is a str.format string)
      self.question("", "")
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

  @property
  def question_template(self) -> str:
    if self.template:
      return self.template
    return DEFAULT_SCORE_TEMPLATE if self.verdict == "score" else DEFAULT_TEMPLATE

  def question(self, prompt_text: str, completion_text: str) -> str:
    """The judge's question about one completion."""
    return self.question_template.format(prompt=prompt_text, completion=completion_text,
                                         max_score=self.max_score)

  def answer_values(self) -> dict[str, float]:
    """Each answer word the verdict counts, and its value in [0, 1]."""
    if self.verdict == "score":
      return {str(d): d / self.max_score for d in range(self.max_score + 1)}
    return {**dict.fromkeys(self.no_words, 0.0), **dict.fromkeys(self.yes_words, 1.0)}
