"""GGUF -> Hugging Face folder (`models/gguf_convert.py`), on small GGUF files the
tests write: every quantisation type dequantises to llama.cpp's values (an
independent element-by-element reference), Llama Q/K rows come back in
Hugging Face order, the folder imports into arl_jax with the logits
transformers gets from the same GGUF file, the tokenizer encodes as
transformers' GGUF tokenizer does, and bad files are named."""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax import export_hf
from arl_jax.envs import chat_template, hf_tokenizer
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import gguf_convert, hf_config, hf_params
from arl_jax.sampler import engine_config, sampling
from arl_jax.sampler import generate as generate_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.testing import gguf_files, tiny

gguf = pytest.importorskip("gguf")
safetensors_numpy = pytest.importorskip("safetensors.numpy")


@pytest.mark.parametrize("kind", gguf_files.ALL_TYPES)
def test_every_quantisation_type_converts_to_llama_cpp_s_values(tmp_path, kind):
  expected = gguf_files.write_llama(str(tmp_path / "m.gguf"), kind, tied=kind != "Q4_K")
  config = gguf_convert.convert(str(tmp_path / "m.gguf"), str(tmp_path / "hf"))
  got = safetensors_numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert sorted(got) == sorted(expected)
  for name, want in expected.items():
    assert got[name].dtype == np.float32 and got[name].shape == want.shape, name
    np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
  assert config["tie_word_embeddings"] is (kind != "Q4_K")
  assert (config["num_hidden_layers"], config["num_attention_heads"],
          config["num_key_value_heads"], config["head_dim"]) == (2, 4, 2, 64)


def test_llama_q_and_k_rows_come_back_in_hugging_face_order(tmp_path):
  """A float32 file written from known Hugging Face rows, permuted as
  llama.cpp's converter permutes them, converts back to those rows."""
  heads, head_dim, d = 4, 8, 32
  hf_rows = np.arange(heads * head_dim * d, dtype=np.float32).reshape(heads * head_dim, d)
  stored = gguf_files.permute(hf_rows, heads)
  assert not np.array_equal(stored, hf_rows)
  np.testing.assert_array_equal(gguf_convert._unpermute(stored, heads), hf_rows)  # noqa: SLF001


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  folder = tmp_path_factory.mktemp("gguf")
  gguf_files.write_llama(str(folder / "m.gguf"), "Q8_0", tied=False, seed=3)
  gguf_convert.convert(str(folder / "m.gguf"), str(folder / "hf"))
  return folder


def _our_logits(folder, tokens):
  meshes = tiny.role_meshes()
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  mask = jnp.ones(tokens.shape, bool)
  logits, _ = nnx.merge(graphdef, params)(jnp.asarray(tokens),
                                          decoder_lib.positions_from_mask(mask),
                                          decoder_lib.causal_mask(mask))
  return np.asarray(logits)


def test_the_folder_imports_with_the_logits_transformers_reads_from_the_gguf(converted):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")  # (transformers loads a GGUF only with it)
  tokens = np.random.default_rng(0).integers(0, 266, (2, 12)).astype(np.int32)
  ours = _our_logits(str(converted / "hf"), tokens)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(converted), gguf_file="m.gguf", torch_dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
  scale = float(np.max(np.abs(theirs)))
  assert scale > 0.5  # (not a degenerate model)
  np.testing.assert_allclose(ours, theirs, atol=2e-5 * scale, rtol=0)


TEXTS = ["the 12 cats", "  the\tthe\n\nthe", "Ünïcödé ✓ 漢字 🙂", "1234567 + 89 = ?",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "a  12 12 in the  ",
         "<|endoftext|>tail"]


def test_the_tokenizer_encodes_as_transformers_gguf_tokenizer_does(converted):
  transformers = pytest.importorskip("transformers")
  theirs = transformers.AutoTokenizer.from_pretrained(str(converted), gguf_file="m.gguf")
  ours = hf_tokenizer.HfTokenizer(str(converted / "hf" / "tokenizer.json"), eos_token="auto",
                                  bos_token="auto", pad_token="auto", chat_template="auto")
  for text in TEXTS:
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    if "<|" not in text:  # (decode skips special tokens)
      assert ours.decode(ours.encode(text)) == text
  # The specials by name and the chat template, from the file's metadata.
  assert ours.eos_id == theirs.convert_tokens_to_ids("<|im_end|>")
  assert ours.template.jinja == gguf_files.CHATML  # (the file's own template renders prompts)
  assert ours.template.end_of_turn == chat_template.CHAT_TEMPLATES["chatml"].end_of_turn
  assert ours.encode("<|im_start|>") == [theirs.convert_tokens_to_ids("<|im_start|>")]


