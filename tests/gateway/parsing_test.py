"""Tool-call parsers on the formats real models write, and the exact
extension of a conversation (where a template allows it, and where not)."""

import dataclasses
import json

import pytest

from arl_jax.gateway import chat_render, tool_calls
from arl_jax.testing import served


@pytest.mark.parametrize("text,names,content", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', ["f"], None),
    ('Let me look.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>', ["f", "g"],
     "Let me look."),
    ("No call here.<|im_end|>", [], "No call here."),
])
def test_hermes_calls(text, names, content):
  parsed = tool_calls.parse("hermes", text, lambda t: t.replace("<|im_end|>", ""))
  assert [c.name for c in parsed.tool_calls] == names and parsed.content == content
  assert parsed.failures == 0
  assert all(isinstance(json.loads(c.arguments), dict) for c in parsed.tool_calls)


@pytest.mark.parametrize("text,failures", [
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>', 1),
    ('<tool_call>{"arguments": {}}</tool_call>', 1),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', 1),
    ('<tool_call>{"name": "f", "arguments": {}}', 1),  # never closed
    ('<tool_call>{"name": "f"}</tool_call><tool_call>{bad}</tool_call>', 1),
])
def test_a_malformed_hermes_call_is_text_and_counted(text, failures):
  parsed = tool_calls.parse("hermes", text)
  assert parsed.tool_calls == () and parsed.content == text and parsed.failures == failures


def test_llama3_json_calls():
  parsed = tool_calls.parse("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; '
                                           '{"name": "g", "arguments": {}}')
  assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"a": 1}),
                                                                           ("g", {})]
  assert tool_calls.parse("llama3_json", "Just text.").content == "Just text."
  bad = tool_calls.parse("llama3_json", '{"name": "f", "parameters": {')
  assert bad.failures == 1 and bad.tool_calls == ()


def test_the_parser_follows_the_template_unless_named():
  assert tool_calls.parser_name("auto", "chatml") == "hermes"
  assert tool_calls.parser_name("auto", "llama3") == "llama3_json"
  with pytest.raises(ValueError, match="tool_parser"):
    tool_calls.parser_name("mistral", "chatml")


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
  return chat_render.ChatRenderer(served.chat_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _continue(renderer, history, new, ended_on_stop=True, tools=None):
  """The continuation of `history` (sampled after a prompt without tools) by `new`."""
  prompt = renderer.render(history[:-1], tools=None, template_kwargs={},
                           add_generation_prompt=True)
  return renderer.continuation(prompt_text=prompt, history=chat_render.canonical(history),
                               new=chat_render.canonical(new), tools=tools, template_kwargs={},
                               ended_on_stop=ended_on_stop)


def test_the_continuation_is_what_the_template_writes_after_the_answer(renderer):
  history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
  new = [{"role": "user", "content": "Again"}]
  text, whole = _continue(renderer, history, new)
  assert text == "\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
  assert whole.endswith(text)
  text, _ = _continue(renderer, history, new, ended_on_stop=False)  # (cut short: closed first)
  assert text.startswith("<|im_end|>\n<|im_start|>user")


def test_changed_tools_or_history_break_the_extension(renderer):
  history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
  tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
  found = _continue(renderer, history, [{"role": "user", "content": "x"}], tools=tools)
  assert isinstance(found, chat_render.Break) and "tools" in found.reason
  # A template that re-renders earlier turns once more follow (as Qwen3's
  # drops past reasoning) cannot be extended.
  jinja = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if loop.last else "
           "m.content | upper }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
  changing = chat_render.ChatRenderer(renderer._tokenizer)
  changing._template = dataclasses.replace(renderer._template, jinja=jinja)
  found = _continue(changing, history, [{"role": "user", "content": "x"}])
  assert isinstance(found, chat_render.Break)
