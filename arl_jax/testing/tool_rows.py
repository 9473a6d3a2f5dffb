"""Checks of trained rows of the `tool_agent` task (byte tokenizer), shared by
the tests that train it in-process and through the gateway."""

from __future__ import annotations

import numpy as np


def check_batch(batch: dict, *, prompt_len: int, max_lag: int) -> tuple[int, list[int]]:
  """Asserts what every trained batch of the task holds: sampled tokens have
  versions no newer than the batch's, lag within the bound, observations are
  real tokens never trained on (version -1, log-prob 0), and each starts
  with "=" right after a "]" the policy sampled.

  Returns:
    `(rows holding an observation, version gaps)`: for each such row, how
    much newer the policy that sampled after the tool's answer was than every
    one before it (>= 1: the episode waited across a publish).
  """
  sampled = batch["loss_mask"] > 0
  versions = batch["token_versions"]
  assert np.all(versions[sampled] >= 0) and np.all(versions[sampled] <= batch["batch_version"])
  assert np.all(batch["lag"] <= max_lag)
  completion = batch["tokens"][:, prompt_len:]
  observation = batch["token_mask"][:, prompt_len:] & ~sampled[:, prompt_len:]
  assert np.all(versions[:, prompt_len:][observation] == -1)
  assert np.all(batch["behaviour_logprobs"][:, prompt_len:][observation] == 0)
  starts = observation & ~np.roll(observation, 1, axis=1)
  assert np.all(completion[starts] == ord("="))
  assert np.all(completion[np.roll(starts, -1, axis=1)] == ord("]"))
  gaps = []
  for row in np.flatnonzero(observation.any(axis=1)):
    first = prompt_len + int(np.argmax(observation[row]))
    before = versions[row, :first][sampled[row, :first]]
    after = versions[row, first:][sampled[row, first:]]
    if after.size:
      gaps.append(int(after.min() - before.max()))
  return int(observation.any(axis=1).sum()), gaps
