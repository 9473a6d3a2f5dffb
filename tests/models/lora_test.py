"""LoRA adapters: step 0 is the base, only adapters train, a publish moves only
them, and the sampler's log-probs equal the learner's with adapters on."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax.core import settings
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.learner import loss_settings
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import publish as publish_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.models import decoder, fingerprint, init_lib, lora
from arl_jax.sampler import sampling
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny

RANK = 4


def _lora_cfg(**lora_kwargs):
  return tiny.tiny_model_config(lora=lora.LoraConfig(rank=RANK, **lora_kwargs))


def _logits(graphdef, params, tokens):
  mask = jnp.ones(tokens.shape, bool)
  model = nnx.merge(graphdef, params)
  return model(tokens, decoder.positions_from_mask(mask), decoder.causal_mask(mask))[0]


def _with_trained_adapters(params, seed=1, scale=0.2):
  """`params` with every adapter (B included) moved off its start."""
  adapters, base = lora.split(params)
  return lora.merge(tiny.perturb(adapters, scale, seed), base)


def test_config_checks_name_the_key():
  assert lora.LoraConfig(rank=8, targets="all").targets == tuple(lora.TARGETS)
  assert lora.LoraConfig(rank=8, targets="q_proj").targets == ("q_proj",)
  assert lora.LoraConfig(rank=16, alpha=32).scale == 2.0
  assert not lora.LoraConfig().enabled
  for kwargs, match in [({"rank": -1}, "rank: must be an int >= 0"),
                        ({"rank": 2.5}, "rank: must be an int"),
                        ({"alpha": 0}, "alpha: must be > 0"),
                        ({"targets": ("q_proj", "qkv")}, r"targets: unknown module\(s\) \['qkv'\]"),
                        ({"targets": ()}, "targets: names no module"),
                        ({"base_dtype": "fp8"}, "base_dtype: must be one of")]:
    with pytest.raises(settings.SettingError, match=match):
      lora.LoraConfig(**kwargs)


def test_adapters_count_and_shapes_and_step_zero_is_the_base():
  cfg = _lora_cfg()
  meshes = tiny.role_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  adapters, base = lora.split(params)
  assert sum(x.size for x in jax.tree.leaves(adapters)) == cfg.adapter_params > 0
  assert sum(x.size for x in jax.tree.leaves(base)) == cfg.num_params
  block = adapters["blocks"][0]
  assert block["attn"]["q_lora"]["a"].shape == (32, RANK)
  assert block["attn"]["q_lora"]["b"].shape == (RANK, 4, 8)
  assert block["attn"]["o_lora"]["a"].shape == (4, 8, RANK)
  assert block["mlp"]["down_lora"]["b"].shape == (RANK, 32)
  bs = [x for path, x in jax.tree_util.tree_flatten_with_path(adapters)[0]
        if "'b'" in jax.tree_util.keystr(path)]
  assert len(bs) == 2 * 7 and not any(np.any(np.asarray(b)) for b in bs)  # B starts at 0
  # The base alone, through the decoder without adapters: the same logits.
  base_graphdef, _ = init_lib.abstract_model(cfg.base)
  tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
  np.testing.assert_array_equal(_logits(graphdef, params, tokens),
                                _logits(base_graphdef, base, tokens))
  # Trained adapters change them; a split and a merge give the model back.
  trained = _with_trained_adapters(params)
  assert jax.tree.structure(lora.merge(*lora.split(trained))) == jax.tree.structure(params)
  assert not np.allclose(_logits(graphdef, trained, tokens), _logits(graphdef, params, tokens))


def test_targets_choose_the_projections_and_a_model_without_adapters_trains_whole():
  cfg = _lora_cfg(targets=("q_proj", "v_proj"))
  _, abstract = init_lib.abstract_model(cfg)
  adapters, _ = lora.split(abstract)
  assert sorted(adapters["blocks"][0]["attn"]) == ["q_lora", "v_lora"]
  assert "mlp" not in adapters["blocks"][0]
  assert cfg.adapter_params == 2 * RANK * ((32 + 32) + (32 + 16))
  _, full = init_lib.abstract_model(tiny.tiny_model_config())
  trainable, frozen = lora.split(full)
  assert jax.tree.structure(trainable) == jax.tree.structure(full)
  assert not jax.tree.leaves(frozen)


@pytest.mark.parametrize("critic", [False, True])
def test_an_update_trains_the_adapters_only_and_the_optimizer_holds_their_state(critic):
  """With a critic (vtrace), its new value head trains whole beside the
  adapters (PEFT's modules_to_save); the base stays frozen either way."""
  cfg = tiny.tiny_model_config(lora=lora.LoraConfig(rank=RANK), value_head=critic)
  meshes = tiny.role_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  adapters, base = lora.split(params)
  assert ("value_head" in adapters, "value_head" in base) == (critic, False)
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-2))
  state, shardings = train_state_lib.create(adapters, optimizer, meshes.learner)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert cfg.trainable_params == cfg.adapter_params + critic * cfg.d_model
  assert sum(x.size for x in moments) == 2 * cfg.trainable_params  # Adam's mu and nu
  settings_ = (loss_settings.LossSettings.of(loss="vtrace", critic=True) if critic else
               loss_settings.LossSettings.of())
  update = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer, settings=settings_,
                                     state_shardings=shardings, mesh=meshes.learner,
                                     frozen=base)
  base_before = jax.tree.map(np.asarray, base)
  a_before = jax.tree.map(np.asarray, adapters)
  batch = _batch()
  if critic:  # (rewards the zero-initialised critic must learn)
    batch = batch.replace(rewards=np.where(np.asarray(batch.loss_mask) > 0, 1.0, 0.0).astype(np.float32))
  for _ in range(2):
    state, metrics = update(state, batch)
  assert float(metrics["skipped_steps"]) == 0 and float(metrics["grad_norm"]) > 0
  changed = jax.tree.map(lambda new, old: bool(np.any(np.asarray(new) != old)), state.params,
                         a_before)
  assert all(jax.tree.leaves(changed))  # A and B both move (B first, then A through B)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), base_before)


