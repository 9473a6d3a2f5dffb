"""Bad Hugging Face inputs get an error naming the file and what is wrong:
config.json values of the wrong JSON type or missing, truncated or corrupt
safetensors shards, an index that disagrees with its shards. (Checks that need
`transformers` as the reference live in hf_parity_test.py.)"""

import json
import os
import re
import struct

import ml_dtypes
import numpy as np
import pytest

from arl_jax.config import run_spec
from arl_jax.models import hf_config, hf_params
from arl_jax.models import rope as rope_lib
from arl_jax.testing import tiny

WHERE = "/models/tiny/config.json"
_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
           "rope_theta": 500000.0, "tie_word_embeddings": False}
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _model_config(**changes):
  return hf_config.model_config_from_hf({**_CONFIG, **changes}, where=WHERE)


def _raises(message):
  return pytest.raises(hf_config.HfConfigError, match="^" + re.escape(f"{WHERE}: {message}"))


def test_a_valid_config_reads_as_before():
  cfg = _model_config(rope_scaling=_LLAMA3, head_dim=None, rope_theta=500000)
  assert (cfg.d_model, cfg.num_layers, cfg.head_dim, cfg.tie_embeddings) == (32, 2, 8, False)
  assert cfg.rope_theta == 500000.0 and isinstance(cfg.rope_theta, float)  # an int is a number
  assert cfg.rope_scaling == rope_lib.RopeScaling(kind="llama3", factor=8.0,
                                                  original_max_position_embeddings=16)
  assert _model_config(tie_word_embeddings=True).tie_embeddings


@pytest.mark.parametrize("key, value, message", [
    # bool("false") is True: an untied checkpoint would import as tied.
    ("tie_word_embeddings", "false", 'tie_word_embeddings must be true or false, got "false" '
                                     "(a string)"),
    ("tie_word_embeddings", 0, "tie_word_embeddings must be true or false, got 0 (an integer)"),
    ("attention_bias", "true", 'attention_bias must be true or false, got "true" (a string)'),
    ("mlp_bias", "false", 'mlp_bias must be true or false, got "false" (a string)'),
    ("hidden_size", "32", 'hidden_size must be an integer, got "32" (a string)'),
    ("num_hidden_layers", 2.7,
     "num_hidden_layers must be an integer, got 2.7 (a number with a fraction)"),
    ("num_hidden_layers", 2.0,
     "num_hidden_layers must be an integer, got 2.0 (a number with a fraction)"),
    ("vocab_size", True, "vocab_size must be an integer, got true (a boolean)"),
    ("num_key_value_heads", [2], "num_key_value_heads must be an integer, got [2] (a list)"),
    ("head_dim", "8", 'head_dim must be an integer, got "8" (a string)'),
    ("max_position_embeddings", 64.5,
     "max_position_embeddings must be an integer, got 64.5 (a number with a fraction)"),
    ("rms_norm_eps", "1e-6", 'rms_norm_eps must be a number, got "1e-6" (a string)'),
    ("rope_theta", True, "rope_theta must be a number, got true (a boolean)"),
    ("rope_scaling", "llama3", 'rope_scaling must be an object, got "llama3" (a string)'),
    ("architectures", "LlamaForCausalLM",
     'architectures must be a list, got "LlamaForCausalLM" (a string)'),
])
def test_values_are_checked_not_coerced(key, value, message):
  with _raises(message):
    _model_config(**{key: value})


@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size", "num_hidden_layers",
                                 "intermediate_size", "vocab_size"])
def test_a_missing_required_key_is_named(key):
  hf = {k: v for k, v in _CONFIG.items() if k != key}
  with _raises(f"missing key {key!r}"):
    hf_config.model_config_from_hf(hf, where=WHERE)
  with _raises(f"missing key {key!r}"):  # null is no value either
    _model_config(**{key: None})


@pytest.mark.parametrize("key", ["original_max_position_embeddings", "low_freq_factor",
                                 "high_freq_factor", "factor"])
def test_a_llama3_scaling_without_a_key_is_named(key):
  scaling = {k: v for k, v in _LLAMA3.items() if k != key}
  with _raises(f"missing key {key!r} (in rope_scaling, rope type 'llama3')"):
    _model_config(rope_scaling=scaling)
  params = {**scaling, "rope_theta": 500000.0}  # the transformers 5 layout
  with _raises(f"missing key {key!r} (in rope_parameters, rope type 'llama3')"):
    _model_config(rope_theta=None, rope_parameters=params)


