"""`AgentRollouts`: the rollout side of a run whose rollouts are OpenAI-client agents.

`agent.function` set (`gateway/agent_config.py`): the run serves its own
sampler engine through a gateway on 127.0.0.1 (with a fresh key when the
function takes `api_key`), and an `AgentRunner` calls the function for each
rollout the orchestrator's dispatcher admits. The engine reads weights from
the run's publisher as always (in-flight, pinned or drained updates), and
every sampled token's version also counts toward its group's staleness
(`EnginePort.note_sampling` -> `Dispatcher.note_sampling`), so the
staleness bound, cancellation and the buffer work as for an environment's
rollouts. The learner loop sees the same `Rollouts` interface.
"""

from __future__ import annotations

import contextlib
import secrets
import time

from arl_jax.gateway import agent_config, agent_runner, gateway_config, server
from arl_jax.metrics import progress as progress_lib
from arl_jax.orchestrator import open_work
from arl_jax.training import run_context


class AgentRollouts:
  """The run's gateway (engine, app, HTTP) and its agent runner (`rollouts.Rollouts`)."""

  def __init__(self, served: server.GatewayServer, runner: agent_runner.AgentRunner,
               take_fn):
    self._served, self._runner, self._take_fn = served, runner, take_fn

  @property
  def fleet(self):
    return None

  @property
  def gateway(self):
    return self._served.gateway

  def restore(self, groups: list[open_work.RestoredGroup]) -> None:
    self._runner.restore([r for g in groups for r in g.scored],
                         [e for g in groups for e in (*g.to_sample, *g.to_env)])

  def start(self) -> None:
    self._served.start()
    self._runner.start(self._take_fn)

  def cancel(self, group_ids) -> None:
    self._runner.cancel(group_ids)

  def paused(self) -> contextlib.AbstractContextManager:
    return self._served.engine.paused()

  def open_segments(self) -> dict:
    # Sessions restart on resume (an agent's state is its own Python), so
    # no open segment is saved.
    return {}

  def metrics(self) -> dict:
    gateway = self._served.gateway.metrics()
    return {**self._served.engine.metrics(), **self._runner.metrics(),
            "gateway_tool_calls": gateway.get("tool_calls", 0),
            "gateway_tool_call_parse_failures": gateway.get("tool_call_parse_failures", 0),
            "gateway_errors": sum(v for k, v in gateway.items() if k.startswith("errors_"))}

  def state_dict(self) -> dict:
    return {"sampler": self._served.engine.state_dict(), "env": self._runner.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    self._served.engine.load_state_dict(state["sampler"])
    self._runner.load_state_dict(state["env"])

  def raise_if_failed(self) -> None:
    self._served.engine.raise_if_failed()
    self._runner.raise_if_failed()

  @property
  def failed(self) -> bool:
    return self._served.engine.failed or self._runner.failed

  def stop(self) -> None:
    self._runner.close()
    self._served.port.close()
    self._served.http.stop()
    self._served.engine.stop(raise_errors=False)


def build(run: run_context.RunContext, *, orchestrator, publisher) -> AgentRollouts:
  """The gateway and agent runner `run.spec.agent` asks for (not started)."""
  spec, agent = run.spec, run.spec.agent
  fn = agent_config.load_function(agent.function)
  optional = agent_config.declared_args(fn)
  api_key = secrets.token_urlsafe(24) if "api_key" in optional else ""
  config = gateway_config.GatewayConfig(
      # (the agents' sessions are bound: never evicted, and not counted in
      # max_sessions, which bounds what any other local client may open)
      model_name=agent.model_name, host="127.0.0.1", port=agent.port, api_key=api_key,
      request_timeout_s=agent.timeout_s or 86_400.0)
  dispatcher = orchestrator.dispatcher
  served = server.GatewayServer(
      config=config, engine_cfg=spec.engine, settings=spec.sampling, graphdef=run.graphdef,
      model_cfg=spec.sampler_model, mesh=run.meshes.sampler, publisher=publisher,
      tokenizer=run.inputs.tokenizer, note_sampling_fn=dispatcher.note_sampling,
      compile_progress_fn=progress_lib.CompileProgress(
          print_fn=run.print_fn, bar=progress_lib.wants_bar(run.print_fn)))
  served.engine.declare_memory(run.memory.ledger)
  runner = agent_runner.AgentRunner(
      fn, gateway=served.gateway, root_url_fn=lambda: served.root_url,
      model=agent.model_name, api_key=api_key, env=run.inputs.env,
      on_group_fn=orchestrator.group_finished, on_scored_fn=orchestrator.rollout_scored,
      timeout_s=agent.timeout_s,
      max_concurrent=agent.max_concurrent, optional_args=optional, print_fn=run.print_fn)

  def take(timeout: float) -> list:
    # Groups are dispatched at the version the engine samples with (none
    # before its first weights arrive).
    version = served.engine.scheduler.version
    if version is None:
      time.sleep(timeout)
      return []
    return dispatcher.take(max_groups=64, live_version=version, timeout=timeout)

  return AgentRollouts(served, runner, take)
