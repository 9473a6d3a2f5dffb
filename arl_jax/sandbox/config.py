"""Which sandbox an environment runs code in, and with what limits: the
`env.sandbox` section of an environment that runs code
(`--config.env.sandbox.wall_s=5`, `--config.env.sandbox.backend=sandbox_fusion`).

One sandbox is made per distinct setting in a process and shared by every
environment that asks for it (the training and evaluation copies of an
environment, a mixture's parts), so the local backend's isolation probe runs
once and `max_concurrent` bounds the whole process.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

from arl_jax.sandbox import api

BACKENDS = ("local", "sandbox_fusion")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
  """Attributes:
    backend: "local" (a jailed child process here: `sandbox/local.py`) or
      "sandbox_fusion" (a SandboxFusion service at `url`: `sandbox/remote.py`).
    url: the SandboxFusion service's base URL (`http://host:8080`).
    require_isolation: the local backend refuses to start where it cannot
      put programs in namespaces; False runs them with resource limits only.
    max_concurrent: programs running at once in this process (local), or
      requests in flight (remote).
    wall_s: seconds a program may run, whatever it does.
    cpu_s: CPU seconds of each of its processes.
    memory_mb: address space of each of its processes, MiB.
    file_mb: the largest file it may write, MiB.
    processes: processes and threads it may run at once.
    output_kb: stdout and stderr together, KiB.
  """

  backend: str = "local"
  url: str = ""
  require_isolation: bool = True
  max_concurrent: int = 8
  # (the limits' defaults are `api.Limits`'s)
  wall_s: float = api.Limits.wall_s
  cpu_s: int = api.Limits.cpu_s
  memory_mb: int = api.Limits.memory_mb
  file_mb: int = api.Limits.file_mb
  processes: int = api.Limits.processes
  output_kb: int = api.Limits.output_kb

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"env.sandbox.backend must be one of {BACKENDS}, got {self.backend!r}")
    if self.backend == "sandbox_fusion" and not self.url.startswith(("http://", "https://")):
      raise ValueError(f"env.sandbox.url must be the SandboxFusion service's http(s) URL "
                       f"when env.sandbox.backend='sandbox_fusion', got {self.url!r}")
    if not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
      raise ValueError(f"env.sandbox.max_concurrent must be an int >= 1, got "
                       f"{self.max_concurrent!r}")
    try:
      self.limits()
    except ValueError as e:
      raise ValueError(f"env.{str(e).replace('sandbox limit ', 'sandbox.')}") from e

  def limits(self) -> api.Limits:
    return api.Limits(wall_s=float(self.wall_s), cpu_s=int(self.cpu_s),
                      memory_mb=int(self.memory_mb), file_mb=int(self.file_mb),
                      processes=int(self.processes), output_kb=int(self.output_kb))


def default_fields() -> dict:
  """The section's keys at their defaults (an environment config's
  `sandbox` default, so each key is reachable from the command line)."""
  return {f.name: f.default for f in dataclasses.fields(SandboxConfig)}


def from_fields(fields: Mapping, where: str = "env.sandbox") -> SandboxConfig:
  """The config `fields` describe; ValueError naming an unknown key."""
  fields = dict(fields or {})
  known = default_fields()
  unknown = sorted(set(fields) - set(known))
  if unknown:
    raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
  return SandboxConfig(**fields)


_made: dict[tuple, api.Sandbox] = {}
_made_lock = threading.Lock()


def make_sandbox(cfg: SandboxConfig) -> api.Sandbox:
  """This process's sandbox for `cfg`'s backend settings (made on first use:
  the local backend probes its isolation then, and raises `SandboxError`
  naming `env.sandbox.require_isolation` where it has none)."""
  key = (cfg.backend, cfg.url, cfg.require_isolation, cfg.max_concurrent)
  with _made_lock:
    if key not in _made:
      if cfg.backend == "local":
        from arl_jax.sandbox import local  # noqa: PLC0415 - one backend's code

        _made[key] = local.LocalSandbox(require_isolation=cfg.require_isolation,
                                        max_concurrent=cfg.max_concurrent)
      else:
        from arl_jax.sandbox import remote  # noqa: PLC0415

        _made[key] = remote.SandboxFusion(cfg.url, max_concurrent=cfg.max_concurrent)
    return _made[key]
