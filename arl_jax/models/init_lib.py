"""Creates the decoder's parameters directly in their sharded layout.

Parameters are never materialised on one device: `jax.eval_shape` gives their
shapes and logical axes, the rule table gives a sharding per parameter, and a
jitted initialiser with those `out_shardings` creates each shard in place.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import lora as lora_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.sharding import rules as rules_lib


def abstract_model(cfg: model_config_lib.ModelConfig):
  """`(graphdef, abstract_state)` with ShapeDtypeStructs and logical-axis metadata."""
  return nnx.split(nnx.eval_shape(lambda: decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0))))


def init_params(cfg: model_config_lib.ModelConfig, mesh: Mesh, rules: rules_lib.Rules,
                seed: int):
  """Returns `(graphdef, params, shardings)`; params is an nnx.State laid out on `mesh`."""
  graphdef, abstract_state = abstract_model(cfg)
  shardings = rules_lib.state_shardings(abstract_state, mesh, rules)

  def init():
    return nnx.split(decoder_lib.Decoder(cfg, rngs=nnx.Rngs(seed)))[1]

  params = jax.jit(init, out_shardings=shardings)()
  return graphdef, params, shardings


def init_adapters(cfg: model_config_lib.ModelConfig, mesh: Mesh, rules: rules_lib.Rules,
                  seed: int):
  """`(graphdef, adapters)`: the LoRA adapters of a decoder of `cfg` (which
  has `cfg.lora` on), freshly initialised on `mesh` (with a critic's
  zero value head: `lora.split`'s trainable part), without its base (the
  base's initialisers are traced but not returned, so XLA drops them)."""
  graphdef, abstract_state = abstract_model(cfg)
  adapter_shardings, _ = lora_lib.split(rules_lib.state_shardings(abstract_state, mesh, rules))

  def init():
    return lora_lib.split(nnx.split(decoder_lib.Decoder(cfg, rngs=nnx.Rngs(seed)))[1])[0]

  return graphdef, jax.jit(init, out_shardings=adapter_shardings)()
