"""Running code a model wrote: one `Sandbox` protocol (`api`), a local
backend that jails each program in a child process (`local`, `_jail`) and a
client of a SandboxFusion service (`remote`); `config` is the `env.sandbox`
section that picks one.

Layer 0: the standard library only (the jail runs without arl_jax).
"""

from arl_jax.sandbox.api import Execution, Limits, Sandbox, SandboxError

__all__ = ["Execution", "Limits", "Sandbox", "SandboxError"]
