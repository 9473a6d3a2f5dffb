"""A LoRA run from a Hugging Face base, exported: its PEFT folder loaded by
`peft` onto the base in `transformers` gives the learner's logits, the merged
folder too, and the folder starts another run's adapters exactly."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax import export_hf
from arl_jax.config import run_spec
from arl_jax.learner import checkpointing
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import hf_params, init_lib, lora, peft_adapters
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import tiny
from arl_jax.training import run_lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _base_folder(folder):
  """A random Qwen2-shaped `transformers` model (the arith tokenizer fits its
  vocabulary), saved to `folder`."""
  torch.manual_seed(0)
  config = transformers.Qwen2Config(
      vocab_size=272, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6)
  model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
  model.save_pretrained(folder, safe_serialization=True)
  return model


def _config(hf_folder):
  config = tiny.load_config("arith", "tiny")
  config.model = dict(hf_path=hf_folder, max_seq_len=64, param_dtype="float32",
                      value_head=False)
  config.num_steps, config.eval_every, config.warmup.steps = 2, 0, 0
  config.checkpoint = {"save_final": True}
  config.learner.entropy_coef = 0.01  # moves the params even when every reward is 0
  config.learner.lr = 3e-2  # (adapters far enough from zero to tell apart)
  config.learner.lora.update(rank=4, alpha=8.0)
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("lora_hf")
  folder = str(root / "hf")
  base_model = _base_folder(folder)
  config = _config(folder)
  run_lib.run(config, str(root / "run"), print_fn=lambda *_: None)
  spec = run_spec.build(config)
  mesh = tiny.role_meshes().learner
  graphdef, abstract = init_lib.abstract_model(spec.model)
  abstract_adapters, _ = lora.split(abstract)
  shardings = rules_lib.state_shardings(abstract_adapters, mesh, rules_lib.LEARNER_RULES)
  reader = checkpointing.Checkpointer(str(root / "run" / "checkpoints"),
                                      checkpointing.CheckpointConfig())
  adapters = reader.restore_params(checkpointing.abstract_like(abstract_adapters, shardings))
  reader.close()
  _, base = hf_params.load_params(folder, spec.model.base, mesh, rules_lib.LEARNER_RULES)
  return dict(root=root, folder=folder, base_model=base_model, spec=spec, graphdef=graphdef,
              adapters=adapters, params=lora.merge(adapters, base), mesh=mesh)


def _our_logits(graphdef, params, tokens):
  mask = jnp.ones(tokens.shape, bool)
  logits, _ = nnx.merge(graphdef, params)(jnp.asarray(tokens),
                                          decoder_lib.positions_from_mask(mask),
                                          decoder_lib.causal_mask(mask))
  return np.asarray(logits)


def test_the_peft_folder_on_the_base_gives_the_learner_s_logits(trained, tmp_path):
  out, peft_out = str(tmp_path / "merged"), str(tmp_path / "peft")
  step = export_hf.export(str(trained["root"] / "run" / "checkpoints"), trained["folder"], out,
                          peft_out=peft_out)
  assert step == 2
  with open(os.path.join(peft_out, peft_adapters.CONFIG_FILE)) as f:
    saved = json.load(f)
  assert (saved["r"], saved["lora_alpha"], saved["peft_type"]) == (4, 8.0, "LORA")
  tokens = np.random.default_rng(2).integers(0, 272, (2, 16))
  ours = _our_logits(trained["graphdef"], trained["params"], tokens)
  with torch.no_grad():
    before = trained["base_model"](torch.tensor(tokens)).logits.numpy()
    base = transformers.AutoModelForCausalLM.from_pretrained(trained["folder"],
                                                             dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(base, peft_out).eval()
    want = with_adapters(torch.tensor(tokens)).logits.numpy()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    want_merged = merged(torch.tensor(tokens)).logits.numpy()
  assert np.abs(ours - want).max() <= 1e-4 < np.abs(want - before).max()
  assert np.abs(ours - want_merged).max() <= 1e-4


def test_an_actor_critic_lora_run_exports_its_policy(trained, tmp_path):
  """The value head trained beside the adapters is no part of the policy a
  merged or PEFT folder holds, which still give the learner's logits; the
  export's base check passes (its fingerprint leaves the head out, as the
  run's does)."""
  config = _config(trained["folder"])
  config.learner.loss = "vtrace"
  config.model.value_head = True
  config.num_steps = 1
  run_lib.run(config, str(tmp_path / "run"), print_fn=lambda *_: None)
  peft_out = str(tmp_path / "peft")
  export_hf.export(str(tmp_path / "run" / "checkpoints"), trained["folder"],
                   str(tmp_path / "merged"), peft_out=peft_out)
  spec, mesh = run_spec.build(config), trained["mesh"]
  graphdef, abstract = init_lib.abstract_model(spec.model)
  trainable, _ = lora.split(abstract)  # (the adapters and the head)
  shardings = rules_lib.state_shardings(trainable, mesh, rules_lib.LEARNER_RULES)
  reader = checkpointing.Checkpointer(str(tmp_path / "run" / "checkpoints"),
                                      checkpointing.CheckpointConfig())
  trainable = reader.restore_params(checkpointing.abstract_like(trainable, shardings))
  reader.close()
  _, base = hf_params.load_params(trained["folder"], spec.model.base, mesh,
                                  rules_lib.LEARNER_RULES)
  tokens = np.random.default_rng(3).integers(0, 272, (2, 16))
  ours = _our_logits(graphdef, lora.merge(trainable, base), tokens)
  with torch.no_grad():
    base = transformers.AutoModelForCausalLM.from_pretrained(trained["folder"],
                                                             dtype=torch.float32)
    want = peft.PeftModel.from_pretrained(base, peft_out).eval()(torch.tensor(tokens))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                               dtype=torch.float32)
    want_merged = merged(torch.tensor(tokens)).logits.numpy()
  assert np.abs(ours - want.logits.numpy()).max() <= 1e-4
  assert np.abs(ours - want_merged).max() <= 1e-4


