"""A byte-level tokenizer with special tokens, for CPU demos and tests.

Ids 0..255 are the UTF-8 bytes; the special tokens follow. Real models use the
Hugging Face `tokenizers` library behind the same small interface.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """Bytes plus `<pad>`, `<bos>`, `<eos>`."""

  pad_id: int = 256
  bos_id: int = 257
  eos_id: int = 258

  @property
  def vocab_size(self) -> int:
    return 259

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
