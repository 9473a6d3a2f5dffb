"""What an environment is: plain Python (no JAX), called from env worker threads.

Single-turn: the engine samples one segment (prompt -> completion) and the
environment scores it. Multi-turn: after every segment that ends on a stop
token, `step` may answer with observation tokens (a tool result, the other
side of a dialogue); the episode then continues from the whole transcript, and
`score` is called once the episode ends. Observation tokens are part of the
completion with loss mask 0; `max_new_tokens` bounds the whole completion.

Calls may block (a real tool call takes seconds to minutes): the env runner
runs them in a worker pool with a per-call timeout, and an exception or a
timeout marks the rollout `error` (counted, never trained on, never fatal).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence

from arl_jax.envs import tokenizer as tokenizer_lib

# Prompt splits every environment provides (`make_prompts(config, split)`).
SPLITS = ("train", "heldout")


@dataclasses.dataclass(frozen=True)
class TextPrompt:
  """A prompt record: what every built-in environment and the JSONL source use.

  Attributes:
    prompt_id: stable id of the task (drop accounting, requeueing).
    text: the prompt text the environment encodes.
    answer: what the environment checks a completion against.
  """

  prompt_id: int
  text: str
  answer: str


@dataclasses.dataclass(frozen=True)
class Demonstration:
  """A correct completion, for supervised warm-up.

  Attributes:
    completion_ids: the tokens after the prompt (observations included).
    loss_mask: 1.0 on tokens the policy should produce, 0.0 on observations.
  """

  completion_ids: tuple[int, ...]
  loss_mask: tuple[float, ...]

  def __post_init__(self):
    if len(self.completion_ids) != len(self.loss_mask):
      raise ValueError(f"demonstration has {len(self.completion_ids)} tokens and "
                       f"{len(self.loss_mask)} loss-mask entries")


@dataclasses.dataclass(frozen=True)
class Score:
  """A reward with what it is made of: what `score` may return instead of a
  float, when the reward has parts worth logging or an outcome worth counting.

  Attributes:
    reward: what the learner trains on.
    parts: named numbers behind it (`{"fraction_passed": 0.5, "judge": 0.8}`),
      averaged per environment in each step's record (`reward_parts`).
    outcome: how the episode went, in one word (`passed`, `timeout`,
      `no_code`), counted per environment (`env_outcomes`); "" for none.
  """

  reward: float
  parts: Mapping[str, float] = dataclasses.field(default_factory=dict)
  outcome: str = ""

  def __float__(self) -> float:
    return float(self.reward)


def to_score(value) -> Score:
  """What a `score` call answered, as a `Score` (a float, an int, a numpy
  scalar or a `Score`); raises ValueError for a non-finite reward or part."""
  score = value if isinstance(value, Score) else Score(float(value))
  reward = float(score.reward)
  parts = {str(k): float(v) for k, v in score.parts.items()}
  for name, number in (("reward", reward), *parts.items()):
    if not math.isfinite(number):
      raise ValueError(f"{name} {number} is not finite")
  return Score(reward, parts, str(score.outcome))


class Environment(abc.ABC):
  """Base class of every environment: a task whose prompts are its own records
  and whose completions are token ids.

  A subclass defines `name`, `encode_prompt` and `score`; every other hook has
  a default that describes a single-turn environment with one name and the
  sampler's completion budget. A multi-turn environment sets
  `multi_turn = True` (or derives from `MultiTurnEnvironment`) and answers in
  `step`.

  Attributes:
    name: the environment's name in metrics and drop accounting.
    multi_turn: whether `step` may answer between segments.
    stop_ids: tokens besides the tokenizer's that end a segment of a
      multi-turn episode (e.g. the end of a tool call), so the environment
      can answer.
  """

  name: str = ""
  multi_turn: bool = False
  stop_ids: tuple[int, ...] = ()

  @abc.abstractmethod
  def encode_prompt(self, prompt) -> list[int]:
    """Prompt token ids (what the sampler prefills)."""

  @abc.abstractmethod
  def score(self, prompt, completion_ids: Sequence[int]) -> float | Score:
    """Reward of a finished episode (observation tokens included in the
    completion): a number, or a `Score` with its parts and outcome."""

  def demonstration(self, prompt) -> Demonstration | None:
    """A correct completion for `prompt`, or None if the environment knows
    none. The supervised warm-up trains on them (and needs them); config
    validation checks that they fit `sampler.max_new_tokens`."""
    del prompt
    return None

  def step(self, prompt, completion_ids: Sequence[int]) -> list[int] | None:
    """Observation tokens to append before the episode continues, or None to end it.

    Called (for a `multi_turn` environment) after each segment that ended on
    a stop token (EOS included), with the completion so far; the last token
    is the stop token. By default the episode ends.
    """
    del prompt, completion_ids
    return None

  def env_name_of(self, prompt) -> str:
    """The environment `prompt` belongs to (a mixture routes by prompt)."""
    del prompt
    return self.name

  def stop_ids_for(self, prompt) -> tuple[int, ...]:
    """Tokens besides the tokenizer's that end a segment of `prompt`'s episode."""
    del prompt
    return tuple(self.stop_ids) if self.multi_turn else ()

  def max_new_tokens_for(self, prompt) -> int | None:
    """`prompt`'s own completion budget in tokens, or None for the sampler's
    `max_new_tokens` (which caps it either way)."""
    del prompt
    return None


class MultiTurnEnvironment(Environment):
  """An environment that answers between segments (`step` is required)."""

  multi_turn = True

  @abc.abstractmethod
  def step(self, prompt, completion_ids: Sequence[int]) -> list[int] | None:
    """See `Environment.step`."""


def encode_user_prompt(tokenizer: tokenizer_lib.Tokenizer, text: str) -> list[int]:
  """Prompt ids for `text`, as the model's own tokenizer makes them: a user
  turn of the tokenizer's chat template (then the assistant's turn prefix)
  when it has one, else the plain text.

  A model's own (Jinja) template writes whatever BOS the model was trained
  with (Llama 3's `{{ bos_token }}`; none for SmolLM2), and nothing is added
  to it: transformers' `apply_chat_template(tokenize=True)` adds no special
  tokens either. A named template and plain text get the BOS the tokenizer
  adds to text (`tokenizer.add_bos`), never a second one.
  """
  return encode_messages(tokenizer, [{"role": "user", "content": text}])


def encode_messages(tokenizer: tokenizer_lib.Tokenizer, messages: Sequence[dict], *,
                    add_generation_prompt: bool = True) -> list[int]:
  """`encode_user_prompt` of a conversation (`[{"role", "content"}, ...]`,
  ending where the assistant answers, or, without `add_generation_prompt`,
  after its last message); without a chat template, the messages' contents
  one after the other."""
  rendered_by_model = tokenizer.template.is_chat and tokenizer.template.jinja is not None
  if tokenizer.template.is_chat:
    text = tokenizer.template.format_chat(list(messages),
                                          add_generation_prompt=add_generation_prompt)
  else:
    text = "".join(m["content"] for m in messages)
  return tokenizer.encode(text, add_bos=tokenizer.add_bos and not rendered_by_model)


def ended_turn(tokenizer: tokenizer_lib.Tokenizer, completion_ids: Sequence[int]) -> bool:
  """Whether a single-turn completion holds one of the tokenizer's stop tokens
  (EOS or the end of turn), as opposed to being cut off by the length limit.
  An answer that was cut off is wrong even if its text matches."""
  stops = set(tokenizer.stop_ids)
  return any(int(i) in stops for i in completion_ids)


def segment_stop_ids(tokenizer: tokenizer_lib.Tokenizer, env, prompt) -> tuple[int, ...]:
  """Every token that ends a segment of `prompt`'s episode: the tokenizer's
  (EOS, end of turn) and the environment's for this prompt."""
  return tuple(dict.fromkeys((*tokenizer.stop_ids, *env.stop_ids_for(prompt))))


def sampler_stop_ids(tokenizer: tokenizer_lib.Tokenizer, env) -> tuple[int, ...]:
  """The stop tokens besides EOS that any segment may end on (the sampler's
  `SamplingSettings.stop_ids`; each row then says which apply to it)."""
  env_stops = tuple(env.stop_ids) if env.multi_turn else ()
  return tuple(i for i in dict.fromkeys((*tokenizer.stop_ids, *env_stops))
               if i != tokenizer.eos_id)


