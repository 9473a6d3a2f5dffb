"""`AgentConfig`: the `agent` config section, rollouts written as OpenAI-client agents.

With `agent.function` set, a run's rollouts come from the user's function
instead of its environment's `step`/`score`: for every rollout the run opens
a gateway session over its own sampler engine and calls

    function(base_url=..., model=..., prompt=...)          # sync or async

with the session's base URL (`http://127.0.0.1:PORT/sessions/ID/v1`), the
served model's name and the prompt record the dispatcher drew; the function
talks to the model only through an OpenAI client (any number of turns and
tool calls) and returns the reward. It may also declare `api_key` (the
run's key for its gateway, which then wants one), `env` (the run's
environment: its tools, its scorer) and `http_client` (one pooled `httpx`
client that every agent shares, for `openai.AsyncOpenAI(http_client=...)`:
a new OpenAI client makes its own, at ~20 ms of CPU each, more than a tiny
model's whole turn). `agent_runner.py` runs them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os

# Keywords a function may declare besides the three it must take.
OPTIONAL_ARGS = ("api_key", "env", "http_client")
REQUIRED_ARGS = ("base_url", "model", "prompt")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
  """Attributes:
    function: the agent, as `package.module:name` or `path/to/file.py:name`
      ("": none; the environment produces the rollouts).
    timeout_s: the longest one rollout's agent call may take (0: no limit);
      a call past it is cancelled and counted as an environment timeout.
    max_concurrent: agent calls running at once (0: every rollout the
      dispatcher admits).
    model_name: the model id the agent's client names.
    port: the run's gateway port on 127.0.0.1 (0: any free one).
  """

  function: str = ""
  timeout_s: float = 300.0
  max_concurrent: int = 0
  model_name: str = "arl_jax"
  port: int = 0

  def __post_init__(self):
    if self.function and ":" not in self.function:
      raise ValueError(f"agent.function={self.function!r}: expected 'package.module:name' or "
                       "'path/to/file.py:name'")
    if self.timeout_s < 0:
      raise ValueError(f"agent.timeout_s must be >= 0 (0: no limit), got {self.timeout_s}")
    if not isinstance(self.max_concurrent, int) or self.max_concurrent < 0:
      raise ValueError(f"agent.max_concurrent must be an int >= 0, got {self.max_concurrent!r}")
    if not 0 <= self.port < 65536:
      raise ValueError(f"agent.port must be in [0, 65535], got {self.port!r}")

  @property
  def enabled(self) -> bool:
    return bool(self.function)

  def check_runnable(self, *, remote_sampler: bool) -> None:
    """Raises ValueError (naming the key) unless the function loads and
    takes the agent's keywords and the run's gateway can serve it here."""
    if not self.enabled:
      return
    if remote_sampler:
      raise ValueError("agent.function: agents talk to this process's gateway, so the sampler "
                       "must run here (fleet.remote=False)")
    load_function(self.function)
    for package in ("fastapi", "uvicorn"):
      if importlib.util.find_spec(package) is None:
        raise ValueError(f"agent.function: agents talk to the run's gateway, which needs "
                         f"{package}: pip install -e '.[serve]'")


def load_function(name: str):
  """The callable `agent.function` names, checked to take the agent's
  keywords (raises ValueError naming the key and what is wrong)."""
  where, _, attr = name.rpartition(":")
  try:
    if where.endswith(".py"):
      if not os.path.isfile(where):
        raise ValueError(f"agent.function={name!r}: no file {where!r}")
      module_name = "arl_jax_agent_" + os.path.splitext(os.path.basename(where))[0]
      spec = importlib.util.spec_from_file_location(module_name, where)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
    else:
      module = importlib.import_module(where)
  except ImportError as e:
    raise ValueError(f"agent.function={name!r}: cannot import {where!r}: {e}") from e
  fn = getattr(module, attr, None)
  if not callable(fn):
    raise ValueError(f"agent.function={name!r}: {where!r} has no callable {attr!r}")
  params = inspect.signature(fn).parameters
  takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
  missing = [a for a in REQUIRED_ARGS if a not in params and not takes_any]
  if missing:
    raise ValueError(f"agent.function={name!r} must take the keyword arguments "
                     f"{REQUIRED_ARGS} (and may take {OPTIONAL_ARGS}); it lacks {missing}")
  return fn


def declared_args(fn) -> tuple[str, ...]:
  """The optional keywords `fn` takes (`OPTIONAL_ARGS`)."""
  params = inspect.signature(fn).parameters
  takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
  return tuple(a for a in OPTIONAL_ARGS if a in params or takes_any)