@pytest.mark.parametrize("arch", ["qwen2"])
def test_a_qwen2_file_keeps_its_biases_and_rows(tmp_path, arch):
  expected = gguf_files.write_llama(str(tmp_path / "m.gguf"), "F32", arch=arch)
  config = gguf_convert.convert(str(tmp_path / "m.gguf"), str(tmp_path / "hf"))
  assert config["architectures"] == ["Qwen2ForCausalLM"]
  got = safetensors_numpy.load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert "model.layers.0.self_attn.q_proj.bias" in got
  for name, want in expected.items():  # (no Q/K permutation in Qwen2 files)
    np.testing.assert_array_equal(got[name], want, err_msg=name)


def _rewrite(tmp_path, **changes):
  """A copy of a small F32 file with metadata keys changed (None: removed)."""
  src = str(tmp_path / "src.gguf")
  gguf_files.write_llama(src, "F32")
  reader = gguf.GGUFReader(src)
  meta = gguf_convert.read_metadata(reader)
  arch = changes.pop("arch", meta["general.architecture"])
  writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), arch)
  for key, value in {**meta, **changes}.items():
    if value is None or key in ("general.architecture", "GGUF.version"):
      continue
    field = reader.fields.get(key)
    vtype = field.types[0] if field is not None else gguf.GGUFValueType.get_type(value)
    sub = field.types[-1] if field is not None and vtype == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(key, value, vtype, sub_type=sub)
  for tensor in reader.tensors:
    writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(tmp_path / "bad.gguf")


