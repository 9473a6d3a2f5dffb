"""The learner update's settings, split by what they are: the objective, each
loss's own knobs, the optimizer-step layout and how the forward pass is
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
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import mismatch as mismatch_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import segment_attention as segment_attention_lib

_check = settings.check


def _non_negative(obj, *keys: str) -> None:
  for key in keys:
    value = getattr(obj, key)
    _check(isinstance(value, (int, float)) and value >= 0, key, f"must be >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
  """What the update optimises, whatever the loss.

  Attributes:
    loss: the policy loss, a key of `losses.LOSSES` (clipped_ratio, vtrace,
      m2po, cispo, gspo, gspo_token); its knobs are its own dataclass's
      (`ClippedRatio`, `Vtrace`, `M2po`, `Cispo`, `Gspo`).
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
    _check(self.loss in losses_lib.LOSSES, "loss",
           f"unknown loss {self.loss!r}; known: {sorted(losses_lib.LOSSES)}")
    _check(self.advantage in advantages_lib.ADVANTAGE_ESTIMATORS, "advantage",
           f"must be one of {advantages_lib.ADVANTAGE_ESTIMATORS}, got {self.advantage!r}")
    _non_negative(self, "age_decay", "kl_coef", "entropy_coef")
    _check(isinstance(self.decoupled, bool), "decoupled",
           f"must be True or False, got {self.decoupled!r}")
    _check(self.aggregation in losses_lib.AGGREGATIONS, "aggregation",
           f"must be one of {losses_lib.AGGREGATIONS}, got {self.aggregation!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClippedRatio:
  """The clipped ratio loss's knobs (`losses.clipped_ratio`).

  Attributes:
    eps_low: the ratio's lower clip, 1 - eps_low.
    eps_high: the ratio's upper clip, 1 + eps_high (> eps_low: clip-higher, DAPO).
    dual_clip: bound of negative-advantage terms, c > 1 (0: off).
  """

  eps_low: float = 0.2
  eps_high: float = 0.2
  dual_clip: float = 0.0

  def __post_init__(self):
    _check(0 <= self.eps_low < 1 and self.eps_high >= 0, "eps_low",
           "clip ranges must satisfy 0 <= eps_low < 1 and eps_high >= 0")
    _check(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip",
           f"must be 0 (off) or > 1, got {self.dual_clip}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Vtrace:
  """V-trace's knobs (`losses.vtrace`, `vtrace.py`).

  Attributes:
    rho_bar: truncation of the importance weights.
    c_bar: with a critic: truncation of the trace coefficients.
    lam: with a critic: the traces' lambda.
    vf_coef: with a critic: weight of the critic's loss.
  """

  rho_bar: float = 1.0
  c_bar: float = 1.0
  lam: float = 1.0
  vf_coef: float = 0.5

  def __post_init__(self):
    _check(self.rho_bar >= 1, "rho_bar", f"must be >= 1, got {self.rho_bar}")
    _check(0 < self.c_bar <= self.rho_bar, "c_bar",
           f"must be in (0, rho_bar={self.rho_bar}], got {self.c_bar}")
    _check(0 <= self.lam <= 1, "lam", f"must be in [0, 1], got {self.lam}")
    _non_negative(self, "vf_coef")


@dataclasses.dataclass(frozen=True, kw_only=True)
class M2po:
  """M2PO's knob (`losses.m2po`).

  Attributes:
    tau: the bound of the second moment of the log-ratio over kept tokens.
  """

  tau: float = 0.04

  def __post_init__(self):
    _check(self.tau > 0, "tau", f"must be > 0, got {self.tau}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cispo:
  """CISPO's knobs (`losses.cispo`): the bounds of its stop-gradient weight.

  Attributes:
    cispo_eps_low: the weight's floor is 1 - cispo_eps_low (1: no floor, as
      MiniMax-M1 ran it).
    cispo_eps_high: the weight's cap is 1 + cispo_eps_high (MiniMax-M1 tuned
      only this one).
  """

  cispo_eps_low: float = 1.0
  cispo_eps_high: float = 2.0

  def __post_init__(self):
    _check(0 <= self.cispo_eps_low <= 1 and self.cispo_eps_high > 0, "cispo_eps_low",
           f"the weight's bounds must satisfy 0 <= cispo_eps_low <= 1 and cispo_eps_high > 0, "
           f"got {self.cispo_eps_low}, {self.cispo_eps_high}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gspo:
  """GSPO's knobs (`losses.gspo`, `losses.gspo_token`): the clip range of a
  sequence's length-normalised ratio (the paper's 3e-4 and 4e-4: a sequence
  ratio is a geometric mean, far closer to 1 than a token's).

  Attributes:
    gspo_eps_low: the ratio's lower clip, 1 - gspo_eps_low.
    gspo_eps_high: the ratio's upper clip, 1 + gspo_eps_high.
  """

  gspo_eps_low: float = 3e-4
  gspo_eps_high: float = 4e-4

  def __post_init__(self):
    _check(0 <= self.gspo_eps_low < 1 and self.gspo_eps_high >= 0, "gspo_eps_low",
           "clip ranges must satisfy 0 <= gspo_eps_low < 1 and gspo_eps_high >= 0")


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


PARTS = {"objective": Objective, "correction": mismatch_lib.Correction,
         "clipped_ratio": ClippedRatio, "vtrace": Vtrace, "m2po": M2po, "cispo": Cispo,
         "gspo": Gspo, "layout": StepLayout, "scoring": Scoring}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSettings:
  """The update's static settings: one of each part, and the checks that
  span them. `LossSettings.of(loss="vtrace", rho_bar=1.5)` builds the parts
  from their fields' names."""

  objective: Objective = Objective()
  correction: mismatch_lib.Correction = mismatch_lib.Correction()
  clipped_ratio: ClippedRatio = ClippedRatio()
  vtrace: Vtrace = Vtrace()
  m2po: M2po = M2po()
  cispo: Cispo = Cispo()
  gspo: Gspo = Gspo()
  layout: StepLayout = StepLayout()
  scoring: Scoring = Scoring()
  # Not configuration: the learner mesh, set by `update.make_update_fn`.
  mesh: Mesh | None = None

  @classmethod
  def of(cls, **fields) -> LossSettings:
    """Settings whose parts take `fields` by name (any part's field, derived
    ones included), the rest at their defaults.

    Raises:
      TypeError: for a name no part has.
    """
    parts = {}
    for name, part in PARTS.items():
      own = {f.name for f in dataclasses.fields(part)}
      parts[name] = part(**{k: v for k, v in fields.items() if k in own})
    known = {f.name for part in PARTS.values() for f in dataclasses.fields(part)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise TypeError(f"no loss setting named {unknown}")
    return cls(**parts)

  def __post_init__(self):
    o = self.objective
    if o.loss == "vtrace" and self.is_decoupled:
      raise ValueError("vtrace truncates its importance weights itself (rho_bar): it takes "
                       "neither a decoupled objective nor a mismatch correction (tis_cap, "
                       "seq_tis_cap, mismatch_mask), so it runs one optimizer step per batch")
    if o.critic and o.loss != "vtrace":
      raise ValueError(f"a critic (model.value_head) is trained only by the vtrace loss, not "
                       f"{o.loss!r}")
    if o.loss == "m2po" and o.age_decay:
      raise ValueError("m2po has no clip range for an age-aware trust region to shrink")

  @property
  def optimizer_steps(self) -> int:
    return self.layout.optimizer_steps

  @property
  def is_decoupled(self) -> bool:
    return bool(self.objective.decoupled or self.correction.is_on or self.optimizer_steps > 1)

  @property
  def masks_minibatch_first(self) -> bool:
    """M2PO's second-moment mask is over the whole minibatch: accumulating
    microbatches, a stop-gradient pass computes it first (`train_step`)."""
    return self.objective.loss == "m2po" and self.layout.num_microbatches > 1

  def loss_knobs(self, m2po_keep=None) -> dict:
    """The keywords of `losses.LOSSES[objective.loss]` (None where off)."""
    o = self.objective
    correction = self.correction if self.correction.is_on else None
    if o.loss == "clipped_ratio":
      c = self.clipped_ratio
      return dict(eps_low=c.eps_low, eps_high=c.eps_high, dual_clip=c.dual_clip or None,
                  correction=correction, age_decay=o.age_decay)
    if o.loss == "vtrace":
      return dict(rho_bar=self.vtrace.rho_bar, age_decay=o.age_decay)
    if o.loss == "cispo":
      return dict(eps_low=self.cispo.cispo_eps_low, eps_high=self.cispo.cispo_eps_high,
                  correction=correction, age_decay=o.age_decay)
    if o.loss in ("gspo", "gspo_token"):
      return dict(eps_low=self.gspo.gspo_eps_low, eps_high=self.gspo.gspo_eps_high,
                  correction=correction, age_decay=o.age_decay)
    return dict(tau=self.m2po.tau, correction=correction, keep=m2po_keep)
