"""The learner's state pytree and its creation in sharded form."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@flax.struct.dataclass
class TrainState:
  """Attributes:
    step: `[]` int32 number of updates applied = the policy version of `params`.
    params: decoder params (nnx.State) on the learner mesh.
    opt_state: optax state, laid out like the params it mirrors.
  """

  step: jax.Array
  params: object
  opt_state: optax.OptState


def create(params, optimizer: optax.GradientTransformation, mesh: Mesh):
  """Returns `(state, shardings)`; every leaf lives on `mesh`.

  The optimizer state is created by a jitted init whose outputs are laid out
  like the params they mirror (`optax.tree_map_params`), so each moment is
  born on its parameter's shards: left to XLA, moments (zeros, which depend
  on no input) came out on one device and were then replicated, N copies of
  each moment over an N-way fsdp mesh (the memory ledger showed it: 8x the
  params' bytes for Adam over 4 devices). Scalars (optax's `count`, `step`)
  are placed on the mesh explicitly: left to XLA they may land on one
  device, and a donated, jitted step then fails on the next call
  (docs/jax_notes.md).
  """
  replicated = NamedSharding(mesh, P())
  layout = optax.tree_map_params(optimizer, lambda _, sharding: sharding,
                                 jax.eval_shape(optimizer.init, params),
                                 jax.tree.map(lambda x: x.sharding, params),
                                 transform_non_params=lambda _: replicated)
  opt_state = jax.jit(optimizer.init, out_shardings=layout)(params)

  def on_mesh(x):
    sharding = x.sharding
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
      return x
    return jax.device_put(x, replicated)

  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=jax.tree.map(on_mesh, opt_state))
  state = state.replace(step=jax.device_put(state.step, replicated))
  return state, jax.tree.map(lambda x: x.sharding, state)