def _lora_update(num_layers, **scoring):
  """`(update_fn, state, trunk bytes, adapters at the start)` of a LoRA model
  with every projection adapted."""
  cfg = tiny.tiny_model_config(num_layers=num_layers, d_model=64, num_heads=2, head_dim=32,
                               mlp_dim=256, lora=lora.LoraConfig(rank=RANK, targets="all"))
  meshes = tiny.single_device_meshes()
  graphdef, params, _ = tiny.learner_and_sampler_params(cfg, meshes)
  adapters, base = lora.split(params)
  start = jax.tree.leaves(jax.tree.map(np.asarray, adapters))
  optimizer = optim_lib.make_optimizer(optim_lib.OptimConfig(lr=1e-2))
  state, shardings = train_state_lib.create(adapters, optimizer, meshes.learner)
  update_fn = update_lib.make_update_fn(
      graphdef=graphdef, optimizer=optimizer, state_shardings=shardings, frozen=base,
      settings=loss_settings.LossSettings.of(**scoring), mesh=meshes.learner)
  return update_fn, state, sum(x.nbytes for x in jax.tree.leaves(base["blocks"])), start


def test_a_scanned_update_picks_each_layers_base_and_never_stacks_the_trunk():
  """`learner.scan_layers` (rematerialised) with adapters: the scan stacks
  the adapters and reads each layer's frozen base through a switch, so the
  compiled update's temporaries do not grow with the trunk (a stacked copy
  of the base did: SmolLM2's update held 1.23 GiB, 0.82 without it; here
  4 more layers added 1.5 MB of temporaries for 1.05 MB of base, now 0.45),
  and the update is the unrolled one up to rounding."""
  scoring = dict(scan_layers=True, remat="block")
  temporaries, trunks = [], []
  for layers in (2, 6):
    update_fn, state, trunk, _ = _lora_update(layers, **scoring)
    temporaries.append(update_fn.lower(state, _batch()).compile().memory_analysis()
                       .temp_size_in_bytes)
    trunks.append(trunk)
  assert temporaries[1] - temporaries[0] < (trunks[1] - trunks[0]) / 2, (temporaries, trunks)

  def after_two_updates(**scoring):
    update_fn, state, _, start = _lora_update(2, **scoring)
    for _ in range(2):
      state, _ = update_fn(state, _batch())
    return jax.tree.leaves(jax.tree.map(np.asarray, state.params)), start

  (scanned, _), (unrolled, start) = after_two_updates(**scoring), after_two_updates()
  moved = max(float(np.max(np.abs(x - y))) for x, y in zip(unrolled, start))
  assert moved > 1e-4
  assert max(float(np.max(np.abs(x - y))) for x, y in zip(scanned, unrolled)) < 1e-3 * moved


