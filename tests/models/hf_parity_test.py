"""Hugging Face import/export: logit parity with `transformers` for each family,
an exact export round trip, and sampler log-probs equal to the learner's."""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import hf_config, hf_params
from arl_jax.sampler import engine_config, sampling
from arl_jax.sampler import generate as generate_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import slots as slots_lib
from arl_jax.testing import tiny

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rms_norm_eps=1e-6)
# One small model per family, each with the options that family uses.
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(
        tie_word_embeddings=False, rope_theta=500_000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=16,
                                             rope_theta=1e6)),
    # Qwen's long-context setting: YaRN (changes frequencies and scales cos/sin).
    "qwen2_yarn": (transformers.Qwen2Config, dict(
        tie_word_embeddings=False, rope_theta=1e6,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16))),
}


def _hf_model(family, folder):
  """A random `transformers` model of `family`, every weight perturbed (so that
  norms and biases are not their trivial 1 and 0), saved to `folder`."""
  config_cls, extra = FAMILIES[family]
  config = config_cls(**_COMMON, **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(folder, safe_serialization=True)
  return model


@pytest.fixture(scope="module")
def meshes():
  return tiny.role_meshes()


def _import(family, folder, meshes):
  model = _hf_model(family, folder)
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  return dict(family=family, folder=folder, model=model, cfg=cfg, graphdef=graphdef,
              params=params)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, meshes, tmp_path_factory):
  return _import(request.param, str(tmp_path_factory.mktemp(request.param)), meshes)


def _our_logits(graphdef, params, tokens):
  mask = jnp.ones(tokens.shape, bool)
  model = nnx.merge(graphdef, params)
  logits, _ = model(jnp.asarray(tokens), decoder_lib.positions_from_mask(mask),
                    decoder_lib.causal_mask(mask))
  return np.asarray(logits)


def test_the_config_names_each_family_s_options(imported):
  cfg, family = imported["cfg"], imported["family"]
  assert cfg.qkv_bias == family.startswith("qwen2")
  assert cfg.qk_norm == (family == "qwen3")
  assert (cfg.rope_scaling is not None) == (family in ("llama", "qwen2_yarn"))
  assert cfg.num_params == sum(p.numel() for p in imported["model"].parameters())


def test_logits_match_transformers(imported):
  tokens = np.random.default_rng(1).integers(0, 96, (2, 40))
  with torch.no_grad():
    want = imported["model"](torch.tensor(tokens)).logits.numpy()
  got = _our_logits(imported["graphdef"], imported["params"], tokens)
  assert np.abs(got - want).max() <= 1e-4


def test_export_reloads_into_transformers_exactly(imported, tmp_path):
  out = str(tmp_path / "export")
  hf_params.save_params(imported["params"], imported["cfg"], out,
                        hf_config.family_of(hf_config.read_config(imported["folder"])),
                        base_config=hf_config.read_config(imported["folder"]))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  want = imported["model"].state_dict()
  got = reloaded.state_dict()
  assert set(got) == set(want)
  for name, tensor in want.items():
    assert torch.equal(got[name], tensor), name


def test_an_export_without_a_base_config_keeps_the_model_s_rope(imported, tmp_path):
  """No base config.json (a model trained from scratch, or exported without its
  folder): the written config still carries the RoPE scaling (llama3, YaRN),
  so transformers computes the same logits from the folder."""
  out = str(tmp_path / "export")
  family = hf_config.family_of(hf_config.read_config(imported["folder"]))
  hf_params.save_params(imported["params"], imported["cfg"], out, family)
  assert hf_config.model_config_from_hf(hf_config.read_config(out)) == imported["cfg"]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  tokens = torch.tensor(np.random.default_rng(4).integers(0, 96, (2, 40)))
  with torch.no_grad():
    want = imported["model"](tokens).logits.numpy()
    got = reloaded(tokens).logits.numpy()
  assert np.abs(got - want).max() <= 1e-5


def test_a_tied_checkpoint_s_stored_head_must_be_its_embedding(meshes, tmp_path):
  """Some tied checkpoints store `lm_head.weight` too. A copy of the embedding
  imports as before; a different one is refused, since transformers then
  unties the two and uses the stored head."""
  import safetensors.numpy  # noqa: PLC0415

  folder = str(tmp_path / "m")
  model = _hf_model("qwen2", folder)  # tied
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  path = os.path.join(folder, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  embed = tensors["model.embed_tokens.weight"]
  safetensors.numpy.save_file({**tensors, "lm_head.weight": embed.copy()}, path,
                              metadata={"format": "pt"})
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  tokens = np.random.default_rng(5).integers(0, 96, (2, 24))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  assert np.abs(_our_logits(graphdef, params, tokens) - want).max() <= 1e-4

  safetensors.numpy.save_file({**tensors, "lm_head.weight": embed + 0.5}, path,
                              metadata={"format": "pt"})
  untied = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
  with pytest.raises(hf_config.HfConfigError, match=re.escape(
      f"{path}: holds lm_head.weight (96, 32), which differs from model.embed_tokens.weight "
      "(96, 32), but config.json has tie_word_embeddings=true")):
    hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  safetensors.numpy.save_file({**tensors, "lm_head.weight": embed[:90]}, path,
                              metadata={"format": "pt"})
  with pytest.raises(hf_config.HfConfigError, match=re.escape("lm_head.weight (90, 32), which")):
    hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)


