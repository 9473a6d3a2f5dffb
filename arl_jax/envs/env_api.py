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

import dataclasses
from collections.abc import Sequence
from typing import Protocol

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


class Environment(Protocol):
  """A task: prompts are the env's own records; completions are token ids."""

  name: str

  def encode_prompt(self, prompt) -> list[int]:
    """Prompt token ids (what the sampler prefills)."""

  def score(self, prompt, completion_ids: Sequence[int]) -> float:
    """Reward of a finished episode (observation tokens included in the completion)."""

  def demonstration(self, prompt) -> Demonstration:
    """A correct completion for `prompt` (only needed by the supervised warm-up)."""


class MultiTurnEnvironment(Environment, Protocol):
  """An environment that answers between segments.

  Attributes:
    stop_ids: tokens besides EOS that end a segment (e.g. the end of a tool
      call), so the environment can answer.
  """

  stop_ids: tuple[int, ...]

  def step(self, prompt, completion_ids: Sequence[int]) -> list[int] | None:
    """Observation tokens to append before the episode continues, or None to end it.

    Called after each segment that ended on a stop token (EOS included), with
    the completion so far; the last token is the stop token.
    """


def encode_user_prompt(tokenizer, text: str) -> list[int]:
  """Prompt ids for `text`: a user turn of the tokenizer's chat template (then
  the assistant's turn prefix) when it has one, else the text after BOS."""
  if tokenizer.template.is_chat:
    text = tokenizer.template.format_chat([{"role": "user", "content": text}])
  return tokenizer.encode(text, add_bos=True)


def ended_turn(tokenizer, completion_ids: Sequence[int]) -> bool:
  """Whether a single-turn completion holds one of the tokenizer's stop tokens
  (EOS or the end of turn), as opposed to being cut off by the length limit.
  An answer that was cut off is wrong even if its text matches."""
  stops = set(tokenizer.stop_ids)
  return any(int(i) in stops for i in completion_ids)


def env_name_of(env, prompt) -> str:
  """The environment a prompt belongs to: `env.env_name_of(prompt)` for a
  mixture of environments, else `env.name`."""
  fn = getattr(env, "env_name_of", None)
  return fn(prompt) if fn is not None else env.name


def stop_ids_of(env, prompt) -> tuple[int, ...]:
  """Tokens besides the tokenizer's that end a segment of `prompt`'s episode:
  `env.stop_ids_for(prompt)` for a mixture, else a multi-turn env's
  `stop_ids`, else none."""
  fn = getattr(env, "stop_ids_for", None)
  if fn is not None:
    return tuple(fn(prompt))
  return tuple(env.stop_ids) if is_multi_turn(env) else ()


def segment_stop_ids(tokenizer, env, prompt) -> tuple[int, ...]:
  """Every token that ends a segment of `prompt`'s episode: the tokenizer's
  (EOS, end of turn) and the environment's for this prompt."""
  return tuple(dict.fromkeys((*tokenizer.stop_ids, *stop_ids_of(env, prompt))))


def sampler_stop_ids(tokenizer, env) -> tuple[int, ...]:
  """The stop tokens besides EOS that any segment may end on (the sampler's
  `SamplingSettings.stop_ids`; each row then says which apply to it)."""
  env_stops = tuple(env.stop_ids) if is_multi_turn(env) else ()
  return tuple(i for i in dict.fromkeys((*tokenizer.stop_ids, *env_stops))
               if i != tokenizer.eos_id)


def budget_of(env, prompt) -> int | None:
  """`prompt`'s own completion budget in tokens (`env.max_new_tokens_for`,
  optional; a mixture routes it), or None for the sampler's `max_new_tokens`.
  The sampler caps it at `max_new_tokens` either way."""
  fn = getattr(env, "max_new_tokens_for", None)
  return None if fn is None else fn(prompt)


def is_multi_turn(env) -> bool:
  """Whether `env` answers between segments (has `step` and `stop_ids`)."""
  return callable(getattr(env, "step", None)) and hasattr(env, "stop_ids")