def _batch():
  """A small RL batch of random tokens with mixed advantages."""
  rng = np.random.default_rng(0)
  rows, length = 8, 16
  tokens = rng.integers(0, 256, (rows, length)).astype(np.int32)
  token_mask = np.ones((rows, length), bool)
  loss_mask = np.zeros((rows, length), np.float32)
  loss_mask[:, 6:] = 1.0
  return train_batch_lib.from_rows(
      tokens=tokens, token_mask=token_mask, loss_mask=loss_mask,
      behaviour_logprobs=np.full((rows, length), -5.0, np.float32),
      token_versions=np.where(loss_mask > 0, 0, -1).astype(np.int32),
      advantages=np.linspace(-1, 1, rows).astype(np.float32),
      rewards=np.zeros((rows,), np.float32))


def test_a_publish_moves_only_adapter_bytes_and_the_sampler_sees_the_whole_model():
  cfg = _lora_cfg()
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  adapters, base = lora.split(params)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings, frozen=base)
  for version, p in enumerate((params, _with_trained_adapters(params))):
    trainable, _ = lora.split(p)
    publisher.publish(trainable, version)
    assert publisher.published_bytes == 4 * cfg.adapter_params  # float32 adapters only
    _, on_sampler = publisher.latest()
    assert jax.tree.structure(on_sampler) == jax.tree.structure(p)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, on_sampler),
                 jax.tree.map(np.asarray, p))
    devices = {d for x in jax.tree.leaves(on_sampler) for d in x.sharding.device_set}
    assert devices <= set(meshes.sampler.devices.flat)
  full = publish_lib.WeightPublisher(meshes.learner, tiny.learner_and_sampler_params(
      tiny.tiny_model_config(), meshes)[2])
  full.publish(tiny.learner_and_sampler_params(tiny.tiny_model_config(), meshes)[1], 0)
  assert full.published_bytes == 4 * tiny.tiny_model_config().num_params
  with pytest.raises(ValueError, match="frozen base"):
    publish_lib.WeightPublisher(meshes.learner, sampler_shardings)


def test_a_colocated_sampler_reads_the_learners_base_and_a_disaggregated_one_its_own():
  """One device, both roles, one dtype: the sampler's base is the learner's
  arrays (no second copy; the update never donates them), and the plan
  holds none for it. Other devices, or another dtype: its own copy."""
  cfg = _lora_cfg()
  for meshes, dtype, shared in ((tiny.single_device_meshes(), None, True),
                                (tiny.single_device_meshes(), jnp.bfloat16, False),
                                (tiny.role_meshes(), None, False)):
    _, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
    adapters, base = lora.split(params)
    publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings, dtype=dtype,
                                            frozen=base)
    publisher.publish(adapters, 0)
    assert publisher.base_shared == shared
    buffers = lambda tree: {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
                            for s in x.addressable_shards}
    on_sampler = lora.split(publisher.latest()[1])[1]
    assert (buffers(on_sampler) == buffers(base)) == shared
  # (a shared base still reads as the whole model: the previous test's check)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, on_sampler),
               jax.tree.map(np.asarray, base))


