"""A gateway serving a sampler engine: the engine built for served requests,
the app, and uvicorn in a background thread (so a run, a test or a
notebook keeps its own thread; `serve.py` blocks on it instead)."""

from __future__ import annotations

import dataclasses
import threading
import time

from arl_jax.gateway import app as app_lib
from arl_jax.gateway import engine_port, gateway_config
from arl_jax.gateway import gateway as gateway_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import engine_config


def served_engine_config(engine_cfg):
  """The engine's settings for served requests: every segment is a group of
  one handed over like a multi-turn episode (`engine_port.py`). Without
  `sampler.prompt_buckets` of its own, a served engine pads a new prompt to
  the next power of two from 32, not to `prompt_len`: served prompts vary
  in length and arrive a few at a time, and padding each admission to the
  widest bucket made prefill most of the work (`benchmarks/gateway.py
  --model=smollm2_body`: 128 clients 0.79x the in-process rate with every
  16-token prompt padded to 384 columns, 0.99x with buckets 16 and 64)."""
  return dataclasses.replace(engine_config.with_length_buckets(engine_cfg), group_size=1,
                            multi_turn=True)


class GatewayServer:
  """An engine, its gateway and the HTTP server, started and stopped together."""

  def __init__(self, *, config: gateway_config.GatewayConfig, engine_cfg, settings, graphdef,
               model_cfg, mesh, publisher, tokenizer, compile_progress_fn=None,
               note_sampling_fn=None):
    """Args:
      config: how to serve.
      engine_cfg: the sampler's `EngineConfig` (made multi-turn, groups of one).
      settings: its `SamplingSettings` (every stop token a request may name).
      graphdef, model_cfg, mesh: the decoder and where it runs.
      publisher: a `sources.WeightSource` of the params (a run's publisher,
        or `FixedWeights`).
      tokenizer: the model's tokenizer.
      compile_progress_fn: as `SamplerEngine`'s.
      note_sampling_fn: told the version of every token sampled for a
        training rollout's session (`EnginePort`); None: nobody.
    """
    self.config = config
    self.port = engine_port.EnginePort(version_fn=lambda: publisher.latest()[0] or 0,
                                       note_sampling_fn=note_sampling_fn)
    all_stops = (settings.eos_id, *settings.stop_ids)
    self.engine = engine_lib.SamplerEngine(
        cfg=served_engine_config(engine_cfg), settings=settings, graphdef=graphdef,
        model_cfg=model_cfg, mesh=mesh, publisher=publisher, dispatcher=self.port,
        on_segment_fn=self.port.segment_ended, progress_sink=self.port,
        stop_ids_fn=lambda prompt: all_stops if prompt.stop_ids is None else prompt.stop_ids,
        compile_progress_fn=compile_progress_fn)
    self.port.attach(self.engine)
    self.gateway = gateway_lib.Gateway(port=self.port, tokenizer=tokenizer,
                                       engine_cfg=self.engine.scheduler.cfg, settings=settings,
                                       config=config)
    app = app_lib.make_app(self.gateway, engine_failed=lambda: self.engine.failed)
    self.http = HttpServer(app, host=config.host, port=config.port)

  @property
  def base_url(self) -> str:
    return self.http.base_url

  @property
  def root_url(self) -> str:
    """`http://HOST:PORT` (a session's base URL is `ROOT/sessions/ID/v1`)."""
    return self.http.root_url

  def start(self) -> str:
    """Starts the engine (compiling first, with `precompile`) and the HTTP
    server; returns the base URL once it accepts connections."""
    self.engine.start()
    try:
      return self.http.start()
    except BaseException:
      self.engine.stop(raise_errors=False)
      raise

  def wait(self) -> None:
    """Blocks until the server stops (a signal, or `stop` from another thread)."""
    self.http.wait(check_fn=self.engine.raise_if_failed)

  def stop(self) -> None:
    """Cancels what is open, stops the HTTP server and the engine."""
    self.port.close()
    self.http.stop()
    self.engine.stop()


class HttpServer:
  """uvicorn serving an ASGI app in a background thread."""

  def __init__(self, app, *, host: str, port: int):
    self.app, self.host, self.port = app, host, port
    self._server = None
    self._thread: threading.Thread | None = None

  @property
  def base_url(self) -> str:
    """`http://HOST:PORT/v1`, what an OpenAI client takes."""
    return f"{self.root_url}/v1"

  @property
  def root_url(self) -> str:
    return f"http://{self.host}:{self.port}"

  def start(self, timeout_s: float = 60.0) -> str:
    """Serves; returns the base URL once it accepts connections (with port
    0, the port it got)."""
    import uvicorn  # noqa: PLC0415 - the [serve] extra

    self._server = uvicorn.Server(uvicorn.Config(
        self.app, host=self.host, port=self.port, log_level="warning", lifespan="off",
        timeout_graceful_shutdown=5))
    self._thread = threading.Thread(target=self._server.run, name="gateway-http", daemon=True)
    self._thread.start()
    deadline = time.monotonic() + timeout_s
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the gateway did not start on {self.host}:{self.port} (is the "
                           "port in use?)")
      time.sleep(0.02)
    self.port = self._server.servers[0].sockets[0].getsockname()[1]
    return self.base_url

  def wait(self, check_fn=lambda: None) -> None:
    """Blocks until the server stops, calling `check_fn` every half second."""
    while self._thread is not None and self._thread.is_alive():
      self._thread.join(0.5)
      check_fn()

  def stop(self) -> None:
    if self._server is not None:
      self._server.should_exit = True
    if self._thread is not None:
      self._thread.join(30)


class FixedWeights:
  """A `sources.WeightSource` of one version of params (a served checkpoint)."""

  def __init__(self, params, version: int = 0):
    self._latest = (version, params)

  def latest(self):
    return self._latest
