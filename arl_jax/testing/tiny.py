"""Tiny configs and fixtures shared by tests and quick benchmarks."""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from arl_jax.config import builtin
from arl_jax.learner import publish as publish_lib
from arl_jax.models import init_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib


def load_config(name: str = "arith", arg: str | None = "tiny") -> ml_collections.ConfigDict:
  """An unlocked copy of built-in config `configs/<name>.py`'s `get_config(arg)`."""
  return builtin.load(name, arg)


def tiny_model_config(**overrides) -> model_config_lib.ModelConfig:
  kwargs = dict(vocab_size=259, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, mlp_dim=64, max_seq_len=32)
  kwargs.update(overrides)
  return model_config_lib.ModelConfig(**kwargs)


def role_meshes(placement: str = "auto") -> mesh_lib.RoleMeshes:
  return mesh_lib.make_role_meshes(mesh_lib.MeshConfig(placement=placement))


def single_device_meshes() -> mesh_lib.RoleMeshes:
  """Both roles on the first device (any slot count fits)."""
  return mesh_lib.make_role_meshes(mesh_lib.MeshConfig(), devices=jax.devices()[:1])


def learner_and_sampler_params(cfg: model_config_lib.ModelConfig, meshes: mesh_lib.RoleMeshes,
                               seed: int = 0):
  """`(graphdef, learner_params, sampler_shardings)` for a model on `meshes`."""
  graphdef, params, _ = init_lib.init_params(cfg, meshes.learner, rules_lib.LEARNER_RULES, seed)
  _, abstract = init_lib.abstract_model(cfg)
  sampler_shardings = rules_lib.state_shardings(abstract, meshes.sampler, rules_lib.SAMPLER_RULES)
  return graphdef, params, sampler_shardings


def random_prompts(num: int, prompt_len: int, pad_id: int, seed: int = 0):
  """Left-padded random byte prompts `[num, prompt_len]` and their masks."""
  rng = np.random.default_rng(seed)
  tokens = np.full((num, prompt_len), pad_id, np.int32)
  mask = np.zeros((num, prompt_len), bool)
  for i in range(num):
    n = int(rng.integers(1, prompt_len + 1))
    tokens[i, prompt_len - n:] = rng.integers(0, 256, n)
    mask[i, prompt_len - n:] = True
  return tokens, mask


def perturb(params, scale: float, seed: int):
  """A different but compatible version of `params` (same shardings)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  new = [jax.device_put(n, x.sharding) for n, x in zip(new, leaves)]
  return jax.tree.unflatten(treedef, new)


def two_published_versions() -> dict:
  """A tiny model on the role meshes in two versions, as learner params and as
  the sampler receives them: keys `meshes, cfg, graphdef, params (v0, v1),
  sampler_params (v0, v1)`."""
  meshes = role_meshes()
  cfg = tiny_model_config()
  graphdef, params, sampler_shardings = learner_and_sampler_params(cfg, meshes)
  params_v1 = perturb(params, 0.05, seed=3)
  published = []
  for p in (params, params_v1):
    publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings)
    publisher.publish(p, 0)
    published.append(publisher.latest()[1])
  return dict(meshes=meshes, cfg=cfg, graphdef=graphdef, params=(params, params_v1),
              sampler_params=tuple(published))
