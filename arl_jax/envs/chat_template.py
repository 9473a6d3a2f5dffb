"""Chat templates: how a conversation becomes the text a chat model was trained on.

Templates are named: `none` (plain text), `chatml` (Qwen and others:
`<|im_start|>role\\ncontent<|im_end|>\\n`) and `llama3`
(`<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`). A
template read from a Hugging Face folder keeps the folder's Jinja source too
(`from_jinja`), and prompts are rendered by it as transformers renders them
(`jinja2`'s sandbox), so what a model's own template adds, such as the
default system turn of SmolLM2 or Qwen2.5, is in every prompt; the named
structure still serves observations and the stop token. Both
tokenizers carry one (the byte tokenizer always `none`), so environments write
prompts and observations the same way whatever the tokenizer:

- a prompt is a user turn followed by the assistant's turn prefix
  (`format_chat`);
- an observation (a tool result, the other side of a dialogue) closes nothing
  (the policy's turn already ended on the end-of-turn token): it is a whole
  `role` turn followed by the assistant's turn prefix (`observation`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """Each message is `turn_prefix.format(role=...) + content + turn_suffix`.

  Attributes:
    turn_prefix: opens a turn; contains `{role}`.
    turn_suffix: closes a turn (starts with the end-of-turn token, if any).
    end_of_turn: the special token that ends a turn, None for `none`. The
      sampler stops on it; multi-turn environments answer after it.
    specials: the special tokens the template relies on (checked against the
      vocabulary when a tokenizer is loaded).
  """

  turn_prefix: str
  turn_suffix: str
  end_of_turn: str | None
  specials: tuple[str, ...]
  # The model's own Jinja template, and the special tokens it may refer to
  # (`bos_token`, `eos_token`), when read from a folder (`from_jinja`).
  jinja: str | None = None
  jinja_tokens: tuple[tuple[str, str], ...] = ()

  @property
  def is_chat(self) -> bool:
    """Whether the template wraps messages at all (`none` does not)."""
    return bool(self.turn_prefix)

  def assistant_prefix(self) -> str:
    return self.turn_prefix.format(role="assistant")

  def format_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                  tools: Sequence[dict] | None = None, **template_kwargs) -> str:
    """`[{"role": ..., "content": ...}, ...]` as text, ending with the
    assistant's turn prefix when `add_generation_prompt` (rendered by the
    model's Jinja template when there is one).

    `tools` (OpenAI function schemas) and `template_kwargs` (e.g. Qwen3's
    `enable_thinking`) go to the model's Jinja template, as transformers'
    `apply_chat_template` passes them; a named template without one renders
    neither (ValueError for tools).
    """
    if self.jinja is not None:
      return _compiled(self.jinja).render(
          **template_kwargs, messages=list(messages), add_generation_prompt=add_generation_prompt,
          **({"tools": list(tools)} if tools else {}), **dict(self.jinja_tokens))
    if tools:
      raise ValueError("tools need the model's own (Jinja) chat template, which renders them "
                       "as it was trained; this tokenizer has the named template only")
    text = "".join(self.turn_prefix.format(role=m["role"]) + m["content"] + self.turn_suffix
                   for m in messages)
    return text + self.assistant_prefix() if add_generation_prompt else text

  def observation(self, role: str, content: str) -> str:
    """What an environment appends after the policy ended its turn on the
    end-of-turn token: the rest of the closing suffix (e.g. chatml's newline),
    a `role` turn, then the assistant's turn prefix. Plain text for `none`."""
    return self.observations([{"role": role, "content": content}])

  def observations(self, messages: Sequence[dict]) -> str:
    """`observation` of several messages: each its own turn, then the
    assistant's turn prefix (only that, after the suffix, for none)."""
    if not self.is_chat:
      return "".join(m["content"] for m in messages)
    rest_of_suffix = self.turn_suffix[len(self.end_of_turn or ""):]
    return (rest_of_suffix + "".join(self.turn_prefix.format(role=m["role"]) + m["content"]
                                     + self.turn_suffix for m in messages)
            + self.assistant_prefix())


CHAT_TEMPLATES = {
    "none": ChatTemplate(turn_prefix="", turn_suffix="", end_of_turn=None, specials=()),
    "chatml": ChatTemplate(turn_prefix="<|im_start|>{role}\n", turn_suffix="<|im_end|>\n",
                           end_of_turn="<|im_end|>", specials=("<|im_start|>", "<|im_end|>")),
    "llama3": ChatTemplate(
        turn_prefix="<|start_header_id|>{role}<|end_header_id|>\n\n", turn_suffix="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
}


# Markers that identify a tokenizer_config.json Jinja template as one of ours.
_MARKERS = {"chatml": "<|im_start|>", "llama3": "<|start_header_id|>"}


class _TemplateError(Exception):
  """`raise_exception(...)` in a Jinja template."""


def _raise(message: str) -> None:
  raise _TemplateError(message)


@functools.cache
def _compiled(jinja: str):
  """The template compiled as transformers compiles chat templates (sandboxed,
  `trim_blocks`/`lstrip_blocks`, loop controls, `raise_exception`,
  `strftime_now`, a `tojson` that keeps non-ASCII)."""
  from jinja2 import sandbox  # noqa: PLC0415 - the [hf] extra

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                            indent=indent)
  env.globals["raise_exception"] = _raise
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(jinja)


def from_jinja(jinja: str | None, where: str = "tokenizer_config.json",
               tokens: dict[str, str] | None = None) -> ChatTemplate:
  """The named template `jinja` writes (`detect`), rendering prompts with
  `jinja` itself; `tokens`: `bos_token`/`eos_token` values it may use.

  Raises:
    ValueError: naming `where`, for a template arl_jax does not implement or
      one whose prompt does not end with the assistant's turn prefix (the
      observations of multi-turn environments are written from the named
      structure and must continue what the template wrote).
  """
  name = detect(jinja, where)
  named = CHAT_TEMPLATES[name]
  if name == "none":
    return named
  template = dataclasses.replace(named, jinja=jinja, jinja_tokens=tuple(
      sorted((k, v) for k, v in (tokens or {}).items() if isinstance(v, str))))
  try:
    probe = template.format_chat([{"role": "user", "content": "PROBE"}])
  except Exception as e:  # noqa: BLE001 - any error of the template's own, named
    raise ValueError(f"{where}: its chat template does not render a user turn: "
                     f"{type(e).__name__}: {e}; set tokenizer.chat_template={name!r} to write "
                     "prompts from the named structure instead") from e
  if "PROBE" not in probe or not probe.endswith(named.assistant_prefix()):
    raise ValueError(f"{where}: its chat template writes {probe!r} for a user turn, which does "
                     f"not end with the assistant's turn prefix {named.assistant_prefix()!r}; "
                     f"set tokenizer.chat_template={name!r} to write prompts from the named "
                     "structure instead")
  return template


def detect(jinja: str | None, where: str = "tokenizer_config.json") -> str:
  """The named template a Hugging Face Jinja chat template writes (`none`
  when there is none); an error for one arl_jax does not implement."""
  if not jinja:
    return "none"
  found = [name for name, marker in _MARKERS.items() if marker in jinja]
  if len(found) != 1:
    raise ValueError(f"{where}: its chat template is not one arl_jax implements "
                     f"({', '.join(_MARKERS)}); set tokenizer.chat_template explicitly")
  return found[0]
