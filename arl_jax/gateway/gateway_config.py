"""`GatewayConfig`: how the gateway serves (address, key, limits, sessions)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatewayConfig:
  """Attributes:
    model_name: the model id clients name (`/v1/models` lists it).
    host: the address to bind: localhost unless told otherwise (a served
      model runs code-like text from anyone who can reach it).
    port: the port (0: any free one).
    api_key: when set, every request must carry `Authorization: Bearer KEY`.
    max_request_bytes: the largest request body read.
    max_messages: the most messages a chat request holds.
    max_n: the most choices a request asks for (each takes a sampler slot).
    max_tokens: the most tokens a request may ask for (0: what the sampler's
      completion budget leaves).
    max_stops: the most stop strings a request names.
    max_sessions, max_branches, session_ttl_s: sessions kept (then the
      longest idle is forgotten), answers kept per session, and how long an
      idle one is.
    tool_parser: the tool-call format (`tool_calls.PARSERS`; `auto`: the
      chat template's).
    request_timeout_s: a request whose answer takes longer is cancelled (504).
  """

  model_name: str = "arl_jax"
  host: str = "127.0.0.1"
  port: int = 8000
  api_key: str = ""
  max_request_bytes: int = 4 << 20
  max_messages: int = 512
  max_n: int = 16
  max_tokens: int = 0
  max_stops: int = 8
  max_sessions: int = 4096
  max_branches: int = 64
  session_ttl_s: float = 3600.0
  tool_parser: str = "auto"
  request_timeout_s: float = 600.0

  def __post_init__(self):
    for name in ("max_request_bytes", "max_messages", "max_n", "max_stops", "max_sessions",
                 "max_branches"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"gateway.{name} must be an int >= 1, got {getattr(self, name)!r}")
    if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
      raise ValueError(f"gateway.max_tokens must be an int >= 0, got {self.max_tokens!r}")
    if not 0 <= self.port < 65536:
      raise ValueError(f"gateway.port must be in [0, 65535], got {self.port!r}")
    if self.session_ttl_s <= 0 or self.request_timeout_s <= 0:
      raise ValueError("gateway.session_ttl_s and gateway.request_timeout_s must be > 0")
