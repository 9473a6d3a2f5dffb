"""Tool calls in a model's answer, parsed into OpenAI `tool_calls`.

Formats (`PARSERS`), as the models that write them were trained:

- `hermes` (Hermes, Qwen2.5/Qwen3, many ChatML models): each call is a JSON
  object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>`, which may be special tokens;
- `llama3_json` (Llama 3.1/3.2): the answer is a JSON object `{"name": ...,
  "parameters": {...}}` (or `"arguments"`), after an optional
  `<|python_tag|>`; several are separated by `;`;
- `none`: the answer is text.

Parsing reads the answer with its special tokens written out, so markers
that are special tokens are seen. A malformed call (bad JSON, no name, a
block never closed) is not an error of the server: the whole answer comes
back as text and `failures` counts it (vLLM's parsers do the same).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """Attributes:
    id: the call's id (`call_...`), which the tool's answer refers to.
    name: the function's name.
    arguments: its arguments as a JSON object's text.
  """

  id: str
  name: str
  arguments: str

  def to_openai(self) -> dict:
    return {"id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class Parsed:
  """Attributes:
    content: the answer's text outside its calls (None: there is none).
    tool_calls: the calls, in order.
    failures: malformed calls (then `tool_calls` is empty and `content` is
      the whole answer).
  """

  content: str | None
  tool_calls: tuple[ToolCall, ...] = ()
  failures: int = 0


def new_call_id() -> str:
  return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj, *argument_keys) -> ToolCall | None:
  """A `ToolCall` from a decoded JSON object, None if it is not one."""
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
    return None
  key = next((k for k in argument_keys if k in obj), None)
  arguments = {} if key is None else obj[key]
  if isinstance(arguments, str):  # (some models write the arguments' JSON as a string)
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      return None
  if not isinstance(arguments, dict):
    return None
  return ToolCall(id=new_call_id(), name=obj["name"],
                  arguments=json.dumps(arguments, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str, strip_specials) -> Parsed:
  if "<tool_call>" not in text:
    return Parsed(content=strip_specials(text) or None)
  calls, failures = [], 0
  for body in _HERMES.findall(text):
    try:
      call = _call(json.loads(body.strip()), "arguments", "parameters")
    except json.JSONDecodeError:
      call = None
    if call is None:
      failures += 1
    else:
      calls.append(call)
  failures += text.count("<tool_call>") - len(_HERMES.findall(text))  # (never closed)
  if failures:
    return Parsed(content=strip_specials(text) or None, failures=failures)
  content = strip_specials(_HERMES.sub("", text)).strip()
  return Parsed(content=content or None, tool_calls=tuple(calls))


def parse_llama3_json(text: str, strip_specials) -> Parsed:
  body = text.strip()
  tagged = body.startswith("<|python_tag|>")
  body = body.removeprefix("<|python_tag|>").strip()
  if not body.startswith("{"):
    return Parsed(content=strip_specials(text) or None, failures=int(tagged))
  decoder, calls, at = json.JSONDecoder(), [], 0
  while at < len(body):
    try:
      obj, end = decoder.raw_decode(body, at)
    except json.JSONDecodeError:
      return Parsed(content=strip_specials(text) or None, failures=1)
    call = _call(obj, "parameters", "arguments")
    if call is None:
      return Parsed(content=strip_specials(text) or None, failures=1)
    calls.append(call)
    at = end
    while at < len(body) and body[at] in " \t\r\n;":
      at += 1
  return Parsed(content=None, tool_calls=tuple(calls))


def parse_none(text: str, strip_specials) -> Parsed:
  return Parsed(content=strip_specials(text) or None)


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "none": parse_none}

# The format a model of each named chat template writes (`chat_template.py`).
TEMPLATE_PARSERS = {"chatml": "hermes", "llama3": "llama3_json", "none": "none"}


def parser_name(setting: str, template_name: str) -> str:
  """The parser a `tool_parser` setting names (`auto`: the template's)."""
  name = TEMPLATE_PARSERS.get(template_name, "none") if setting == "auto" else setting
  if name not in PARSERS:
    raise ValueError(f"tool_parser must be 'auto' or one of {sorted(PARSERS)}, got {setting!r}")
  return name


def parse(name: str, text: str, strip_specials=lambda t: t) -> Parsed:
  """`text` (the answer with special tokens written out) parsed by parser
  `name`; `strip_specials` removes special tokens from what becomes content."""
  return PARSERS[name](text, strip_specials)
