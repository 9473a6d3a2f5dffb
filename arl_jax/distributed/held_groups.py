"""The finished groups a multi-controller process sampled, kept where they were made.

A follower's sampler sends process 0 only a finished group's metadata
(`wire.group_to_wire(..., held_by=...)`); the per-token arrays wait here
until a `ShardPlan` trains the group (its rollouts fill this process's rows,
or travel to the process whose rows hold them) or lets it go (`forget`:
swept as stale, arrived after its cancellation). A checkpoint that keeps a
held group in its open work collects the arrays to process 0 first
(`shard_batch.collect_held`).

Also here: a rollout's arrays as bytes (`to_bytes`, `from_bytes`), the form
in which they cross processes (prompt ids, completion ids, loss mask,
log-probs, versions; 4 bytes per prompt token, 16 per completion token).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from arl_jax.core import rollout as rollout_lib


class HeldGroups:
  """Thread-safe `group id -> Group` of this process's finished groups
  (env worker threads put, the learner thread takes). Each copy held gets a
  number (`hold`): a group generated again under the same id (its first copy
  was malformed, or its sampler lost) is a new copy, and forgetting an old
  copy (`forget`) leaves the new one alone."""

  def __init__(self):
    self._lock = threading.Lock()
    self._groups: dict[int, tuple[int, rollout_lib.Group]] = {}
    self._copies = 0

  def hold(self, group: rollout_lib.Group) -> int:
    """Keeps `group`; returns its copy number (sent with its metadata)."""
    with self._lock:
      self._copies += 1
      self._groups[group.group_id] = (self._copies, group)
      return self._copies

  def rollout(self, group_id: int, sample_index: int) -> rollout_lib.Rollout:
    """Raises KeyError naming the group when it is not (or no longer) held."""
    with self._lock:
      held = self._groups.get(int(group_id))
    if held is None:
      raise KeyError(f"group {group_id} is not held by this process (process 0's plan refers "
                     "to a group this process never finished, or already released)")
    return held[1].rollouts[int(sample_index)]

  def release(self, group_ids) -> None:
    """The groups were trained (whichever copy)."""
    with self._lock:
      for gid in group_ids:
        self._groups.pop(int(gid), None)

  def forget(self, pairs) -> None:
    """`(group id, copy)` pairs that will never train: drops those copies."""
    with self._lock:
      for gid, copy in pairs:
        held = self._groups.get(int(gid))
        if held is not None and held[0] == int(copy):
          del self._groups[int(gid)]


@dataclasses.dataclass(frozen=True)
class Arrays:
  """A rollout's per-token arrays and reward, as `train_batch.fill` reads
  them (a rollout that crossed processes: its other fields stayed behind)."""

  prompt_ids: np.ndarray
  completion_ids: np.ndarray
  loss_mask: np.ndarray
  behaviour_logprobs: np.ndarray
  token_versions: np.ndarray
  reward: float

  @property
  def prompt_length(self) -> int:
    return len(self.prompt_ids)

  @property
  def completion_length(self) -> int:
    return len(self.completion_ids)


# (field, dtype, per prompt token?) in byte order; every dtype 4 bytes.
_FIELDS = (("prompt_ids", "<i4", True), ("completion_ids", "<i4", False),
           ("loss_mask", "<f4", False), ("behaviour_logprobs", "<f4", False),
           ("token_versions", "<i4", False))


def num_bytes(prompt_length: int, completion_length: int, prompt: bool = True) -> int:
  """Bytes of a rollout's arrays (`to_bytes`); `prompt` False: without the prompt."""
  return 4 * prompt_length * prompt + 16 * completion_length


def to_bytes(rollout, prompt: bool = True) -> bytes:
  return b"".join(np.asarray(getattr(rollout, name), dtype).tobytes()
                  for name, dtype, of_prompt in _FIELDS if prompt or not of_prompt)


def from_bytes(buffer, offset: int, prompt_length: int, completion_length: int,
               reward: float, prompt: bool = True) -> Arrays:
  """The `Arrays` that `to_bytes` wrote at `offset` of `buffer` (views, no
  copy; `prompt` False: no prompt ids were written, they are empty)."""
  fields = {}
  for name, dtype, of_prompt in _FIELDS:
    if of_prompt and not prompt:
      fields[name] = np.zeros(0, dtype)
      continue
    count = prompt_length if of_prompt else completion_length
    fields[name] = np.frombuffer(buffer, dtype, count, offset)
    offset += 4 * count
  return Arrays(reward=reward, **fields)