def test_rope_values_are_checked():
  with _raises("missing key 'factor' (in rope_scaling, rope type 'yarn')"):
    _model_config(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 16})
  with _raises("original_max_position_embeddings (in rope_scaling, rope type 'llama3') must be "
               'an integer, got "16" (a string)'):
    _model_config(rope_scaling={**_LLAMA3, "original_max_position_embeddings": "16"})
  with _raises("truncate (in rope_scaling, rope type 'yarn') must be true or false, got "
               '"false" (a string)'):
    _model_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": "false"})
  # YaRN without a pretraining context: transformers takes max_position_embeddings.
  yarn = _model_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
  assert yarn.rope_scaling.original_max_position_embeddings == 64
  hf = {k: v for k, v in _CONFIG.items() if k != "max_position_embeddings"}
  with _raises("missing key 'original_max_position_embeddings' (in rope_scaling, rope type "
               "'yarn') (nor max_position_embeddings)"):
    hf_config.model_config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                   where=WHERE, max_seq_len=64)


def test_rope_keys_read_as_transformers_reads_them():
  """Where the two layouts could say different things, transformers' reading is
  followed or the config refused, never a third reading."""
  with _raises("both rope_scaling and rope_parameters are set; keep one"):
    _model_config(rope_scaling=_LLAMA3, rope_parameters={"rope_type": "default"})
  with _raises("rope_theta 500000.0 disagrees with rope_parameters' rope_theta 1000000.0"):
    _model_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  assert _model_config(rope_parameters={"rope_theta": 500000.0}).rope_theta == 500000.0
  # A top-level original_max_position_embeddings has priority in transformers.
  cfg = _model_config(rope_scaling=_LLAMA3, original_max_position_embeddings=32)
  assert cfg.rope_scaling.original_max_position_embeddings == 32
  with _raises("partial_rotary_factor 0.5 is not supported"):
    _model_config(partial_rotary_factor=0.5)


def test_read_config_names_the_file(tmp_path):
  path = tmp_path / "config.json"
  path.write_text('{"hidden_size": 32,')
  with pytest.raises(hf_config.HfConfigError, match=f"^{re.escape(str(path))}: not JSON"):
    hf_config.read_config(str(tmp_path))
  path.write_text("[1, 2]")
  with pytest.raises(hf_config.HfConfigError,
                     match=f"^{re.escape(str(path))}: must hold a JSON object, got"):
    hf_config.read_config(str(tmp_path))


def test_config_validation_names_hf_path_the_file_and_the_key(tmp_path):
  """Through config_lib: the ConfigError says which setting, which file, which value."""
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({**_CONFIG, "vocab_size": 272,
                                                  "tie_word_embeddings": "false"}))
  config = tiny.load_config("arith", "tiny")
  config.model = dict(hf_path=str(folder), max_seq_len=64, param_dtype="float32",
                      value_head=False)
  path = os.path.join(str(folder), "config.json")
  with pytest.raises(run_spec.ConfigError, match=re.escape(
      f"config.model.hf_path: {path}: tie_word_embeddings must be true or false, got \"false\" "
      "(a string)")):
    run_spec.build(config)


def test_export_config_carries_the_model_s_rope():
  """Without a base, the written config.json reads back as the model's RoPE;
  with one, the base's own spelling of it is kept."""
  for scaling in (None, _LLAMA3, {"rope_type": "linear", "factor": 2.0},
                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                   "beta_fast": 16.0, "attention_factor": 1.5, "truncate": False}):
    cfg = _model_config(rope_scaling=scaling)
    for base in (None, {}):
      written = hf_config.hf_config_from_model(cfg, "llama", base)
      assert hf_config.model_config_from_hf(json.loads(json.dumps(written))) == cfg, scaling
  base = {**_CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                         "rope_theta": 1e6}}
  del base["rope_theta"]
  cfg = hf_config.model_config_from_hf(base)
  written = hf_config.hf_config_from_model(cfg, "llama", base)
  assert written["rope_parameters"] == base["rope_parameters"] and "rope_theta" not in written
  # A scaled base exported with no scaling (or another one): the model's wins.
  written = hf_config.hf_config_from_model(_model_config(), "llama", base)
  assert hf_config.model_config_from_hf(written).rope_scaling is None


# ---------------------------------------------------------------------------
# safetensors shards


def _write_safetensors(path, tensors):
  """A safetensors file, written by hand (as hf_params.save_params does) so
  that bfloat16 is possible: name -> (safetensors dtype, array)."""
  header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
  for name, (st_dtype, array) in tensors.items():
    blob = np.ascontiguousarray(array).tobytes()
    header[name] = {"dtype": st_dtype, "shape": list(array.shape),
                    "data_offsets": [offset, offset + len(blob)]}
    offset += len(blob)
    blobs.append(blob)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def _tensors():
  rng = np.random.default_rng(0)
  return {"a": ("F32", rng.normal(size=(4, 8)).astype(np.float32)),
          "b": ("BF16", rng.normal(size=(8,)).astype(ml_dtypes.bfloat16))}


