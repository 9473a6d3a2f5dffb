"""Sampler settings a config leaves to `auto`, chosen from its shapes.

A user who raises `max_new_tokens` should not have to know which knobs make
long completions fast. `sampler.kv_cache="auto"` and `sampler.decode_burst=0`
(the built-in configs' defaults) are resolved here, once, from the slot
length, the model and the sampler's platform; the run's header prints what
was chosen and why (`RunSpec.choices`).

The rules follow `benchmarks/engine_defaults.py` (whole engine, 32 slots,
one CPU device, 2026-12-03; numbers in `benchmarks/README.md`):

- KV cache: the paged engine decoded 0.75x the dense one's tokens/s at 96
  columns a slot, 1.03x at 288 and 1.29x at 1,056 (3.2M model), and compiled
  2-4x the programs before its first token (37-61 vs 19: 26-72 s vs 10 s
  here). So paged from `PAGED_FROM_COLUMNS` columns a slot, where it wins
  steadily; dense below, where its longer start is not paid back. A pool
  sized by `kv_pages` or `kv_memory_fraction`, or a paged attention kernel,
  asks for paged whatever the length.
- Decode bursts pay when a decode step's device time is small against the
  host's round trip per call: 1.30x tokens/s with bursts of 4 for a tiny
  model (0.28 ms a step, ~0.16 ms of host time per call) and none for the
  3.2M model (5.6-8.6 ms a step). A step's time is estimated from its FLOPs
  (2 x parameters x slots) at the platform's rate; bursts of
  `BURST` when that is under `HOST_ROUND_TRIP_S`. On accelerators nearly every
  model decodes a step in well under a millisecond, so they burst.
"""

from __future__ import annotations

import dataclasses

PAGED_FROM_COLUMNS = 1024
BURST = 4
# A host round trip per device call (dispatch, reading `done`): ~0.16 ms
# measured on this CPU; more where a device sits behind PCIe or a TPU host.
HOST_ROUND_TRIP_S = 5e-4
# Matmul FLOP/s a decode step can expect (order of magnitude): this 2-core
# CPU's 2048^3 float32 matmul (docs/jax_notes.md: 90-200 GFLOP/s), and a
# conservative figure for any current GPU or TPU chip.
PLATFORM_FLOPS = {"cpu": 9e10, "gpu": 1e14, "tpu": 1e14}


@dataclasses.dataclass(frozen=True)
class Choice:
  """A resolved setting and, when it was `auto`, why (for the header)."""

  value: object
  reason: str = ""


def kv_cache(setting: str, *, length: int, kv_pages: int, kv_memory_fraction: float,
             paged_attention: str) -> Choice:
  """`setting` ("dense", "paged" or "auto") for slots of `length` columns."""
  if setting != "auto":
    return Choice(setting)
  if kv_pages or kv_memory_fraction or paged_attention != "xla":
    what = ("sampler.kv_pages" if kv_pages else "sampler.kv_memory_fraction"
            if kv_memory_fraction else f"sampler.paged_attention={paged_attention!r}")
    return Choice("paged", f"kv_cache=paged (auto: {what} sizes or reads a page pool)")
  if length >= PAGED_FROM_COLUMNS:
    return Choice("paged", f"kv_cache=paged (auto: {length} columns a slot >= "
                           f"{PAGED_FROM_COLUMNS})")
  return Choice("dense", f"kv_cache=dense (auto: {length} columns a slot < "
                         f"{PAGED_FROM_COLUMNS})")


def decode_burst(setting: int, *, num_params: int, num_slots: int,
                 platform: str | None) -> Choice:
  """`setting` (>= 1, or 0: auto) for a model of `num_params` decoding
  `num_slots` rows on `platform` ("cpu", "gpu", "tpu"; None: devices being
  planned, taken as an accelerator)."""
  if setting:
    return Choice(setting)
  flops = PLATFORM_FLOPS.get(platform or "tpu", PLATFORM_FLOPS["tpu"])
  step_s = 2.0 * num_params * num_slots / flops
  burst = BURST if step_s < HOST_ROUND_TRIP_S else 1
  comparison = "<" if burst > 1 else ">="
  return Choice(burst, f"decode_burst={burst} (auto: a {platform or 'planned'} decode step "
                       f"~{step_s * 1e3:.3g} ms {comparison} a host round trip "
                       f"{HOST_ROUND_TRIP_S * 1e3:g} ms)")


def resolve(cfg, *, num_params: int, platform: str | None):
  """`cfg` (an `EngineConfig`) with `kv_cache` and `decode_burst` chosen where
  they are auto, and the reasons of what was chosen (for the run's header)."""
  kv = kv_cache(cfg.kv_cache, length=cfg.prompt_len + cfg.max_new_tokens,
                kv_pages=cfg.kv_pages, kv_memory_fraction=cfg.kv_memory_fraction,
                paged_attention=cfg.paged_attention)
  burst = decode_burst(cfg.decode_burst, num_params=num_params, num_slots=cfg.num_slots,
                       platform=platform)
  resolved = dataclasses.replace(cfg, kv_cache=kv.value, decode_burst=burst.value)
  return resolved, tuple(c.reason for c in (kv, burst) if c.reason)


def with_new_tokens(cfg, max_new_tokens: int, *, kv_cache_setting: str):
  """`cfg` (a resolved `EngineConfig`) with a completion budget of
  `max_new_tokens`, its KV cache chosen again from `kv_cache_setting` (what
  the config wrote: "auto" picks paged from `PAGED_FROM_COLUMNS` columns, as
  a run of that budget would). Raises `SettingError` (a ValueError) when the
  budget does not fit the settings, e.g. a fixed page pool."""
  kv = kv_cache(kv_cache_setting, length=cfg.prompt_len + max_new_tokens,
                kv_pages=cfg.kv_pages, kv_memory_fraction=cfg.kv_memory_fraction,
                paged_attention=cfg.paged_attention)
  return dataclasses.replace(cfg, max_new_tokens=max_new_tokens, kv_cache=kv.value)
