"""An adapter over the Hugging Face `tokenizers` library (a local
`tokenizer.json`) with the interface of `tokenizer.ByteTokenizer`: `pad_id`,
`bos_id`, `add_bos`, `eos_id`, `vocab_size`, `encode(text, add_bos)`,
`decode(ids)`, `template`, `end_of_turn_id` and `stop_ids`.

A chat template (`chat_template.py`) is checked against the vocabulary when
the tokenizer is loaded (its special tokens must exist and encode as one id
each), so a mismatched tokenizer fails before a run starts rather than
producing garbled prompts. The end-of-turn token of a template is a stop token
next to EOS.
"""

from __future__ import annotations

import json
import os

import numpy as np

from arl_jax.envs import chat_template as chat_template_lib

# A `tokenizer.*` setting that reads the folder's tokenizer_config.json.
AUTO = "auto"


def _from_tokenizer_config(folder: str, *settings):
  """Replaces each `auto` setting (eos, bos, pad token, chat template) with what
  the folder's `tokenizer_config.json` says, as `transformers` would use it;
  also returns the folder's Jinja chat template (None unless `auto`) and its
  `add_bos_token` (None where it does not say)."""
  path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file (needed by a tokenizer setting 'auto')")
  with open(path, encoding="utf-8") as f:
    try:
      config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ValueError(f"{path}: not JSON: {e}") from e
  if not isinstance(config, dict):
    raise ValueError(f"{path}: must hold a JSON object")

  def token(key):
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value

  eos, bos, pad, template = settings
  if eos == AUTO:
    eos = token("eos_token")
    if not eos:
      raise ValueError(f"{path}: no eos_token; set tokenizer.eos_token")
  bos = token("bos_token") if bos == AUTO else bos
  pad = token("pad_token") if pad == AUTO else pad
  jinja = None
  if template == AUTO:
    jinja = config.get("chat_template")
    if jinja is None and os.path.isfile(os.path.join(folder, "chat_template.jinja")):
      with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
        jinja = f.read()
    if isinstance(jinja, list):  # named templates: the default one
      jinja = next((t["template"] for t in jinja if t.get("name") == "default"), None)
    template = chat_template_lib.detect(jinja, path)
  add_bos = config.get("add_bos_token")
  if add_bos is not None and not isinstance(add_bos, bool):
    raise ValueError(f"{path}: add_bos_token must be true or false, got {add_bos!r}")
  return eos, bos, pad, template, jinja, add_bos


class HfTokenizer:
  """A `tokenizer.json` behind the ByteTokenizer interface."""

  def __init__(self, path: str, *, eos_token: str, bos_token: str | None = None,
               pad_token: str | None = None, chat_template: str = "none"):
    """Args:
      path: a `tokenizer.json` file (or a folder holding one).
      eos_token: the end-of-sequence token (required: it ends completions).
      bos_token: prepended by `encode(add_bos=True)`; None if the model has none
        (then `add_bos` adds nothing). Named here, plain text starts with it
        (`self.add_bos`); `auto`: the folder's BOS, added to plain text only
        where the folder's tokenizer adds it (`add_bos_token` in
        `tokenizer_config.json`, else `tokenizer.json`'s post-processor), as
        transformers does.
      pad_token: padding; defaults to the EOS token (padding is always masked).
      chat_template: one of chat_template_lib.CHAT_TEMPLATES.

    Any of the four may be `auto`: taken from the folder's
    `tokenizer_config.json` (a Hugging Face model folder), the chat template
    recognised from its Jinja source (`chat_template.detect`).
    """
    try:
      import tokenizers  # noqa: PLC0415 - optional dependency (the `hf` extra)
    except ImportError as e:
      raise ImportError("HfTokenizer needs the `tokenizers` package: pip install -e '.[hf]'") from e
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
      raise ValueError(f"no tokenizer file {path!r}")
    jinja = folder_adds_bos = None
    bos_from_folder = bos_token == AUTO
    if AUTO in (eos_token, bos_token, pad_token, chat_template):
      eos_token, bos_token, pad_token, chat_template, jinja, folder_adds_bos = (
          _from_tokenizer_config(os.path.dirname(path), eos_token, bos_token, pad_token,
                                 chat_template))
    templates = chat_template_lib.CHAT_TEMPLATES
    if chat_template not in templates:
      raise ValueError(f"chat_template must be one of {sorted(templates)}, got {chat_template!r}")
    self.path = path
    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    # `tokenizers` raises a bare Exception ("EOF while parsing a string at line
    # 1 column 25") that names no file.
    except Exception as e:  # noqa: BLE001 - its only type; re-raised with the path
      raise ValueError(f"{path}: not a tokenizer.json the tokenizers library can load "
                       f"(corrupt or truncated?): {e}") from e
    self.template = templates[chat_template]
    if jinja and chat_template != "none":  # (the model's own template renders prompts)
      self.template = chat_template_lib.from_jinja(
          jinja, os.path.join(os.path.dirname(path), "tokenizer_config.json"),
          {"bos_token": bos_token, "eos_token": eos_token})
    self.eos_id = self._token_id(eos_token, "eos_token")
    self.bos_id = None if bos_token is None else self._token_id(bos_token, "bos_token")
    # Whether plain text starts with BOS, as the model's own tokenizer encodes
    # it. SmolLM2 names `<|im_start|>` its BOS but never adds it
    # (`add_bos_token: false`): a BOS added anyway put a token before every
    # prompt that no Hugging Face or vLLM deployment of the model sees.
    if self.bos_id is None:
      self.add_bos = False
    elif not bos_from_folder:
      self.add_bos = True
    elif folder_adds_bos is not None:
      self.add_bos = folder_adds_bos
    else:  # (transformers then applies tokenizer.json's post-processor)
      self.add_bos = self._tok.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id]
    self.pad_id = self.eos_id if pad_token is None else self._token_id(pad_token, "pad_token")
    for token in self.template.specials:
      self._token_id(token, f"chat_template {chat_template!r}")
      ids = self._tok.encode(token, add_special_tokens=False).ids
      if len(ids) != 1:
        raise ValueError(f"{path}: chat template {chat_template!r} needs {token!r} to be one "
                         f"special token; it encodes as {ids}")
    end = self.template.end_of_turn
    # What the policy writes to end its turn: the template's end-of-turn
    # token, else EOS. Both end a segment.
    self.end_of_turn_id = self.eos_id if end is None else self._token_id(end, "end of turn")
    self.stop_ids = tuple(dict.fromkeys((self.eos_id, self.end_of_turn_id)))

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
    template's) become their ids. `add_bos` prepends the BOS token unless the
    text already starts with it (a template that writes `{{ bos_token }}`):
    never two. Models without a BOS token (e.g. Qwen) start with the text."""
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
      return [self.bos_id, *ids]
    return ids

  def decode(self, ids) -> str:
    """Decodes up to the first EOS; special tokens (the template's included)
    are skipped."""
    out = []
    for i in np.asarray(ids).tolist():
      if i == self.eos_id:
        break
      out.append(int(i))
    return self._tok.decode(out, skip_special_tokens=True)

  def detokenize(self, ids, *, skip_special_tokens: bool = True) -> str:
    """Text of every id (EOS included), special tokens written out unless skipped."""
    return self._tok.decode([int(i) for i in np.asarray(ids, np.int64).tolist()],
                            skip_special_tokens=skip_special_tokens)
