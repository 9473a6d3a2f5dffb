"""A content fingerprint of a params State that does not depend on its layout.

A LoRA checkpoint holds the adapters, not the base they were trained on
(`models/lora.py`); it records the base's fingerprint so that a resume onto
another base is refused. The fingerprint must not change when the same
params are laid out on another mesh (a resume may change the mesh), so it is
built from integer sums, which are exact in any reduction order: each
parameter's bits, mixed with their flat index, summed twice with wrap-around
on its devices; the host hashes the per-parameter sums with their names.
Not a cryptographic hash: it tells bases apart, it does not guard against
forgery.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN, _MIX_A, _MIX_B = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D


def _leaf_sums(x: jax.Array) -> jax.Array:
  """Two wrap-around uint32 sums of `x`'s bits, mixed with their positions."""
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()
  index = jnp.arange(bits.size, dtype=jnp.uint32)
  a = jnp.sum((bits ^ (index * jnp.uint32(_GOLDEN))) * jnp.uint32(_MIX_A), dtype=jnp.uint32)
  b = jnp.sum(((bits + index) * jnp.uint32(_MIX_B)) ^ (bits >> 13), dtype=jnp.uint32)
  return jnp.stack([a, b])


def sums_of(params):
  """The per-parameter sums `fingerprint` hashes (traceable: an update
  program that returns them with its params gives a recording run its
  fingerprint without a program or a wait of its own; `learner/update.py`)."""
  return jax.tree.map(_leaf_sums, params)


# One jitted function (a fresh lambda would trace again at every call).
_sums = jax.jit(sums_of)


def fingerprint(params) -> str:
  """16 hex digits that differ, but for a ~2^-64 chance, between params that
  differ in any bit, name, shape or dtype; equal for equal params on any mesh."""
  return from_sums(params, jax.device_get(_sums(params)))


def from_sums(params, sums) -> str:
  """`fingerprint(params)` from `sums_of(params)`, fetched to the host."""
  digest = hashlib.sha256()
  shapes = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
    leaf = shapes[path]
    digest.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape}".encode())
    digest.update(np.asarray(value, np.uint32).tobytes())
  return digest.hexdigest()[:16]
