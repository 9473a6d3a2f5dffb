"""The `fleet` config section: where sampling runs, here or in sampler
processes that join over the network (`fleet.py`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetConfig:
  """The `fleet` section: where sampling runs (`distributed/fleet.py`).

  Attributes:
    remote: sample in sampler processes that join over the network instead of
      in the learner process (the learner's `mesh.sampler` devices then only
      stage each version in the samplers' layout, and each sampler process
      needs that many devices).
    host: interface the learner listens on (`0.0.0.0`: every interface, for
      samplers on other hosts; they are given this host's address).
    port: control port (0: any free port; the address is printed and written
      to `WORKDIR/fleet.json`).
    heartbeat_s: how often a sampler reports (stats; it is alive).
    timeout_s: a sampler silent this long is lost and its groups reassigned.
  """

  remote: bool = False
  host: str = "127.0.0.1"
  port: int = 0
  heartbeat_s: float = 0.5
  timeout_s: float = 20.0

  def __post_init__(self):
    if self.heartbeat_s <= 0:
      raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
    if self.timeout_s < 4 * self.heartbeat_s:
      raise ValueError(f"timeout_s={self.timeout_s} must be >= 4 x heartbeat_s="
                       f"{self.heartbeat_s}, or a busy sampler would be declared lost")
    if not 0 <= self.port < 65536:
      raise ValueError(f"port must be in [0, 65535], got {self.port}")