# Between them every option: QK-norm, biases, untied, YaRN (qwen2 with tied
# embeddings is checked in a whole run below).
@pytest.mark.parametrize("family", ["qwen3", "qwen2_yarn"])
def test_sampler_logprobs_equal_the_learner_s(family, meshes, tmp_path):
  """Sampled in slots (prefill + decode with a KV cache, on the sampler mesh)
  versus teacher-forced on the learner mesh: the same numbers."""
  imported = _import(family, str(tmp_path), meshes)
  cfg, graphdef = imported["cfg"], imported["graphdef"]
  _, sampler_params = hf_params.load_params(imported["folder"], cfg, meshes.sampler,
                                            rules_lib.SAMPLER_RULES)
  settings = sampling.SamplingSettings(eos_id=95, pad_id=0)
  generator = generate_lib.Generator(
      cfg=engine_config.EngineConfig(prompt_len=8, kv_cache="dense", decode_burst=1,
                                     precompile=False, num_slots=4, group_size=1, max_new_tokens=12),
      settings=settings, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler)
  prompts = [np.random.default_rng(i).integers(1, 90, 5 + i).tolist() for i in range(4)]
  checked = 0
  for prompt, [completion] in zip(prompts, generator(sampler_params, prompts)):
    tokens = np.concatenate([prompt, completion.tokens])
    want = slots_lib.teacher_forced_logprobs(graphdef, imported["params"], tokens,
                                             np.ones(tokens.shape, bool))[0][len(prompt):]
    np.testing.assert_allclose(completion.logprobs, want, atol=1e-5)
    checked += len(completion.tokens)
  assert checked >= 4 * 2


