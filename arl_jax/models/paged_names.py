"""The names and constants of the paged KV cache that host code needs
without JAX: the attention implementations and pool layouts a config may
name, and the trash page (`paged_kv_cache.py`, `sampler/page_pool.py`).

The sampler's scheduler (`sampler/scheduler.py`) is plain Python; it reads
these, so they live apart from the kernels.
"""

from __future__ import annotations

ATTENTIONS = ("xla", "pallas", "pallas_interpret", "ragged")
LAYOUTS = ("split", "interleaved")
TRASH_PAGE = 0  # never handed out: unfilled table entries and masked writes point here


def check_name(attention: str) -> None:
  if attention not in ATTENTIONS:
    raise ValueError(f"paged attention must be one of {ATTENTIONS}, got {attention!r}")


def pool_layout(attention: str) -> str:
  """The pool layout `attention` reads (the XLA path reads either)."""
  return "interleaved" if attention == "ragged" else "split"


def check_layout(attention: str, layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"a paged pool's layout must be one of {LAYOUTS}, got {layout!r}")
  if attention != "xla" and layout != pool_layout(attention):
    raise ValueError(f"paged attention {attention!r} reads the {pool_layout(attention)!r} "
                     f"pool layout, not {layout!r}")
