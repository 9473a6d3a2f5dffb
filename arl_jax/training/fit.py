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
from arl_jax.sampler import auto_settings
from arl_jax.training import dry_run

_MIB = 1024**2

# Memory per chip as the devices report it (nvidia-smi's MiB for GPUs; the
# HBM for TPUs), for `--dry_run_device`; `--dry_run_device_gib` takes any
# other size.
DEVICE_KINDS = {
    "tpu-v4": 32 * 1024 * _MIB, "tpu-v5e": 16 * 1024 * _MIB, "tpu-v5p": 95 * 1024 * _MIB,
    "tpu-v6e": 32 * 1024 * _MIB, "a100-40gb": 40960 * _MIB, "a100-80gb": 81920 * _MIB,
    "h100": 81559 * _MIB, "h200": 143771 * _MIB, "l4": 23034 * _MIB,
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
  if kind.lower() not in DEVICE_KINDS:
    raise run_spec.ConfigError(f"--dry_run_device={kind!r}: unknown device kind; known: "
                               f"{', '.join(sorted(DEVICE_KINDS))} (or --dry_run_device_gib=N)")
  return DEVICE_KINDS[kind.lower()]


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


def with_batch(spec: run_spec.RunSpec, batch_size: int) -> run_spec.RunSpec:
  """`spec` with `batch_size` rollouts an update (the rest as configured)."""
  return dataclasses.replace(
      spec, orchestrator=dataclasses.replace(spec.orchestrator, batch_size=batch_size))


def with_new_tokens(spec: run_spec.RunSpec, max_new_tokens: int) -> run_spec.RunSpec:
  """`spec` with a completion budget of `max_new_tokens`, as a config that
  asked for it would resolve: the model's context grown to hold it when it
  would not, the KV cache chosen again where the config left it to auto
  (paged from 1,024 columns). Raises ValueError where the settings cannot
  hold it (a fixed page pool smaller than one sequence)."""
  longest = spec.engine.prompt_len + max_new_tokens
  models = {key: dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, longest))
            for key, cfg in (("model", spec.model), ("sampler_model", spec.sampler_model))}
  engine = auto_settings.with_new_tokens(spec.engine, max_new_tokens,
                                         kv_cache_setting=spec.kv_cache_setting)
  return dataclasses.replace(spec, engine=engine, **models)


def batch_unit(spec: run_spec.RunSpec, num_devices: int) -> int:
  """The step between valid batch sizes: whole groups that split into the
  learner's minibatches, microbatches and fsdp shards."""
  learner = dict(dry_run.plan(spec, num_devices).learner.mesh)
  layout = spec.loss.layout
  rows = layout.num_minibatches * layout.num_microbatches * learner.get("fsdp", 1)
  return math.lcm(spec.orchestrator.group_size, rows)


def fit(spec: run_spec.RunSpec, num_devices: int, memory: int) -> Fit:
  """Whether `spec` fits `num_devices` chips of `memory` bytes, and the
  largest batch and completion budget that would.

  Each candidate is `spec` changed as a config asking for it would resolve
  (`with_batch`, `with_new_tokens`); one the settings reject (a ValueError:
  `run_spec.ConfigError`, `engine_config.SettingError`) does not fit.
  """
  budget = dry_run.USABLE * memory

  def fits(candidate: Callable[[], run_spec.RunSpec]) -> bool:
    try:
      return dry_run.plan(candidate(), num_devices).per_device_peak() <= budget
    except ValueError:
      return False

  return Fit(
      device_memory=memory, busiest=dry_run.plan(spec, num_devices).per_device_peak(),
      largest_batch=largest_multiple(lambda b: fits(lambda: with_batch(spec, b)),
                                     batch_unit(spec, num_devices), MAX_BATCH),
      largest_new_tokens=largest_multiple(lambda n: fits(lambda: with_new_tokens(spec, n)), 1,
                                          MAX_NEW_TOKENS))


def format_fit(f: Fit, spec: run_spec.RunSpec) -> str:
  """The largest batch and budget, as the lines `--dry_run` prints under the
  plan (whose last line says whether the config as it is fits): each as the
  keys to set, with the others the search changed with it."""
  if f.largest_batch is None:
    lines = ["no batch fits at this context: what does not grow with the batch (params, "
             "optimizer state, caches) is already too much"]
  else:
    lines = [f"largest batch that fits at this context: orchestrator.batch_size="
             f"{f.largest_batch} (now {spec.orchestrator.batch_size})"]
  if f.largest_new_tokens is None:
    lines.append("no completion budget fits at this batch")
    return "\n".join(lines)
  grown = with_new_tokens(spec, f.largest_new_tokens)
  also = []
  if grown.model.max_seq_len != spec.model.max_seq_len:
    also.append(f"model.max_seq_len={grown.model.max_seq_len}")
  if grown.engine.kv_cache != spec.engine.kv_cache:
    also.append(f"sampler.kv_cache={grown.engine.kv_cache} (as auto picks it)")
  lines.append(f"largest completion budget that fits at this batch: sampler.max_new_tokens="
               f"{f.largest_new_tokens} (now {spec.engine.max_new_tokens}; prompts of "
               f"{spec.engine.prompt_len} tokens)" + (f" with {', '.join(also)}" if also else ""))
  return "\n".join(lines)