def test_a_peft_folder_starts_a_run_s_adapters_and_other_shapes_are_refused(trained,
                                                                           tmp_path):
  peft_out = str(tmp_path / "peft")
  peft_adapters.save(trained["params"], trained["spec"].model, peft_out, trained["folder"])
  loaded = peft_adapters.load(peft_out, trained["spec"].model, trained["mesh"],
                              rules_lib.LEARNER_RULES)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded),
               jax.tree.map(np.asarray, trained["adapters"]))
  # With a critic: the adapters alone (the value head is no part of the folder).
  critic = dataclasses.replace(trained["spec"].model, value_head=True)
  with_head = peft_adapters.load(peft_out, critic, trained["mesh"], rules_lib.LEARNER_RULES)
  assert jax.tree.structure(with_head) == jax.tree.structure(loaded)
  config = _config(trained["folder"])
  config.learner.lora.init_from = peft_out
  config.num_steps = 1
  lines = []
  run_lib.run(config, str(tmp_path / "run"), print_fn=lines.append)
  assert f"LoRA adapters from {peft_out}" in lines
  config.learner.lora.rank = 8
  with pytest.raises(run_spec.ConfigError, match=r"config.learner.lora.init_from: .*rank 4, "
                     r"alpha 8.0.*learner.lora has rank 8"):
    run_spec.build(config)
  # A run that trained the whole model has no adapters to write.
  plain = _config(trained["folder"])
  plain.learner.lora.rank = 0
  plain.num_steps = 1
  run_lib.run(plain, str(tmp_path / "plain"), print_fn=lambda *_: None)
  with pytest.raises(ValueError, match="holds no LoRA adapters"):
    export_hf.export(str(tmp_path / "plain" / "checkpoints"), trained["folder"],
                     str(tmp_path / "x"), peft_out=str(tmp_path / "y"))


def test_an_export_refuses_another_base(trained, tmp_path):
  other = str(tmp_path / "other")
  model = _base_folder(other)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.01)
  model.save_pretrained(other, safe_serialization=True)
  with pytest.raises(ValueError, match=f"--hf_path={other} is not the base"):
    export_hf.export(str(trained["root"] / "run" / "checkpoints"), other, str(tmp_path / "o"))
