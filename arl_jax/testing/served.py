"""A tiny model served by the gateway, for tests and quick benchmarks."""

from __future__ import annotations

import dataclasses

from arl_jax.envs import hf_tokenizer
from arl_jax.gateway import gateway_config, server
from arl_jax.learner import publish as publish_lib
from arl_jax.sampler import engine_config, sampling
from arl_jax.testing import chat_folder, tiny


@dataclasses.dataclass
class Served:
  """Attributes:
    server: the started `GatewayServer`.
    tokenizer: the chat tokenizer (`chat_folder`'s).
    graphdef, params, model_cfg: the model, its params on the learner mesh.
    folder: the tokenizer folder.
  """

  server: server.GatewayServer
  tokenizer: object
  graphdef: object
  params: object
  model_cfg: object
  folder: str

  @property
  def base_url(self) -> str:
    return self.server.base_url


def chat_tokenizer(folder: str) -> hf_tokenizer.HfTokenizer:
  chat_folder.write_chat_folder(folder)
  return hf_tokenizer.HfTokenizer(folder, eos_token="auto", bos_token="auto", pad_token="auto",
                                  chat_template="auto")


def start_tiny(folder: str, *, config: gateway_config.GatewayConfig | None = None,
               temperature: float = 1.0, top_logprobs: int = 0,
               model_shape: dict | None = None, **engine_options) -> Served:
  """Serves a random tiny decoder (2 layers, d_model 32; `model_shape`:
  other `ModelConfig` fields, e.g. a real model's) with a chat tokenizer
  written to `folder`, on one device, on a free localhost port, recording
  `top_logprobs` alternatives per token."""
  tokenizer = chat_tokenizer(folder)
  meshes = tiny.single_device_meshes()
  model_cfg = tiny.tiny_model_config(vocab_size=tokenizer.vocab_size, max_seq_len=1024,
                                     **(model_shape or {}))
  graphdef, params, shardings = tiny.learner_and_sampler_params(model_cfg, meshes)
  publisher = publish_lib.WeightPublisher(meshes.learner, shardings)
  publisher.publish(params, 0)
  options = dict(num_slots=8, prompt_len=384, max_new_tokens=256, kv_cache="dense",
                 decode_burst=1, precompile=False)
  options.update(engine_options)
  settings = sampling.SamplingSettings(
      temperature=temperature, top_logprobs=top_logprobs, eos_id=tokenizer.eos_id,
      pad_id=tokenizer.pad_id,
      stop_ids=tuple(i for i in tokenizer.stop_ids if i != tokenizer.eos_id))
  served = server.GatewayServer(
      config=config or gateway_config.GatewayConfig(port=0), settings=settings,
      engine_cfg=engine_config.EngineConfig(**options), graphdef=graphdef, model_cfg=model_cfg,
      mesh=meshes.sampler, publisher=publisher, tokenizer=tokenizer)
  served.start()
  return Served(server=served, tokenizer=tokenizer, graphdef=graphdef, params=params,
                model_cfg=model_cfg, folder=folder)