@pytest.mark.parametrize("changes, message", [
    ({"llama.embedding_length": None}, "missing key 'llama.embedding_length'"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
    ({"arch": "gpt2"}, "general.architecture 'gpt2' is not supported"),
])
def test_a_file_it_cannot_convert_is_named_with_the_key(tmp_path, changes, message):
  path = _rewrite(tmp_path, **changes)
  with pytest.raises(gguf_convert.GgufError, match=f"^{path}: .*{message}"):
    gguf_convert.convert(path, str(tmp_path / "out"))
  assert not os.path.exists(tmp_path / "out")  # nothing written


def test_the_command_line_converts_and_reports_bad_files(tmp_path, capsys):
  gguf_files.write_llama(str(tmp_path / "m.gguf"), "F16")
  assert gguf_convert.main([f"--gguf={tmp_path / 'm.gguf'}", f"--out={tmp_path / 'hf'}"]) == 0
  assert "LlamaForCausalLM, 2 layers, vocabulary 266" in capsys.readouterr().out
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
  assert gguf_convert.main([f"--gguf={tmp_path / 'junk.gguf'}", "--out=/tmp/unused"]) == 2
  assert "junk.gguf: not a readable GGUF file" in capsys.readouterr().err


def test_a_trained_policy_exports_to_a_folder_transformers_loads_and_generates_from(
    converted, tmp_path):
  """The export round trip: params changed by 'training' (perturbed), written
  as `export_hf` writes them (safetensors, config.json, the tokenizer files
  and chat template copied along); transformers loads the folder, encodes the
  chat prompt as arl_jax does, and greedy-generates what the sampler's slots
  generate greedily."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  folder = str(converted / "hf")
  meshes = tiny.single_device_meshes()
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  trained = tiny.perturb(params, 0.02, seed=1)
  out = str(tmp_path / "export")
  hf_params.save_params(trained, cfg, out, "llama", base_config=hf_config.read_config(folder))
  for name in export_hf.TOKENIZER_FILES:
    if os.path.isfile(os.path.join(folder, name)):
      shutil.copy(os.path.join(folder, name), os.path.join(out, name))

  ours_tok = hf_tokenizer.HfTokenizer(os.path.join(out, "tokenizer.json"), eos_token="auto",
                                      bos_token="auto", pad_token="auto", chat_template="auto")
  theirs_tok = transformers.AutoTokenizer.from_pretrained(out)
  chat = theirs_tok.apply_chat_template([{"role": "user", "content": "the 12 cats"}],
                                        tokenize=False, add_generation_prompt=True)
  assert chat == ours_tok.template.format_chat([{"role": "user", "content": "the 12 cats"}])
  prompt = ours_tok.encode(chat)
  assert prompt == theirs_tok.encode(chat, add_special_tokens=False)

  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  new = 16
  with torch.no_grad():
    want = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                          eos_token_id=ours_tok.eos_id,
                          pad_token_id=ours_tok.pad_id)[0, len(prompt):].tolist()
  _, sampler_params = hf_params.load_params(out, cfg, meshes.sampler, rules_lib.SAMPLER_RULES)
  settings = sampling.SamplingSettings(greedy=True, eos_id=ours_tok.eos_id,
                                       pad_id=ours_tok.pad_id)
  generator = generate_lib.Generator(
      cfg=engine_config.EngineConfig(prompt_len=len(prompt), kv_cache="dense", decode_burst=1,
                                     precompile=False, num_slots=1, group_size=1,
                                     max_new_tokens=new),
      settings=settings, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler)
  [[completion]] = generator(sampler_params, [prompt])
  got = completion.tokens.tolist()
  assert got == want, (got, want)
  assert len(set(got)) > 1


def test_an_exported_model_answers_in_transformers_as_in_arl_jax_s_evaluator(converted, tmp_path):
  """What arl_jax measures is what a deployment gets: a trained (perturbed)
  policy exported with its tokenizer folder, the held-out evaluator's greedy
  completions (prompts encoded by the environment) equal transformers'
  greedy generation from `apply_chat_template(tokenize=True)`, token for
  token, and so do the rewards."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from arl_jax.envs import env_api, math_answer
  from arl_jax.training import evaluation

  folder = str(converted / "hf")
  meshes = tiny.single_device_meshes()
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  out = str(tmp_path / "export")
  hf_params.save_params(tiny.perturb(params, 0.02, seed=2), cfg, out, "llama",
                        base_config=hf_config.read_config(folder))
  for name in export_hf.TOKENIZER_FILES:
    if os.path.isfile(os.path.join(folder, name)):
      shutil.copy(os.path.join(folder, name), os.path.join(out, name))
  tok = hf_tokenizer.HfTokenizer(out, eos_token="auto", bos_token="auto", pad_token="auto",
                                 chat_template="auto")
  env = math_answer.MathAnswerEnv(math_answer.MathAnswerConfig(), tok)
  prompts = [env_api.TextPrompt(i, text, answer) for i, (text, answer) in enumerate(
      [("the 12 cats", "12"), ("a 12 in the", "7"), ("1 + 12 = ?", "13")])]
  new = 12
  evaluator = evaluation.Evaluator(
      graphdef=graphdef, model_cfg=cfg, env=env, tokenizer=tok, prompts=prompts,
      mesh=meshes.learner, engine_cfg=engine_config.EngineConfig(
          prompt_len=64, kv_cache="dense", decode_burst=1, precompile=False, num_slots=4,
          group_size=1, max_new_tokens=new))
  _, exported = hf_params.load_params(out, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  ours = evaluator.greedy(exported)

  theirs_tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  rewards = []
  for i, prompt in enumerate(prompts):
    ids = theirs_tok.apply_chat_template([{"role": "user", "content": prompt.text}],
                                         tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert env.encode_prompt(prompt) == ids  # (one BOS at most: the template's own)
    with torch.no_grad():
      completion = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                  eos_token_id=tok.stop_ids, pad_token_id=tok.pad_id)[0, len(ids):]
    completion = completion.tolist()
    assert len(set(completion)) > 1  # (not a degenerate model)
    if i < len(ours.examples):  # (the evaluator keeps the first few completions' text)
      assert ours.examples[i] == (prompt.text, tok.decode(completion))
    rewards.append(env.score(prompt, completion))
  assert ours.reward == pytest.approx(np.mean(rewards))
