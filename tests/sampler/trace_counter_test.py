"""Counting traces of jitted functions: the public compile count."""

import jax
import jax.numpy as jnp

from arl_jax.sampler import trace_counter


def test_a_jitted_function_is_counted_once_per_new_shape():
  counter = trace_counter.TraceCounter()
  double = jax.jit(counter.wrap(lambda x: 2 * x))
  assert counter.count == 0
  for _ in range(3):
    double(jnp.zeros((4,)))
  assert counter.count == 1
  double(jnp.ones((4,)))  # new values, same shape: no trace
  assert counter.count == 1
  double(jnp.zeros((5,)))
  double(jnp.zeros((4,), jnp.int32))
  assert counter.count == 3


def test_wrapping_keeps_the_signature_for_jit_arguments_by_name():
  counter = trace_counter.TraceCounter()

  def add(x, *, scale):
    return x * scale

  jitted = jax.jit(counter.wrap(add), static_argnames="scale")
  assert float(jitted(jnp.float32(2), scale=3)) == 6.0
  jitted(jnp.float32(4), scale=3)
  assert counter.count == 1
  jitted(jnp.float32(4), scale=5)  # a new static value is a new trace
  assert counter.count == 2
