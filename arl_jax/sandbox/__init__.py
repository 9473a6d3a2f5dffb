"""Running code a model wrote: one `Sandbox` protocol, a local and a remote backend."""

from arl_jax.sandbox.api import Execution, Limits, Sandbox, SandboxError

__all__ = ["Execution", "Limits", "Sandbox", "SandboxError"]
