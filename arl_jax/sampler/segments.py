"""`Segment`: a slot's segment as the runner reads it back to the host (what
the JAX-free scheduler adds to episodes)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NO_ALTERNATIVE = -1  # a `top_ids` entry where no token was sampled in the slot's segment


class Segment(NamedTuple):
  """A slot's segment as read on the host, from its first completion column
  (a resumed open segment's tokens included).

  Attributes:
    tokens, logprobs, versions: `[n]` each, as sampled.
    stopped: whether it ended on a stop token.
    alternatives: None, or `(top_ids [n, K], top_logprobs [n, K])` when the
      sampler records K alternatives per token (`SamplingSettings.top_logprobs`);
      an open segment's rows hold `NO_ALTERNATIVE` (its episode kept them).
  """

  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  stopped: bool
  alternatives: tuple[np.ndarray, np.ndarray] | None = None
