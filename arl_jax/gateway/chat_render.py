"""Chat messages as the model's own template writes them, and the exact
extension of a conversation by its next messages.

A first turn is rendered whole (`prompt`): the model's Jinja template with
the request's `tools`, as transformers' `apply_chat_template` renders it.
A session's next turn is never re-tokenised: its context is the previous
turn's context and the tokens the model sampled, followed by the tokens of
the text the template writes after them (`continuation`): the rest of the
assistant turn's closing (e.g. ChatML's newline after `<|im_end|>`) and the
new messages, up to the next assistant prefix. That text is the difference
of two renderings, so it is what the template itself would write there.
Where the template cannot be extended that way (it re-renders earlier turns
once more messages follow, as Qwen3's drops past reasoning, or the client
changed the `tools` or an earlier message), `continuation` says why
(`Break`), and the gateway counts it.
"""

from __future__ import annotations

import dataclasses
import json

from arl_jax.envs import tokenizer as tokenizer_lib

_ROLES = ("system", "user", "assistant", "tool")
# Template arguments a request may not set (the renderer sets them).
_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class RenderError(ValueError):
  """A message the template cannot render (the client's error: a 400)."""

  def __init__(self, message: str, param: str | None = None):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass(frozen=True)
class Break:
  """Why a conversation could not be extended exactly."""

  reason: str


def _text(content, where: str) -> str:
  """A message's content as text (a list of text parts joined by newlines, as vLLM does)."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  texts = []
  for i, part in enumerate(content):
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
        part.get("text"), str):
      raise RenderError(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': "
                        "...}}) are supported", param=f"{where}.content")
    texts.append(part["text"])
  return "\n".join(texts)


def _arguments(arguments, where: str) -> dict:
  """A tool call's arguments as a dict (templates write them with `tojson`)."""
  if isinstance(arguments, dict):
    return arguments
  try:
    value = json.loads(arguments)
  except (TypeError, json.JSONDecodeError) as e:
    raise RenderError(f"{where}.function.arguments: not a JSON object: {e}",
                      param=f"{where}.function.arguments") from e
  if not isinstance(value, dict):
    raise RenderError(f"{where}.function.arguments: not a JSON object",
                      param=f"{where}.function.arguments")
  return value


def canonical(messages: list[dict]) -> list[dict]:
  """The messages as templates read them, and as sessions compare them:
  `developer` is `system`, content is text, tool-call arguments are
  objects, fields without a value are absent."""
  out = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    role = "system" if message.get("role") == "developer" else message.get("role")
    if role not in _ROLES:
      raise RenderError(f"{where}.role: must be one of {', '.join(_ROLES)} or developer, got "
                        f"{message.get('role')!r}", param=f"{where}.role")
    item = {"role": role, "content": _text(message.get("content"), where)}
    if message.get("name"):
      item["name"] = message["name"]
    if role == "tool":
      item["tool_call_id"] = message.get("tool_call_id") or ""
    calls = message.get("tool_calls") or []
    if calls and role != "assistant":
      raise RenderError(f"{where}: only assistant messages have tool_calls",
                        param=f"{where}.tool_calls")
    if calls:
      item["tool_calls"] = [
          {"id": call.get("id") or "", "type": "function",
           "function": {"name": call["function"]["name"],
                        "arguments": _arguments(call["function"].get("arguments", "{}"),
                                                f"{where}.tool_calls[{j}]")}}
          for j, call in enumerate(calls)]
    out.append(item)
  return out


def check_template_kwargs(kwargs: dict | None) -> dict:
  kwargs = dict(kwargs or {})
  reserved = sorted(set(kwargs) & set(_RESERVED))
  if reserved:
    raise RenderError(f"chat_template_kwargs may not set {reserved}",
                      param="chat_template_kwargs")
  return kwargs


class ChatRenderer:
  """Renders conversations with a tokenizer's chat template."""

  def __init__(self, tokenizer: tokenizer_lib.Tokenizer):
    if not tokenizer.template.is_chat:
      raise ValueError("the tokenizer has no chat template: /v1/chat/completions needs one "
                       "(tokenizer.chat_template)")
    self._tokenizer = tokenizer
    self._template = tokenizer.template

  def render(self, messages: list[dict], *, tools, template_kwargs: dict,
             add_generation_prompt: bool) -> str:
    """`messages` (canonical) as the template writes them."""
    try:
      return self._template.format_chat(messages, add_generation_prompt, tools=tools,
                                        **template_kwargs)
    except ValueError as e:
      raise RenderError(str(e), param="tools" if tools else "messages") from e
    except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception, ...)
      raise RenderError(f"the chat template cannot render these messages: "
                        f"{type(e).__name__}: {e}", param="messages") from e

  def prompt_ids(self, text: str) -> list[int]:
    """Ids of a whole rendered prompt: as transformers' `apply_chat_template`
    tokenises it (a template writes its own BOS; none is added)."""
    added = self._tokenizer.add_bos and self._template.jinja is None
    return self._tokenizer.encode(text, add_bos=added)

  def continuation(self, *, prompt_text: str, history: list[dict], new: list[dict], tools,
                   template_kwargs: dict, ended_on_stop: bool) -> tuple[str, str] | Break:
    """`(text to append, the new prompt's whole text)`, or why not.

    Args:
      prompt_text: the rendering (with the assistant prefix) the previous
        turn sampled after.
      history: the previous turn's messages and the assistant's answer, as
        the client sends them back (canonical).
      new: the messages after it (canonical).
      ended_on_stop: whether the sampled answer ended on a stop token (else
        it was cut short, and the appended text closes the turn first).
    """
    closed = self.render(history, tools=tools, template_kwargs=template_kwargs,
                         add_generation_prompt=False)
    extended = self.render(history + new, tools=tools, template_kwargs=template_kwargs,
                           add_generation_prompt=True)
    if not closed.startswith(prompt_text):
      return Break("the conversation so far renders differently from the prompt the last "
                   "answer was sampled after (changed tools, messages or template arguments)")
    if not extended.startswith(closed):
      return Break("the chat template renders earlier turns differently once new messages "
                   "follow")
    answer = closed[len(prompt_text):]  # the answer as the template writes it, and its closing
    end = self._template.end_of_turn or ""
    at = answer.rfind(end) if end else -1
    if at < 0:
      return Break(f"the chat template writes no end of turn {end!r} after the answer")
    closing = answer[at + len(end):] if ended_on_stop else answer[at:]
    return closing + extended[len(closed):], extended
