"""A finished segment as an answer: stop strings applied, text, tool calls,
finish reason, and the OpenAI shapes of its log-probs.

A stop string is found in the segment's text after it ended (the engine
stops on tokens); the tokens after the one that completes it are dropped
from the episode (`Episode.drop_sampled_tail`), so the trajectory a trainer
reads is the answer the client got, and a next turn goes on from it.
"""

from __future__ import annotations

import dataclasses

from arl_jax.core import episode as episode_lib
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.gateway import tool_calls as tool_calls_lib
from arl_jax.sampler import segments


@dataclasses.dataclass
class Answer:
  """Attributes:
    token_ids, logprobs, versions: the segment's tokens as kept, each with
      its behaviour log-prob and the policy version that sampled it.
    text: the answer's text (stop string and final stop token excluded
      unless asked for).
    finish_reason: `stop`, `length` or `tool_calls`.
    context_len: the tokens before the segment (prompt and earlier turns).
    ends_on_stop_token: its last token is a stop token (EOS, end of turn).
    content, tool_calls, parse_failures: the chat answer after tool-call
      parsing (`content` is `text` when there is none).
    alternatives: per token, the `(token id, log-prob)` of the most likely
      tokens of the distribution it was drawn from, most likely first (empty
      lists when the sampler records none: `SamplingSettings.top_logprobs`).
  """

  token_ids: list[int]
  logprobs: list[float]
  versions: list[int]
  text: str
  finish_reason: str
  context_len: int
  ends_on_stop_token: bool
  content: str | None = None
  tool_calls: tuple[tool_calls_lib.ToolCall, ...] = ()
  parse_failures: int = 0
  alternatives: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


def _cut_at_stop_string(tokens, text: str, stops, detokenize):
  """`(tokens kept, cut position in text)` for the earliest stop string, or None."""
  found = [(text.find(s), s) for s in stops if s and s in text]
  if not found:
    return None
  at, stop = min(found)
  lo, hi = 1, len(tokens)  # the fewest tokens whose text holds the stop string
  while lo < hi:
    mid = (lo + hi) // 2
    if detokenize(tokens[:mid]).find(stop) == at:
      hi = mid
    else:
      lo = mid + 1
  return lo, at, stop


def finish(episode: episode_lib.Episode, start: int, *, tokenizer: tokenizer_lib.Tokenizer,
           stops, include_stop_str: bool, skip_special_tokens: bool) -> Answer:
  """The answer of `episode`'s segment that began at completion index `start`
  (cutting the episode at a stop string)."""
  context_len = len(episode.prompt_ids) + start
  tokens = episode.completion_ids[start:]
  ended_on_token = episode.last_stopped
  detokenize = lambda ids: tokenizer.detokenize(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
  body = tokens[:-1] if ended_on_token and not include_stop_str else tokens
  text = detokenize(body)
  finish_reason = "stop" if ended_on_token else "length"
  cut = _cut_at_stop_string(tokens, detokenize(tokens), stops, detokenize) if stops else None
  if cut is not None:
    kept, at, stop = cut
    episode.drop_sampled_tail(len(tokens) - kept)
    tokens = tokens[:kept]
    text = detokenize(tokens)[:at + (len(stop) if include_stop_str else 0)]
    finish_reason = "stop"
  n = len(tokens)
  return Answer(token_ids=list(tokens), logprobs=list(episode.logprobs[len(episode.logprobs) - n:]),
                versions=list(episode.versions[len(episode.versions) - n:]), text=text,
                finish_reason=finish_reason, context_len=context_len,
                ends_on_stop_token=ended_on_token and cut is None, content=text,
                alternatives=_alternatives(episode.last_alternatives, n))


def _alternatives(recorded, n: int) -> list[list[tuple[int, float]]]:
  """The last `n` tokens' alternatives of an episode's `last_alternatives`."""
  if recorded is None:
    return [[] for _ in range(n)]
  ids, logps = recorded
  rows = range(len(ids) - n, len(ids))
  return [[(int(t), float(lp)) for t, lp in zip(ids[i], logps[i]) if t != segments.NO_ALTERNATIVE]
          for i in rows]


def parse_tools(answer: Answer, parser: str, tokenizer: tokenizer_lib.Tokenizer,
                special_texts) -> None:
  """Parses `answer`'s tool calls (`tool_calls.parse`) from its tokens with
  special tokens written out (markers may be special tokens)."""
  ids = answer.token_ids[:-1] if answer.ends_on_stop_token else answer.token_ids
  raw = tokenizer.detokenize(ids, skip_special_tokens=False)

  def strip(text: str) -> str:
    for special in special_texts:
      text = text.replace(special, "")
    return text

  parsed = tool_calls_lib.parse(parser, raw, strip)
  answer.parse_failures = parsed.failures
  if parsed.tool_calls:
    answer.content, answer.tool_calls = parsed.content, parsed.tool_calls
    if answer.finish_reason == "stop":
      answer.finish_reason = "tool_calls"


def _token_text(token: int, tokenizer: tokenizer_lib.Tokenizer, as_ids: bool) -> str:
  return f"token_id:{token}" if as_ids else tokenizer.detokenize([token],
                                                                 skip_special_tokens=False)


def chat_logprobs(answer: Answer, tokenizer: tokenizer_lib.Tokenizer, as_ids: bool,
                  top: int = 0) -> dict:
  """`choices[i].logprobs` of a chat completion: each sampled token's, with
  its `top` most likely alternatives."""
  def entry(token: int, logprob: float) -> dict:
    text = _token_text(token, tokenizer, as_ids)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

  return {"content": [
      entry(token, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in alternatives[:top]]}
      for token, logprob, alternatives in zip(answer.token_ids, answer.logprobs,
                                              answer.alternatives)]}


def completion_logprobs(answer: Answer, tokenizer: tokenizer_lib.Tokenizer, as_ids: bool,
                        top: int = 0) -> dict:
  """`choices[i].logprobs` of a legacy completion; with `top`, each token's
  `top` most likely alternatives and itself (as OpenAI's: up to top + 1)."""
  tokens = [_token_text(t, tokenizer, as_ids) for t in answer.token_ids]
  offsets, at = [], 0
  for token in tokens:
    offsets.append(at)
    at += len(token)
  top_logprobs = None
  if top:
    top_logprobs = [
        {_token_text(t, tokenizer, as_ids): lp for t, lp in [*alternatives[:top], (token, logprob)]}
        for token, logprob, alternatives in zip(answer.token_ids, answer.logprobs,
                                                answer.alternatives)]
  return {"tokens": tokens, "token_logprobs": list(answer.logprobs), "top_logprobs": top_logprobs,
          "text_offset": offsets}
