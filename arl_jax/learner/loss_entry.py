"""What a policy loss is to the learner: a registry entry (`loss_registry.py`
collects them from `learner/objectives/`).

A loss is a pure function of arrays (`losses.py`'s conventions: the leading
arguments `logprobs, behaviour_logprobs, advantages, loss_mask`, the keywords
`proximal_logprobs, token_lag, segment_ids`, returning `(per_token_loss,
metrics)`), its own knobs (a frozen dataclass whose fields are keys of the
config's `learner` section, documented and checked there) and how the knobs
become the function's keywords. Adding a loss is one file in
`learner/objectives/` that defines these and an `ENTRIES` dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from arl_jax.core import settings
from arl_jax.learner import mismatch as mismatch_lib


@dataclasses.dataclass(frozen=True)
class LossContext:
  """What the update hands every loss's `kwargs` besides its knobs.

  Attributes:
    correction: the mismatch corrections (None: off).
    age_decay: the age-aware trust region's rate (0: off).
    minibatch_keep: a mask computed over the whole minibatch first (an entry
      with `minibatch_mask`; None otherwise).
  """

  correction: mismatch_lib.Correction | None
  age_decay: float
  minibatch_keep: object = None


@dataclasses.dataclass(frozen=True)
class LossEntry:
  """One policy loss.

  Attributes:
    fn: the per-token loss.
    knobs: its settings' dataclass (None: it has none); several losses may
      share one (`gspo`, `gspo_token`).
    kwargs: `(knobs, LossContext) -> fn's keywords`.
    corrections: takes the decoupled objective and the mismatch corrections
      (vtrace corrects against the behaviour policy itself: False).
    trains_critic: trains a value head (`model.value_head`) beside the policy.
    age_decay: has a clip range the age-aware trust region can shrink.
    minibatch_mask: `(log_ratio, loss_mask, knobs) -> keep [B, L]`, a mask
      the update computes over the whole minibatch before it accumulates
      microbatches, handed back as `LossContext.minibatch_keep` (M2PO's
      second-moment mask); None: the loss masks nothing across microbatches.
  """

  fn: Callable
  knobs: type | None
  kwargs: Callable[[object, LossContext], dict]
  corrections: bool = True
  trains_critic: bool = False
  age_decay: bool = True
  minibatch_mask: Callable | None = None


def non_negative(obj, *keys: str) -> None:
  """Checks that each of `obj`'s `keys` is a number >= 0 (naming the key)."""
  for key in keys:
    value = getattr(obj, key)
    settings.check(isinstance(value, (int, float)) and value >= 0, key,
                   f"must be >= 0, got {value!r}")
