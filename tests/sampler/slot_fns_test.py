"""The slot functions' layout comes from the sharding rules, and their compiles are counted."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from arl_jax.sampler import engine_config, sampling, slot_fns, token_draw
from arl_jax.sharding import mesh_lib
from arl_jax.testing import tiny

SETTINGS = sampling.SamplingSettings(eos_id=258, pad_id=256, stop_ids=(10, 11))


def _mesh(shape):
  devices = np.array(jax.devices()[:int(np.prod([n for _, n in shape]))])
  return Mesh(devices.reshape([n for _, n in shape]), [name for name, _ in shape])


def _abstract_state(cfg, num_slots=4, length=12):
  return jax.eval_shape(lambda: sampling.init_slots(cfg, num_slots=num_slots, length=length,
                                                    pad_id=256, num_stop_ids=2))


def test_slots_go_over_data_and_kv_heads_over_tp():
  cfg = tiny.tiny_model_config()  # 2 KV heads
  shardings = slot_fns.state_shardings(_mesh((("data", 2), ("tp", 2))), _abstract_state(cfg))
  specs = jax.tree.map(lambda s: s.spec, shardings)
  assert specs.cache.keys == (P("data", "tp", None, None),) * cfg.num_layers
  assert specs.cache.values == (P("data", "tp", None, None),) * cfg.num_layers
  assert specs.cache.valid == P("data", None)
  assert specs.tokens == specs.logprobs == specs.stop_mask == specs.keys == P("data", None)
  assert specs.done == specs.index == P("data")


def test_axes_the_mesh_lacks_or_of_size_one_are_replicated():
  cfg = tiny.tiny_model_config()
  # The learner mesh (greedy evaluation runs there): no `data` axis.
  shardings = slot_fns.state_shardings(_mesh((("fsdp", 2), ("tp", 2))), _abstract_state(cfg))
  assert shardings.cache.keys[0].spec == P(None, "tp", None, None)
  assert shardings.tokens.spec == P(None, None)
  shardings = slot_fns.state_shardings(_mesh((("data", 4), ("tp", 1))), _abstract_state(cfg))
  assert shardings.cache.keys[0].spec == P("data", None, None, None)


def test_kv_heads_that_do_not_divide_by_tp_are_a_clear_error():
  cfg = tiny.tiny_model_config()  # 2 KV heads on 4-way tp
  with pytest.raises(ValueError, match=r"array .*cache.*keys.* dimension 2 does not divide by "
                                       r"mesh axis 'tp' of size 4"):
    slot_fns.state_shardings(_mesh((("data", 1), ("tp", 4))), _abstract_state(cfg))


def test_the_functions_keep_the_rules_layout_and_count_their_compiles():
  cfg = tiny.tiny_model_config(vocab_size=260)  # (divisible by tp = 2)
  mesh = _mesh((("data", 2), ("tp", 2)))
  graphdef, params, _ = tiny.learner_and_sampler_params(
      cfg, mesh_lib.RoleMeshes(learner=mesh, sampler=mesh))
  fns = slot_fns.make_sampler_fns(graphdef=graphdef, model_cfg=cfg, mesh=mesh,
                                  settings=SETTINGS, num_slots=4, length=12)
  assert fns.traces() == {"init": 0, "insert": 0, "fork": 0, "prefill": 0,
                          "decode": 0, "recompute": 0, "set_pages": 0, "take_rows": 0}
  state = fns.init()
  layout = lambda tree: jax.tree.map(lambda x: x.sharding.spec, tree)
  want = jax.tree.map(lambda s: s.spec, fns.state_shardings)
  assert layout(state) == want
  assert fns.row_sharding.spec == P("data")
  tokens = np.full((2, 4), 256, np.int32)
  tokens[:, 1:] = 7
  keys = token_draw.row_keys(0, [0, 1], [0, 0])
  for _ in range(2):
    state = fns.insert(params, np.int32(0), state, np.array([0, 1], np.int32), tokens,
                       tokens != 256, keys, np.array([6, 6], np.int32), np.ones((2, 2), bool))
    # Slot 2 starts from slot 0's prefill (a second sample of its prompt).
    state = fns.fork(state, jax.random.PRNGKey(0), np.array([0], np.int32),
                     np.array([2], np.int32), token_draw.key_ids([0], [1]),
                     np.array([6], np.int32), np.ones((1, 2), bool))
    for _ in range(3):
      state = fns.decode(params, np.int32(0), state, np.zeros(4, bool), np.ones(4, bool))
  assert layout(state) == want
  segments = slot_fns.read_segments(fns, state, [0, 1, 2, 3])
  # Insert + 3 decode steps; the fork samples from the first decode step on.
  for (tokens, logprobs, versions, stopped, _), n in zip(segments[:3], (4, 4, 3)):
    assert len(tokens) == n or (stopped and 0 < len(tokens) < n)
    assert len(logprobs) == len(tokens) and set(versions.tolist()) == {0}
  assert len(segments[3][0]) == 0  # slot 3 was never filled
  assert fns.traces() == {"init": 1, "insert": 1, "fork": 1, "prefill": 0,
                          "decode": 1, "recompute": 0, "set_pages": 0, "take_rows": 1}


def test_row_bucket_rounds_up_to_a_power_of_two_within_the_slots():
  assert [engine_config.row_bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
  assert engine_config.row_bucket(5, 6) == 6
  assert engine_config.row_buckets(8) == (1, 2, 4, 8)
  assert engine_config.row_buckets(32, multiple_of=4) == (4, 8, 16, 32)
  assert engine_config.row_buckets(6, multiple_of=4) == (4,)
