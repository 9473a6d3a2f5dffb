"""Chat templates: how a conversation becomes the text a chat model was trained on.

Templates are named, not Jinja: `none` (plain text), `chatml` (Qwen and
others: `<|im_start|>role\\ncontent<|im_end|>\\n`) and `llama3`
(`<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`). Both
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

  @property
  def is_chat(self) -> bool:
    """Whether the template wraps messages at all (`none` does not)."""
    return bool(self.turn_prefix)

  def assistant_prefix(self) -> str:
    return self.turn_prefix.format(role="assistant")

  def format_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """`[{"role": ..., "content": ...}, ...]` as text, ending with the
    assistant's turn prefix when `add_generation_prompt`."""
    text = "".join(self.turn_prefix.format(role=m["role"]) + m["content"] + self.turn_suffix
                   for m in messages)
    return text + self.assistant_prefix() if add_generation_prompt else text

  def observation(self, role: str, content: str) -> str:
    """What an environment appends after the policy ended its turn on the
    end-of-turn token: the rest of the closing suffix (e.g. chatml's newline),
    a `role` turn, then the assistant's turn prefix. Plain text for `none`."""
    if not self.is_chat:
      return content
    rest_of_suffix = self.turn_suffix[len(self.end_of_turn or ""):]
    return (rest_of_suffix + self.turn_prefix.format(role=role) + content + self.turn_suffix
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
