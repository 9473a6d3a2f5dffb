"""An adapter over the Hugging Face `tokenizers` library (a local
`tokenizer.json`) with the interface of `tokenizer.ByteTokenizer`: `pad_id`,
`bos_id`, `eos_id`, `vocab_size`, `encode(text, add_bos)`, `decode(ids)`, plus
`stop_ids` and a chat template for multi-turn episodes.

Chat templates are named, not Jinja: `none` (plain text), `chatml`
(Qwen and others: `<|im_start|>role\\ncontent<|im_end|>\\n`) and `llama3`
(`<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`). A named
template is checked against the vocabulary when the tokenizer is loaded (its
special tokens must exist and encode as one id each), so a mismatched
tokenizer fails before a run starts rather than producing garbled prompts.
The end-of-turn token of a template is a stop token next to EOS.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """How a conversation becomes text: each message is `prefix + content + suffix`."""

  turn_prefix: str  # with `{role}`
  turn_suffix: str
  end_of_turn: str | None  # the special token that ends a turn (a stop token)
  specials: tuple[str, ...]  # special tokens the template relies on


CHAT_TEMPLATES = {
    "none": ChatTemplate(turn_prefix="", turn_suffix="", end_of_turn=None, specials=()),
    "chatml": ChatTemplate(turn_prefix="<|im_start|>{role}\n", turn_suffix="<|im_end|>\n",
                           end_of_turn="<|im_end|>", specials=("<|im_start|>", "<|im_end|>")),
    "llama3": ChatTemplate(
        turn_prefix="<|start_header_id|>{role}<|end_header_id|>\n\n", turn_suffix="<|eot_id|>",
        end_of_turn="<|eot_id|>",
        specials=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
}


class HfTokenizer:
  """A `tokenizer.json` behind the ByteTokenizer interface."""

  def __init__(self, path: str, *, eos_token: str, bos_token: str | None = None,
               pad_token: str | None = None, chat_template: str = "none"):
    """Args:
      path: a `tokenizer.json` file (or a folder holding one).
      eos_token: the end-of-sequence token (required: it ends completions).
      bos_token: prepended by `encode(add_bos=True)`; None if the model has none
        (then `add_bos` adds nothing).
      pad_token: padding; defaults to the EOS token (padding is always masked).
      chat_template: one of CHAT_TEMPLATES.
    """
    try:
      import tokenizers  # noqa: PLC0415 - optional dependency (the `hf` extra)
    except ImportError as e:
      raise ImportError("HfTokenizer needs the `tokenizers` package: pip install -e '.[hf]'") from e
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise ValueError(f"no tokenizer file {path!r}")
    if chat_template not in CHAT_TEMPLATES:
      raise ValueError(f"chat_template must be one of {sorted(CHAT_TEMPLATES)}, got "
                       f"{chat_template!r}")
    self.path = path
    self._tok = tokenizers.Tokenizer.from_file(path)
    self.template = CHAT_TEMPLATES[chat_template]
    self.eos_id = self._token_id(eos_token, "eos_token")
    self.bos_id = None if bos_token is None else self._token_id(bos_token, "bos_token")
    self.pad_id = self.eos_id if pad_token is None else self._token_id(pad_token, "pad_token")
    for token in self.template.specials:
      self._token_id(token, f"chat_template {chat_template!r}")
      ids = self._tok.encode(token, add_special_tokens=False).ids
      if len(ids) != 1:
        raise ValueError(f"{path}: chat template {chat_template!r} needs {token!r} to be one "
                         f"special token; it encodes as {ids}")
    end = self.template.end_of_turn
    self.stop_ids = (self.eos_id,) + (() if end is None else (self._token_id(end, "turn"),))

  def _token_id(self, token: str, what: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{self.path}: {what} {token!r} is not in the vocabulary")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of `text`; special tokens written in it (e.g. the chat
    template's) become their ids."""
    ids = self._tok.encode(text, add_special_tokens=False).ids
    # Models without a BOS token (e.g. Qwen) simply start with the text.
    return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

  def decode(self, ids) -> str:
    """Decodes up to the first EOS; special tokens are skipped."""
    out = []
    for i in np.asarray(ids).tolist():
      if i == self.eos_id:
        break
      out.append(int(i))
    return self._tok.decode(out, skip_special_tokens=True)

  def format_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """`[{"role": ..., "content": ...}, ...]` as text in the chat template,
    ending with the assistant's turn prefix when `add_generation_prompt`."""
    t = self.template
    text = "".join(t.turn_prefix.format(role=m["role"]) + m["content"] + t.turn_suffix
                   for m in messages)
    if add_generation_prompt:
      text += t.turn_prefix.format(role="assistant")
    return text

  def observation(self, role: str, content: str) -> str:
    """The text an environment appends after the policy ended its turn (on
    the end-of-turn token): a `role` turn, then the assistant's turn prefix."""
    t = self.template
    return (t.turn_prefix.format(role=role) + content + t.turn_suffix
            + t.turn_prefix.format(role="assistant"))
