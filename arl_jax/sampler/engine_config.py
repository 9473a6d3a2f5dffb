"""`EngineConfig`: the sampler engine's static settings and the slot geometry
they imply (prompt buckets, continuation buckets, slot length)."""

from __future__ import annotations

import dataclasses

from arl_jax.sampler import weight_updates


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Attributes:
    num_slots: rows decoded together (>= the group size, a multiple of the
      sampler mesh's data axis).
    group_size: G, rollouts per group.
    prompt_buckets: ascending prompt lengths prompts are padded to; the
      largest is the longest prompt accepted.
    max_new_tokens: N, completion budget.
    weight_update: one of `weight_updates.WEIGHT_UPDATE_MODES`.
    kv_policy: one of `weight_updates.KV_POLICIES` (used by `in_flight`).
    seed: base of the per-rollout PRNG keys.
    multi_turn: episodes may be resumed after an environment turn.
    context_bucket: granularity of re-admitted context lengths (contexts
      longer than the longest prompt: multi-turn episodes, and segments a
      checkpoint left open; capped at `max_new_tokens`, see `context_step`).
    precompile: compile every program shape the engine can use
      (`precompile.engine_shapes`) when the first published version is taken
      up (in `SamplerEngine.start` if it was published before), instead of
      when a batch first needs one (which can be hundreds of updates into a
      run). Off here, for engines built by hand that run a few batches; a
      run's engine takes `sampler.precompile` (on by default).
  """

  num_slots: int
  group_size: int
  prompt_buckets: tuple[int, ...]
  max_new_tokens: int
  weight_update: str = "in_flight"
  kv_policy: str = "keep"
  seed: int = 0
  multi_turn: bool = False
  context_bucket: int = 16
  precompile: bool = False

  def __post_init__(self):
    weight_updates.check_names(self.weight_update, self.kv_policy)
    if not self.prompt_buckets or list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
      raise ValueError(f"prompt_buckets must be ascending and distinct, got {self.prompt_buckets}")
    if self.context_bucket < 1:
      raise ValueError(f"context_bucket must be >= 1, got {self.context_bucket}")

  @property
  def prompt_len(self) -> int:
    """The longest prompt accepted (the largest bucket)."""
    return self.prompt_buckets[-1]

  @property
  def context_step(self) -> int:
    """Granularity of continuation buckets: `context_bucket`, but no more than
    the budget (a short single-turn budget should not pay for 16 spare columns)."""
    return min(self.context_bucket, self.max_new_tokens)

  @property
  def length(self) -> int:
    """L: columns of a slot (longest prompt bucket + max new tokens, plus the
    spare columns that continuation buckets may round into)."""
    return self.prompt_buckets[-1] + self.max_new_tokens + self.context_step

  @property
  def continuation_buckets(self) -> tuple[int, ...]:
    """Lengths a re-admitted context is padded to: the prompt buckets, then
    multiples of `context_step` up to the longest context that can still
    sample a token (prompt_len + max_new_tokens - 1). A context padded to its
    bucket leaves room for the rest of its budget: the bucket exceeds the
    context by less than `context_step`, the spare columns of `length`."""
    longest = self.prompt_len + self.max_new_tokens - 1
    g = self.context_step
    more = range((self.prompt_len // g + 1) * g, longest + g, g)
    return self.prompt_buckets + tuple(more)

  def bucket_for(self, n: int) -> int:
    """The continuation bucket a context of `n` tokens is padded to."""
    return next(b for b in self.continuation_buckets if b >= n)
