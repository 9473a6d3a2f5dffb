"""What the sampler engine takes work and weights from: its two input ports.

The engine depends on these protocols only, so one engine serves a run whose
requests come from this process's dispatcher (`Dispatcher`) or from a learner
process over the network (`sampler_worker.RemoteRequests`), and whose weights
come from a local `WeightPublisher` or a remote `WeightClient`. A third,
optional one (`ProgressSink`) watches segments while they are sampled.
"""

from __future__ import annotations

from typing import Protocol


class RequestSource(Protocol):
  """Where group requests come from (e.g. `dispatcher.Dispatcher`)."""

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    """Up to `max_groups` group requests (`group_request.GroupRequest`) started
    at `live_version`, waiting up to `timeout` seconds when none is ready."""

  def note_sampling(self, group_id: int, version: int) -> None:
    """The engine is about to sample tokens of `group_id` with params of
    `version` (the staleness of a group may count from its first token)."""


class ProgressSink(Protocol):
  """Who wants the tokens of some segments while they are sampled (a served
  request that streams: `gateway/engine_port.py`). Reading a slot's tokens
  costs a device-to-host copy, so only the groups named are read, after
  every engine iteration."""

  def streaming_groups(self) -> set:
    """The group ids whose segments are watched (empty: none, nothing is read)."""

  def segment_progress(self, group_id: int, tokens, logprobs, versions) -> None:
    """The segment of `group_id` so far (called on the engine thread)."""


class WeightSource(Protocol):
  """Where the params to sample with come from (e.g. `publish.WeightPublisher`)."""

  def latest(self) -> tuple:
    """`(version, params)` of the newest version, or `(None, None)` before the first."""
