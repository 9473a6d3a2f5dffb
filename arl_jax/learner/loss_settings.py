"""The learner update's settings, split by what they are: the objective, the
mismatch corrections, each loss's own knobs (declared beside the loss,
`learner/objectives/`), the optimizer-step layout and how the forward pass is
scored. Each is a frozen dataclass whose fields are keys of the config's
`learner` section (`schema.SECTIONS`; with `optim.OptimConfig`);
`LossSettings` holds one of each and is what `update.train_step` takes.

A loss reads its own dataclass only (`LossSettings.loss_knobs`), so a knob of
one loss is never mistaken for another's.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import Mesh

from arl_jax.core import advantages as advantages_lib
from arl_jax.core import settings
from arl_jax.learner import loss_entry, loss_registry
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import mismatch as mismatch_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import segment_attention as segment_attention_lib

_check = settings.check


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
  """What the update optimises, whatever the loss.

  Attributes:
    loss: the policy loss, a key of `loss_registry.LOSSES` (clipped_ratio,
      vtrace, m2po, cispo, gspo, gspo_token); its knobs are its own
      dataclass's, beside it in `learner/objectives/`.
    advantage: the advantage estimator (`advantages.ADVANTAGE_ESTIMATORS`).
    age_decay: the age-aware trust region: clip ranges shrink with a token's
      lag by this rate (0: off).
    decoupled: a decoupled objective (proximal policy recomputed) even for one
      optimizer step per batch.
    aggregation: how token terms become the loss (`losses.AGGREGATIONS`).
    kl_coef: weight of a KL penalty to the policy RL started from (after any
      warm-up; 0: off).
    entropy_coef: weight of an entropy bonus (0: off).
    critic: vtrace actor-critic: the model has a value head (the run's
      `model.value_head`).
    norm_constant: seq_sum_norm's divisor (the run's `sampler.max_new_tokens`).
    temperature: the sampler's temperature, at which log-probs are scored.
  """

  loss: str = "clipped_ratio"
  advantage: str = "grpo"
  age_decay: float = 0.0
  decoupled: bool = False
  aggregation: str = "token_mean"
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  critic: bool = settings.derived(False, "model.value_head")
  norm_constant: float = settings.derived(0.0, "sampler.max_new_tokens")
  temperature: float = settings.derived(1.0, "sampler.temperature")

  def __post_init__(self):
    _check(self.loss in loss_registry.LOSSES, "loss",
           f"unknown loss {self.loss!r}; known: {sorted(loss_registry.LOSSES)}")
    _check(self.advantage in advantages_lib.ADVANTAGE_ESTIMATORS, "advantage",
           f"must be one of {advantages_lib.ADVANTAGE_ESTIMATORS}, got {self.advantage!r}")
    loss_entry.non_negative(self, "age_decay", "kl_coef", "entropy_coef")
    _check(isinstance(self.decoupled, bool), "decoupled",
           f"must be True or False, got {self.decoupled!r}")
    _check(self.aggregation in losses_lib.AGGREGATIONS, "aggregation",
           f"must be one of {losses_lib.AGGREGATIONS}, got {self.aggregation!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepLayout:
  """How one batch becomes optimizer steps and rows.

  Attributes:
    num_epochs: passes over each batch.
    num_minibatches: optimizer steps per pass.
    num_microbatches: slices a minibatch's gradient is accumulated over (memory).
    pack_len: rollouts packed into rows of up to this many tokens, several a
      row (0: one rollout a padded row): `packing.py`.
  """

  num_epochs: int = 1
  num_minibatches: int = 1
  num_microbatches: int = 1
  pack_len: int = 0

  def __post_init__(self):
    for key in ("num_epochs", "num_minibatches", "num_microbatches"):
      value = getattr(self, key)
      _check(settings.is_int(value) and value >= 1, key, f"must be an int >= 1, got {value!r}")
    _check(settings.is_int(self.pack_len) and self.pack_len >= 0, "pack_len",
           f"must be an int >= 0 (0: padded rows), got {self.pack_len!r}")

  @property
  def optimizer_steps(self) -> int:
    return self.num_epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scoring:
  """How the learner's forward pass is computed: memory controls and the
  attention kernel (`logprobs.token_logprobs_and_entropy`).

  Attributes:
    logprob_chunk: tokens whose float32 logits exist at once when scoring (0:
      every token of a microbatch); at a large vocabulary they dominate the
      learner's memory (`learner/logprobs.py`).
    attention_chunk: queries whose attention scores exist at once (0: a whole
      row's): `models/segment_attention.py`.
    remat: what the backward pass keeps of each decoder block: none | block | dots.
    attention: the training attention: auto (the learner platform's kernel:
      splash on TPU, pallas_gpu on GPU, xla elsewhere; chosen by `config_lib`)
      | xla | splash (TPU) | pallas_gpu (GPU) | splash_interpret,
      pallas_gpu_interpret (anywhere, slowly): `models/segment_attention.py`.
    scan_layers: the decoder's blocks as one lax.scan over their stacked
      parameters: the same numbers; the backward pass's scratch exists once,
      not per layer.
  """

  logprob_chunk: int = 0
  attention_chunk: int = 0
  remat: str = "none"
  attention: str = "xla"
  scan_layers: bool = False

  def __post_init__(self):
    for key in ("logprob_chunk", "attention_chunk"):
      value = getattr(self, key)
      _check(settings.is_int(value) and value >= 0, key,
             f"must be an int >= 0 (0: off), got {value!r}")
    _check(self.remat in decoder_lib.REMAT_POLICIES, "remat",
           f"must be one of {sorted(decoder_lib.REMAT_POLICIES)}, got {self.remat!r}")
    kernels = ("auto",) + segment_attention_lib.KERNELS
    _check(self.attention in kernels, "attention",
           f"must be one of {kernels}, got {self.attention!r}")
    _check(isinstance(self.scan_layers, bool), "scan_layers",
           f"must be True or False, got {self.scan_layers!r}")

  def kwargs(self, mesh: Mesh | None) -> dict:
    """`logprobs.token_logprobs_and_entropy`'s keywords; an attention kernel
    runs on each device's rows and heads under `mesh`."""
    if self.attention == "auto":
      raise ValueError("Scoring.attention='auto' is chosen for the learner's platform by "
                       "config_lib; set a kernel")
    return dict(chunk=self.logprob_chunk, attention_chunk=self.attention_chunk,
                remat=self.remat, attention=self.attention, scan_layers=self.scan_layers,
                mesh=mesh)


# The parts every update has; each loss's knobs are `knobs` (`loss_registry.KNOBS`).
PARTS = {"objective": Objective, "correction": mismatch_lib.Correction, "layout": StepLayout,
         "scoring": Scoring}


def _default_knobs() -> tuple:
  return tuple(cls() for cls in loss_registry.KNOBS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSettings:
  """The update's static settings: one of each part and every loss's knobs,
  and the checks that span them. `LossSettings.of(loss="vtrace", rho_bar=1.5)`
  builds them from their fields' names."""

  objective: Objective = Objective()
  correction: mismatch_lib.Correction = mismatch_lib.Correction()
  # One instance of each loss's knob class (`loss_registry.KNOBS`), in its order.
  knobs: tuple = dataclasses.field(default_factory=_default_knobs)
  layout: StepLayout = StepLayout()
  scoring: Scoring = Scoring()
  # Not configuration: the learner mesh, set by `update.make_update_fn`.
  mesh: Mesh | None = None

  @classmethod
  def of(cls, **fields) -> LossSettings:
    """Settings whose parts and knobs take `fields` by name (any field,
    derived ones included), the rest at their defaults.

    Raises:
      TypeError: for a name nothing has.
    """
    def build(part):
      own = {f.name for f in dataclasses.fields(part)}
      return part(**{k: v for k, v in fields.items() if k in own})
    known = {f.name for part in (*PARTS.values(), *loss_registry.KNOBS)
             for f in dataclasses.fields(part)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise TypeError(f"no loss setting named {unknown}")
    return cls(**{name: build(part) for name, part in PARTS.items()},
               knobs=tuple(build(k) for k in loss_registry.KNOBS))

  def knob(self, cls):
    """The instance of knob class `cls` (e.g. `objectives.vtrace.Vtrace`)."""
    for k in self.knobs:
      if type(k) is cls:
        return k
    raise KeyError(f"no knobs {cls.__name__} in these settings")

  @property
  def entry(self) -> loss_entry.LossEntry:
    """The registry entry of the objective's loss."""
    return loss_registry.LOSSES[self.objective.loss]

  def __post_init__(self):
    o, entry = self.objective, self.entry
    if [type(k) for k in self.knobs] != list(loss_registry.KNOBS):
      raise ValueError(f"knobs must be one instance of each of {loss_registry.KNOBS}, in order")
    if not entry.corrections and self.is_decoupled:
      raise ValueError(f"{o.loss} truncates its importance weights itself: it takes "
                       "neither a decoupled objective nor a mismatch correction (tis_cap, "
                       "seq_tis_cap, mismatch_mask), so it runs one optimizer step per batch")
    if o.critic and not entry.trains_critic:
      raise ValueError(f"a critic (model.value_head) is trained only by "
                       f"{sorted(n for n, e in loss_registry.LOSSES.items() if e.trains_critic)}"
                       f", not {o.loss!r}")
    if o.age_decay and not entry.age_decay:
      raise ValueError(f"{o.loss} has no clip range for an age-aware trust region to shrink")

  @property
  def optimizer_steps(self) -> int:
    return self.layout.optimizer_steps

  @property
  def is_decoupled(self) -> bool:
    return bool(self.objective.decoupled or self.correction.is_on or self.optimizer_steps > 1)

  @property
  def masks_minibatch_first(self) -> bool:
    """A loss whose mask is over the whole minibatch (M2PO's second moment):
    accumulating microbatches, a stop-gradient pass computes it first
    (`train_step`)."""
    return self.entry.minibatch_mask is not None and self.layout.num_microbatches > 1

  def minibatch_keep(self, log_ratio, loss_mask):
    """The loss's mask over a whole minibatch (`masks_minibatch_first`)."""
    entry = self.entry
    return entry.minibatch_mask(log_ratio, loss_mask, self.knob(entry.knobs))

  def loss_knobs(self, minibatch_keep=None) -> dict:
    """The keywords of the objective's loss function (None where off)."""
    entry = self.entry
    knobs = None if entry.knobs is None else self.knob(entry.knobs)
    correction = self.correction if self.correction.is_on else None
    return entry.kwargs(knobs, loss_entry.LossContext(
        correction=correction, age_decay=self.objective.age_decay,
        minibatch_keep=minibatch_keep))
