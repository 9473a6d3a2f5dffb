r"""Serves a model behind the OpenAI-compatible gateway (`arl_jax/gateway`).

  python -m arl_jax.serve --config=configs/smollm2.py:/tmp/smollm2 --port=8000
  python -m arl_jax.serve --config=configs/arith.py:tiny \
      --config.checkpoint.init_from=/tmp/run/checkpoints

The config says what to serve and how to sample, as for a run: the model
(`model.hf_path`, else `checkpoint.init_from`'s latest params, else a fresh
initialisation), the tokenizer and its chat template, and the `sampler`
section (slots, prompt length, completion budget, temperature, top-p). The
server binds localhost unless `--host` says otherwise; `--api_key` (or
`ARL_JAX_API_KEY`) makes every request carry it. Clients then use
`http://HOST:PORT/v1` (`/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/inference/v1/generate`; README "Serving"). `--top_logprobs`
(5) alternatives are recorded with each sampled token, for requests that ask.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=False)
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind (localhost by default).")
_PORT = flags.DEFINE_integer("port", 8000, "Port (0: any free one, printed).")
_API_KEY = flags.DEFINE_string("api_key", os.environ.get("ARL_JAX_API_KEY", ""),
                               "Bearer key every request must carry (default: "
                               "$ARL_JAX_API_KEY; empty: none).")
_MODEL_NAME = flags.DEFINE_string("model_name", "arl_jax", "The model id clients name.")
_MAX_N = flags.DEFINE_integer("max_n", 16, "The most choices a request may ask for.")
_TOP_LOGPROBS = flags.DEFINE_integer(
    "top_logprobs", 5, "Alternatives recorded per sampled token: the most a request's "
    "top_logprobs (chat) or logprobs (completions) may ask for; sets sampler.top_logprobs "
    "(0: none, which saves a top-k over the vocabulary each decode step).")


def _serve(config) -> None:
  from arl_jax.config import run_spec  # noqa: PLC0415 - after flags (JAX starts here)
  from arl_jax.gateway import gateway_config, server  # noqa: PLC0415
  from arl_jax.learner import publish as publish_lib  # noqa: PLC0415
  from arl_jax.models import init_lib  # noqa: PLC0415
  from arl_jax.sharding import mesh_lib  # noqa: PLC0415
  from arl_jax.sharding import rules as rules_lib  # noqa: PLC0415
  from arl_jax.training import start  # noqa: PLC0415

  serving = gateway_config.GatewayConfig(model_name=_MODEL_NAME.value, host=_HOST.value,
                                         port=_PORT.value, api_key=_API_KEY.value,
                                         max_n=_MAX_N.value)
  config.sampler.top_logprobs = _TOP_LOGPROBS.value
  resolved = run_spec.resolve(config)
  spec, tokenizer = resolved.spec, resolved.inputs.tokenizer
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  params = start.base_params(spec, meshes.learner, resuming=False, print_fn=print)
  graphdef, abstract = init_lib.abstract_model(spec.model.base)
  publisher = publish_lib.WeightPublisher(
      meshes.learner, rules_lib.state_shardings(abstract, meshes.sampler,
                                                rules_lib.SAMPLER_RULES),
      dtype=spec.sampler_model.param_dtype)
  publisher.publish(params, 0)
  del params
  served = server.GatewayServer(config=serving, engine_cfg=spec.engine, settings=spec.sampling,
                                graphdef=graphdef, model_cfg=spec.sampler_model,
                                mesh=meshes.sampler, publisher=publisher, tokenizer=tokenizer)
  url = served.start()
  print(f"serving {serving.model_name!r} at {url} (max_model_len "
        f"{served.gateway.max_model_len}, {spec.engine.num_slots} slots, temperature "
        f"{spec.sampling.temperature}); Ctrl-C stops", flush=True)
  try:
    served.wait()
  except KeyboardInterrupt:
    pass
  finally:
    served.stop()


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    print("error: --config is required", file=sys.stderr)
    sys.exit(2)
  from arl_jax.config import run_spec  # noqa: PLC0415

  try:
    _serve(_CONFIG.value)
  except (run_spec.ConfigError, ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
