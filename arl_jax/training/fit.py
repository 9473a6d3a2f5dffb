"""Whether a run fits a kind of device, and the largest batch and context that would.

`--dry_run --dry_run_device=tpu-v5e` plans the config (`dry_run.plan`) for
chips of that kind's memory and answers three questions from the same plan
the run's `memory.jsonl` is checked against (`benchmarks/memory.py`):

- does it fit: the busiest device's planned bytes within `dry_run.USABLE`
  of the chip's memory;
- the largest `orchestrator.batch_size` that would, at the config's context;
- the largest `sampler.max_new_tokens` that would, at the config's batch.

Each is a search over the plan (the plan grows with both, so a doubling then
a bisection finds the edge), every candidate a valid config: batches in
multiples of the group size and of the learner's rows (`num_minibatches x
num_microbatches x fsdp`), completion budgets in whole tokens. The plan's
activations are its labelled rough estimate; the answers are as good as it
(`docs/scaling.md` states what was checked against runs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from arl_jax.config import run_spec
from arl_jax.training import dry_run

_GIB = 1024**3

# Memory per chip as the vendors state it (HBM for TPUs and GPUs), for
# `--dry_run_device`; `--dry_run_device_gib` takes any other size.
DEVICE_KINDS = {
    "tpu-v4": 32 * _GIB, "tpu-v5e": 16 * _GIB, "tpu-v5p": 95 * _GIB, "tpu-v6e": 32 * _GIB,
    "a100-40gb": 40 * _GIB, "a100-80gb": 80 * _GIB, "h100": 80 * _GIB, "h200": 141 * _GIB,
    "l4": 24 * _GIB,
}
# Where the searches stop: far beyond any batch or context a run would use.
MAX_BATCH = 1 << 20
MAX_NEW_TOKENS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fit:
  """The answers for one config on `num_devices` chips of `device_memory` bytes."""

  device_memory: int
  busiest: int  # planned bytes on the busiest device
  largest_batch: int | None  # None: not even the smallest batch fits
  largest_new_tokens: int | None

  @property
  def fits(self) -> bool:
    return self.busiest <= dry_run.USABLE * self.device_memory


def device_memory(kind: str) -> int:
  """Bytes of one chip of `kind` (a key of DEVICE_KINDS)."""
  if kind not in DEVICE_KINDS:
    raise run_spec.ConfigError(f"--dry_run_device={kind!r}: unknown device kind; known: "
                               f"{', '.join(sorted(DEVICE_KINDS))} (or --dry_run_device_gib=N)")
  return DEVICE_KINDS[kind]


def largest_multiple(fits: Callable[[int], bool], unit: int, limit: int) -> int | None:
  """The largest multiple of `unit` up to `limit` for which `fits` holds,
  `fits` being monotone (false from some point on); None if `unit` does not."""
  if unit > limit or not fits(unit):
    return None
  good, bad = 1, 2  # multiples of `unit`: one that fits, one that may not
  while bad * unit <= limit and fits(bad * unit):
    good, bad = bad, 2 * bad
  bad = min(bad, limit // unit + 1)
  while bad - good > 1:
    middle = (good + bad) // 2
    good, bad = (middle, bad) if fits(middle * unit) else (good, middle)
  return good * unit


def _planned(spec: run_spec.RunSpec, num_devices: int) -> int | None:
  """The busiest device's planned bytes; None when the spec is not a valid
  run (a candidate past what the config's other settings allow)."""
  try:
    return dry_run.plan(spec, num_devices).per_device_peak()
  except ValueError:  # (ConfigError too)
    return None


def with_batch(spec: run_spec.RunSpec, batch_size: int) -> run_spec.RunSpec:
  return dataclasses.replace(
      spec, orchestrator=dataclasses.replace(spec.orchestrator, batch_size=batch_size))


def with_new_tokens(spec: run_spec.RunSpec, max_new_tokens: int) -> run_spec.RunSpec:
  """`spec` with a completion budget of `max_new_tokens` (the model's context
  grown to hold it when it would not)."""
  longest = spec.engine.prompt_len + max_new_tokens
  models = {key: dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, longest))
            for key, cfg in (("model", spec.model), ("sampler_model", spec.sampler_model))}
  return dataclasses.replace(
      spec, engine=dataclasses.replace(spec.engine, max_new_tokens=max_new_tokens), **models)


def batch_unit(spec: run_spec.RunSpec, num_devices: int) -> int:
  """The step between valid batch sizes: whole groups that split into the
  learner's minibatches, microbatches and fsdp shards."""
  learner = dict(dry_run.plan(spec, num_devices).learner.mesh)
  layout = spec.loss.layout
  rows = layout.num_minibatches * layout.num_microbatches * learner.get("fsdp", 1)
  return math.lcm(spec.orchestrator.group_size, rows)


def fit(spec: run_spec.RunSpec, num_devices: int, memory: int) -> Fit:
  """Whether `spec` fits `num_devices` chips of `memory` bytes, and the
  largest batch and completion budget that would."""
  budget = dry_run.USABLE * memory

  def fits(candidate: run_spec.RunSpec) -> bool:
    planned = _planned(candidate, num_devices)
    return planned is not None and planned <= budget

  return Fit(
      device_memory=memory, busiest=dry_run.plan(spec, num_devices).per_device_peak(),
      largest_batch=largest_multiple(lambda b: fits(with_batch(spec, b)),
                                     batch_unit(spec, num_devices), MAX_BATCH),
      largest_new_tokens=largest_multiple(lambda n: fits(with_new_tokens(spec, n)), 1,
                                          MAX_NEW_TOKENS))


def format_fit(f: Fit, spec: run_spec.RunSpec) -> str:
  """The largest batch and budget, as the lines `--dry_run` prints under the
  plan (whose last line says whether the config as it is fits)."""
  if f.largest_batch is None:
    lines = ["no batch fits at this context: what does not grow with the batch (params, "
             "optimizer state, caches) is already too much"]
  else:
    lines = [f"largest batch that fits at this context: orchestrator.batch_size="
             f"{f.largest_batch} (now {spec.orchestrator.batch_size})"]
  if f.largest_new_tokens is None:
    lines.append("no completion budget fits at this batch")
  else:
    lines.append(f"largest completion budget that fits at this batch: sampler.max_new_tokens="
                 f"{f.largest_new_tokens} (now {spec.engine.max_new_tokens}; prompts of "
                 f"{spec.engine.prompt_len} tokens)")
  return "\n".join(lines)