def test_bad_folders_are_named(tmp_path, meshes):
  with pytest.raises(FileNotFoundError, match="config.json: no such file"):
    hf_config.read_config(str(tmp_path))
  with pytest.raises(hf_config.HfConfigError, match="architecture 'GPT2LMHeadModel'"):
    hf_config.model_config_from_hf({"architectures": ["GPT2LMHeadModel"]})
  with pytest.raises(hf_config.HfConfigError, match="rope type 'longrope' is not supported"):
    hf_config.model_config_from_hf({**_COMMON, "architectures": ["Qwen2ForCausalLM"],
                                    "rope_scaling": {"type": "longrope", "factor": 4.0}})
  folder = str(tmp_path / "m")
  _hf_model("qwen2", folder)
  hf = hf_config.read_config(folder)
  # A config that disagrees with the weights: the tensor is named with both shapes.
  cfg = hf_config.model_config_from_hf({**hf, "intermediate_size": 40})
  with pytest.raises(hf_config.HfConfigError,
                     match=r"model.layers.0.mlp.down_proj.weight has shape \(32, 48\); "
                           r"config.json implies \(32, 40\)"):
    hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  # Integer (quantised) weights: named, not silently cast.
  import safetensors.numpy  # noqa: PLC0415
  path = os.path.join(folder, "model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int8)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(hf_config.HfConfigError, match="model.norm.weight is stored as int8"):
    hf_params.load_params(folder, hf_config.model_config_from_hf(hf), meshes.learner,
                          rules_lib.LEARNER_RULES)
  os.remove(os.path.join(folder, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
    hf_params.load_params(folder, hf_config.model_config_from_hf(hf), meshes.learner,
                          rules_lib.LEARNER_RULES)
  with pytest.raises(ValueError, match="model.param_dtype must be float32 or bfloat16"):
    hf_config.model_config_from_hf(hf, param_dtype="float16")


def test_a_run_starts_from_a_hugging_face_folder(tmp_path):
  """`model.hf_path`: shapes from config.json, weights as the run's start. The
  first batch was sampled by the imported weights: its behaviour log-probs are
  what `transformers` computes for those tokens."""
  from arl_jax import export_hf  # noqa: PLC0415
  from arl_jax.config import run_spec  # noqa: PLC0415
  from arl_jax.learner import checkpointing  # noqa: PLC0415
  from arl_jax.models import init_lib  # noqa: PLC0415
  from arl_jax.training import run_lib  # noqa: PLC0415

  folder = str(tmp_path / "hf")
  config_cls, extra = FAMILIES["qwen2"]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(
      config_cls(**{**_COMMON, "vocab_size": 272}, **extra)).float().eval()
  model.save_pretrained(folder, safe_serialization=True)
  config = tiny.load_config("arith", "tiny")
  config.model.hf_path = folder  # beside the tiny config's own shapes: ambiguous
  with pytest.raises(run_spec.ConfigError, match=r"model.hf_path: \['d_model', .* come from"):
    run_spec.build(config)
  config.model = dict(hf_path=folder, max_seq_len=64, param_dtype="float32", value_head=False)
  config.num_steps, config.eval_every, config.warmup.steps = 1, 0, 0
  config.checkpoint = {"save_final": True}
  config.learner.entropy_coef = 0.01  # moves the params even when every reward is 0
  lines = []
  result = run_lib.run(config, str(tmp_path / "run"), print_fn=lines.append, keep_batches=True)
  assert any(line.startswith(f"imported {folder}") for line in lines)
  (batch,) = result.trained_batches
  checked = 0
  for row in range(len(batch["tokens"])):
    real = batch["token_mask"][row]
    tokens = batch["tokens"][row][real]
    with torch.no_grad():
      logits = model(torch.tensor(tokens[None])).logits[0].double()
    want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(tokens[1:, None]))[:, 0]
    sampled = batch["loss_mask"][row][real][1:] > 0
    got = batch["behaviour_logprobs"][row][real][1:]
    np.testing.assert_allclose(got[sampled], want.numpy()[sampled], atol=1e-5)
    checked += int(sampled.sum())
  assert checked > 0

  # The trained params go back out as a Hugging Face folder that transformers
  # loads, with the same logits as arl_jax computes from the checkpoint.
  out = str(tmp_path / "export")
  assert export_hf.export(str(tmp_path / "run" / "checkpoints"), folder, out) == 1
  trained = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, abstract = init_lib.abstract_model(cfg)
  meshes = tiny.role_meshes()
  shardings = rules_lib.state_shardings(abstract, meshes.learner, rules_lib.LEARNER_RULES)
  params = checkpointing.Checkpointer(str(tmp_path / "run" / "checkpoints"),
                                      checkpointing.CheckpointConfig()).restore_params(
      checkpointing.abstract_like(abstract, shardings))
  tokens = np.random.default_rng(2).integers(0, 272, (2, 16))
  with torch.no_grad():
    want = trained(torch.tensor(tokens)).logits.numpy()
    before = model(torch.tensor(tokens)).logits.numpy()
  got = _our_logits(graphdef, params, tokens)
  assert np.abs(got - want).max() <= 1e-4 < np.abs(want - before).max()


def test_a_bfloat16_export_in_shards_reloads_into_transformers(imported, tmp_path):
  """bfloat16 tensors, split over several files with an index (a tiny shard
  limit forces it): transformers loads exactly the bfloat16 rounding of the
  float32 weights."""
  out = str(tmp_path / "bf16")
  files = hf_params.save_params(imported["params"], imported["cfg"], out,
                                hf_config.family_of(hf_config.read_config(imported["folder"])),
                                dtype="bfloat16", max_shard_bytes=4096)
  assert len(files) > 1 and os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
  got = reloaded.state_dict()
  for name, tensor in imported["model"].state_dict().items():
    assert torch.equal(got[name], tensor.to(torch.bfloat16)), name


def test_a_bfloat16_checkpoint_imports_exactly(meshes, tmp_path):
  """Published checkpoints are mostly bfloat16 (read from the file's own byte
  offsets: safetensors' numpy loader has no bfloat16): imported into float32,
  the logits are those of the same bfloat16 weights in transformers."""
  model = _hf_model("qwen3", str(tmp_path / "f32")).to(torch.bfloat16)
  folder = str(tmp_path / "bf16")
  model.save_pretrained(folder, safe_serialization=True)
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  tokens = np.random.default_rng(3).integers(0, 96, (2, 24))
  # (Loaded afresh: casting `model` back would also round its RoPE buffer.)
  reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
  with torch.no_grad():
    want = reference(torch.tensor(tokens)).logits.numpy()
  assert np.abs(_our_logits(graphdef, params, tokens) - want).max() <= 1e-4
  _, bf16_params = hf_params.load_params(
      folder, hf_config.model_config_from_hf(hf_config.read_config(folder),
                                             param_dtype="bfloat16"),
      meshes.learner, rules_lib.LEARNER_RULES)
  np.testing.assert_array_equal(  # bfloat16 in, bfloat16 kept: bit for bit
      np.asarray(bf16_params["embed"][...]).view(np.uint16),
      model.model.embed_tokens.weight.detach().view(torch.int16).numpy().view(np.uint16))