def test_sampler_logprobs_equal_learner_logprobs_with_adapters():
  """Lag 0 with trained adapters: behaviour log-probs == the learner's (<= 1e-5)."""
  cfg = _lora_cfg()
  meshes = tiny.role_meshes()
  graphdef, params, sampler_shardings = tiny.learner_and_sampler_params(cfg, meshes)
  # (adapters as far from zero as a few hundred updates take them: deltas ~the base's)
  params = _with_trained_adapters(params, scale=0.05)
  adapters, base = lora.split(params)
  publisher = publish_lib.WeightPublisher(meshes.learner, sampler_shardings, frozen=base)
  publisher.publish(adapters, 0)
  sampler_params = publisher.latest()[1]
  settings_ = sampling.SamplingSettings(eos_id=258, pad_id=256, temperature=1.0)
  driver = slots_lib.SlotDriver(graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
                                settings=settings_, num_slots=8, bucket=8, max_new_tokens=10)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, int(rng.integers(1, 9))).tolist() for _ in range(8)]
  driver.insert(sampler_params, 0, list(range(8)), prompts, group_ids=list(range(8)))
  for _ in range(9):
    driver.decode(sampler_params, 0)
  rows = [driver.row(i) for i in range(8)]
  tokens = np.stack([r["tokens"] for r in rows])
  mask = np.stack([r["token_mask"] for r in rows])
  learner = slots_lib.teacher_forced_logprobs(graphdef, params, tokens, mask, 1.0)
  sampled = np.stack([r["versions"] for r in rows]) >= 0
  assert sampled.sum() > 8 * 4
  behaviour = np.stack([r["logprobs"] for r in rows])
  assert np.abs(learner - behaviour)[sampled].max() <= 1e-5


def test_a_bfloat16_base_keeps_float32_adapters():
  cfg = _lora_cfg(base_dtype="bfloat16")
  assert cfg.base_dtype == "bfloat16" and cfg.base.param_dtype == "bfloat16"
  meshes = tiny.single_device_meshes()
  graphdef, params, _ = init_lib.init_params(cfg, meshes.learner, rules_lib.LEARNER_RULES, 0)
  adapters, base = lora.split(params)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype("bfloat16")}
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(1, 12)
  logits = _logits(graphdef, _with_trained_adapters(params), tokens)
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
  assert dataclasses.replace(cfg, lora=lora.OFF).base_dtype == "float32"


def test_the_base_fingerprint_ignores_the_mesh_and_sees_every_bit():
  cfg = tiny.tiny_model_config()
  four = tiny.role_meshes()  # learner on 4 devices (fsdp)
  _, params, _ = init_lib.init_params(cfg, four.learner, rules_lib.LEARNER_RULES, 0)
  one = tiny.single_device_meshes()
  _, same, _ = init_lib.init_params(cfg, one.learner, rules_lib.LEARNER_RULES, 0)
  assert fingerprint.fingerprint(params) == fingerprint.fingerprint(same)
  flipped = jax.tree.map(lambda x: x, params)
  embed = np.asarray(flipped["embed"][...]).copy()
  embed.view(np.uint32)[3, 5] ^= 1  # one bit of one parameter
  flipped["embed"] = flipped["embed"].replace(jnp.asarray(embed))
  assert fingerprint.fingerprint(flipped) != fingerprint.fingerprint(params)
  _, other_seed, _ = init_lib.init_params(cfg, one.learner, rules_lib.LEARNER_RULES, 1)
  assert fingerprint.fingerprint(other_seed) != fingerprint.fingerprint(params)
