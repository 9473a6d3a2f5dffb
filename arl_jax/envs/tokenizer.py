"""Tokenizers: the interface every one implements (`Tokenizer`), a byte-level
one with special tokens for CPU demos and tests, and `make_tokenizer`, which
builds the configured one (`byte`, or `hf`: a local `tokenizer.json` through
`hf_tokenizer.HfTokenizer`). Environments, evaluation and the run take a
`Tokenizer`, never a particular class.

The byte tokenizer's ids 0..255 are the UTF-8 bytes; the special tokens follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from arl_jax.envs import chat_template


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of arl_jax may use of a tokenizer.

  Attributes:
    pad_id: the filler token (always masked).
    bos_id: the beginning-of-sequence token, None if the model has none.
    eos_id: the token that ends a completion.
    add_bos: whether the model's own tokenizer starts plain text with BOS
      (a prompt a chat template rendered gets none added: `env_api`).
    vocab_size: ids are in [0, vocab_size).
    template: the chat template prompts and observations use (`none` for
      plain text).
    end_of_turn_id: the token the policy writes to end its turn (the
      template's end-of-turn token, else EOS).
    stop_ids: every token that ends a segment (EOS and the end of turn).
  """

  pad_id: int
  bos_id: int | None
  eos_id: int
  add_bos: bool

  @property
  def vocab_size(self) -> int: ...

  @property
  def template(self) -> chat_template.ChatTemplate: ...

  @property
  def end_of_turn_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]: ...

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    """Token ids of `text` (special tokens written in it become their ids);
    `add_bos` prepends BOS unless the text already starts with it."""

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids` up to the first EOS, special tokens skipped."""

  def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of every id of `ids` (EOS does not end it); special tokens
    written out unless `skip_special_tokens` (what a server returns)."""


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Bytes plus `<pad>`, `<bos>`, `<eos>`."""

  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258
  # Plain text (the byte tokenizer has no chat template) starts with <bos>.
  add_bos: bool = True

  @property
  def vocab_size(self) -> int:
    return 259

  @property
  def template(self) -> chat_template.ChatTemplate:
    return chat_template.CHAT_TEMPLATES["none"]

  @property
  def end_of_turn_id(self) -> int:
    return self.eos_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

  def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids) -> str:
    """Decodes up to the first `<eos>`; other special ids are skipped."""
    out = bytearray()
    for i in np.asarray(ids).tolist():
      if i == self.eos_id:
        break
      if 0 <= i < 256:
        out.append(i)
    return out.decode("utf-8", errors="replace")

  def detokenize(self, ids, *, skip_special_tokens: bool = True) -> str:
    names = {self.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
    out = bytearray()
    for i in np.asarray(ids, np.int64).tolist():
      if 0 <= i < 256:
        out.append(i)
      elif not skip_special_tokens and i in names:
        out += names[i].encode()
    return out.decode("utf-8", errors="replace")


KINDS = ("byte", "hf")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
  """The `tokenizer` config section.

  Attributes:
    kind: `byte` (no other field used) or `hf`.
    path: `tokenizer.json` (or its folder), for `hf`.
    eos_token: the token that ends a completion, by name, for `hf`. For a
      chat model, usually its end-of-turn token (`<|im_end|>`, `<|eot_id|>`).
    bos_token: the BOS token, by name, for `hf` ("": none); named, plain-text
      prompts start with it; `auto`, they do where the folder's tokenizer adds
      it (`add_bos_token`). A prompt a chat template rendered starts as the
      template writes it, never with a BOS added (as transformers'
      `apply_chat_template`).
    pad_token: the filler token, by name, for `hf` ("": EOS).
    chat_template: `none`, `chatml` or `llama3`, for `hf`.

  The last four may be `auto` for `hf`: read from the `tokenizer_config.json`
  beside `tokenizer.json` (a Hugging Face model folder), the chat template
  recognised from its Jinja source.
  """

  kind: str = "byte"
  path: str = ""
  eos_token: str = ""
  bos_token: str = ""
  pad_token: str = ""
  chat_template: str = "none"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"tokenizer.kind must be one of {KINDS}, got {self.kind!r}")
    if self.kind == "hf" and not (self.path and self.eos_token):
      raise ValueError("tokenizer.kind='hf' needs tokenizer.path and tokenizer.eos_token")


def make_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
  """The configured tokenizer (loading and checking an `hf` file now)."""
  if cfg.kind == "byte":
    return ByteTokenizer()
  from arl_jax.envs import hf_tokenizer  # noqa: PLC0415 - optional dependency
  return hf_tokenizer.HfTokenizer(cfg.path, eos_token=cfg.eos_token,
                                  bos_token=cfg.bos_token or None,
                                  pad_token=cfg.pad_token or None,
                                  chat_template=cfg.chat_template)