def _truncate(path, size):
  with open(path, "r+b") as f:
    f.truncate(size)


def test_a_sound_shard_reads_back(tmp_path):
  _write_safetensors(tmp_path / "model.safetensors", _tensors())
  folder = hf_params.SafetensorsFolder(str(tmp_path))
  assert sorted(folder.names()) == ["a", "b"]
  for name, (_, array) in _tensors().items():
    np.testing.assert_array_equal(folder.read(name), array)


def test_a_truncated_or_corrupt_shard_is_named(tmp_path):
  path = str(tmp_path / "model.safetensors")
  _write_safetensors(path, _tensors())
  full = os.path.getsize(path)

  def opens():
    return hf_params.SafetensorsFolder(str(tmp_path))

  # Cut in the tensor data (an interrupted download): the tensor cut is named.
  _truncate(path, full - 4)
  with pytest.raises(hf_config.HfConfigError, match=re.escape(
      f"{path}: looks truncated or corrupt: tensor b needs bytes up to 144 of the data, the "
      "file holds 140 (cut short?)")):
    opens()
  _truncate(path, 100)  # in the header
  with pytest.raises(hf_config.HfConfigError,
                     match=re.escape(f"{path}: looks truncated or corrupt: its header claims")):
    opens()
  _truncate(path, 5)  # in the header's length
  with pytest.raises(hf_config.HfConfigError, match=re.escape(
      f"{path}: looks truncated or corrupt: 5 bytes, shorter than the 8-byte header length")):
    opens()
  _write_safetensors(path, _tensors())
  with open(path, "r+b") as f:
    f.seek(8)
    f.write(b"\xff garbage")
  with pytest.raises(hf_config.HfConfigError,
                     match=re.escape(f"{path}: looks truncated or corrupt: its header is not JSON")):
    opens()
  _write_safetensors(path, {"a": ("F32", np.zeros((4, 8), np.float32))})
  with open(path, "r+b") as f:  # a header whose shape disagrees with its byte range
    text = f.read()
    f.seek(0)
    f.write(text.replace(b"[4,8]", b"[4,9]").replace(b"[4, 8]", b"[4, 9]"))
  with pytest.raises(hf_config.HfConfigError,
                     match=re.escape(f"{path}: looks truncated or corrupt: tensor a has a "
                                     "malformed header entry")):
    opens()


@pytest.mark.parametrize("name", ["a", "b"])  # safetensors' reader, and the bfloat16 one
def test_a_shard_cut_after_it_was_opened_is_named_at_the_read(tmp_path, name):
  path = str(tmp_path / "model.safetensors")
  _write_safetensors(path, _tensors())
  folder = hf_params.SafetensorsFolder(str(tmp_path))
  _truncate(path, 64)
  with pytest.raises(hf_config.HfConfigError, match=re.escape(
      f"{path}: cannot read tensor {name} (") + r".*\); the file looks truncated or corrupt"):
    folder.read(name)


def test_an_index_that_disagrees_with_its_shards_is_named(tmp_path):
  tensors = _tensors()
  _write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": tensors["a"]})
  _write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": tensors["b"]})
  index = str(tmp_path / "model.safetensors.index.json")

  def write_index(weight_map):
    with open(index, "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f)

  write_index({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
  folder = hf_params.SafetensorsFolder(str(tmp_path))
  np.testing.assert_array_equal(folder.read("b"), tensors["b"][1])
  write_index({"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"})
  with pytest.raises(hf_config.HfConfigError, match=re.escape(
      f"{index}: puts b in model-00001-of-00002.safetensors, but that shard has no such tensor")):
    hf_params.SafetensorsFolder(str(tmp_path))
  write_index({"a": "model-00001-of-00002.safetensors", "b": "model-00003-of-00003.safetensors"})
  missing = os.path.join(str(tmp_path), "model-00003-of-00003.safetensors")
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"{index}: puts b in model-00003-of-00003.safetensors, but {missing} does not exist")):
    hf_params.SafetensorsFolder(str(tmp_path))
  with open(index, "w") as f:
    f.write('{"weight_map": {"a": ')
  with pytest.raises(hf_config.HfConfigError, match=re.escape(f"{index}: not a JSON object")):
    hf_params.SafetensorsFolder(str(tmp_path))
  write_index(["a"])
  with pytest.raises(hf_config.HfConfigError, match=re.escape(
      f"{index}: weight_map must be an object of tensor name -> shard file")):
    hf_params.SafetensorsFolder(str(tmp_path))
