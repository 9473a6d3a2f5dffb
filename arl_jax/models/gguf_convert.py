r"""A GGUF file -> a Hugging Face model folder that `model.hf_path` reads.

  python -m arl_jax.models.gguf_convert --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --out=/models/smollm2

GGUF (llama.cpp's format) holds the weights, most of them quantised in
blocks, and the config, vocabulary, merges, special tokens and chat template
as metadata under llama.cpp's key names. This module writes what a Hugging
Face folder holds instead: `config.json`, `model.safetensors` (float32, every
tensor dequantised with the `gguf` package's numpy code: no torch, no
llama.cpp), `tokenizer.json` (for the `tokenizers` library) and
`tokenizer_config.json` (special tokens, BOS, the Jinja chat template).

Why a converter and not a `model.gguf_path`: everything downstream of a
folder already exists and is tested once (the parameter table of import and
export, `tokenizer.kind='hf'` with `auto` settings, chat-template detection,
`export_hf`), and the folder is what transformers reads too, so a parity test
compares the two frameworks on the same bytes. Conversion runs once
(SmolLM2-135M: seconds); dequantising at each run's start would redo it.

What it reproduces, as transformers 5's own GGUF loader does (so that both
read a file the same way):
- Llama files store Q and K rows permuted for llama.cpp's rotary layout; they
  are permuted back (`_unpermute`). Qwen2/Qwen3 files are not permuted.
- A byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`: Llama 3,
  Qwen2, SmolLM2) becomes a BPE model with GPT-2's byte-level pre-tokenizer
  (or the split regex of a known `tokenizer.ggml.pre`), control tokens added
  as special tokens and user-defined ones as added tokens. Sentencepiece
  vocabularies (`"llama"`) are refused with a message, not guessed.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

from arl_jax.models import hf_config

# Architectures (general.architecture) -> (config.json architecture, model_type).
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`).
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4
# GPT-2's pre-tokenizer regex is the default; these `tokenizer.ggml.pre` values
# split differently (the regexes transformers 5 uses for them).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


class GgufError(hf_config.HfConfigError):
  """A GGUF file this converter cannot read: the message names the file and the key or tensor."""


def _require(cond: bool, path: str, message: str) -> None:
  if not cond:
    raise GgufError(f"{path}: {message}")


def read_metadata(reader) -> dict:
  """`{key: value}` of a `gguf.GGUFReader`'s key-value fields (arrays as lists)."""
  return {name: field.contents() for name, field in reader.fields.items()
          if not name.startswith("GGUF.")}


def hf_config_of(meta: dict, tensor_names: set[str], path: str) -> dict:
  """The `config.json` the metadata describes (checked by `hf_config` later)."""
  arch = meta.get("general.architecture")
  _require(arch in ARCHITECTURES, path, f"general.architecture {arch!r} is not supported; "
           f"supported: {sorted(ARCHITECTURES)}")

  def get(key, default=None, required=True):
    value = meta.get(f"{arch}.{key}", default)
    _require(value is not None or not required, path, f"missing key '{arch}.{key}'")
    return value

  scaling = get("rope.scaling.type", "none", required=False)
  _require(scaling in ("none", None), path, f"{arch}.rope.scaling.type {scaling!r} is not "
           "supported")
  _require("rope_freqs.weight" not in tensor_names, path,
           "tensor rope_freqs.weight (Llama 3.1 rope scaling) is not supported")
  heads, d_model = int(get("attention.head_count")), int(get("embedding_length"))
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = len(tokens) if tokens is not None else int(get("vocab_size"))
  architecture, model_type = ARCHITECTURES[arch]
  config = {
      "architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
      "hidden_size": d_model, "intermediate_size": int(get("feed_forward_length")),
      "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
      "num_key_value_heads": int(get("attention.head_count_kv", heads)),
      "head_dim": int(get("attention.key_length", d_model // heads)),
      "max_position_embeddings": int(get("context_length")),
      "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
      "rope_theta": float(get("rope.freq_base", 10_000.0)), "vocab_size": vocab,
      "tie_word_embeddings": "output.weight" not in tensor_names,
      "torch_dtype": "float32",
  }
  for name in ("bos", "eos", "padding"):
    token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
    if token_id is not None:
      config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
  return config


def hf_name(name: str, path: str) -> str | None:
  """The Hugging Face name of GGUF tensor `name`."""
  if name in _TOP_TENSORS:
    return _TOP_TENSORS[name]
  match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
  _require(match is not None and match.group(2) in _BLOCK_TENSORS, path,
           f"tensor {name!r} has no Hugging Face counterpart here")
  return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's permutation of Llama Q/K rows (per head, the rotary
  pairs interleaved instead of in two halves), as transformers does."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantized(tensor, path: str) -> np.ndarray:
  """A `gguf.ReaderTensor`'s values, float32, in numpy (row-major, Hugging Face) order."""
  import gguf  # noqa: PLC0415 - the [gguf] extra

  try:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
  except NotImplementedError as e:
    raise GgufError(f"{path}: tensor {tensor.name!r}: {tensor.tensor_type.name} cannot be "
                    f"dequantised ({e})") from e
  shape = tuple(int(n) for n in reversed(tensor.shape))
  _require(values.size == int(np.prod(shape)), path, f"tensor {tensor.name!r}: {values.size} "
           f"values for shape {shape}")
  return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def tensors(reader, config: dict, path: str):
  """`(hf_name, float32 array)` of every tensor of the file, as transformers reads them."""
  llama = config["model_type"] == "llama"
  for tensor in reader.tensors:
    name = hf_name(tensor.name, path)
    values = dequantized(tensor, path)
    if llama and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = config["num_attention_heads" if "attn_q" in tensor.name else
                     "num_key_value_heads"]
      values = _unpermute(values, heads)
    yield name, values


def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map (byte-level BPE spells tokens in it)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
               + list(range(ord("\xae"), ord("\xff") + 1)))
  chars, extra = {b: chr(b) for b in printable}, 0
  for b in range(256):
    if b not in chars:
      chars[b], extra = chr(256 + extra), extra + 1
  return chars


def tokenizer_json(meta: dict, path: str) -> dict:
  """The `tokenizer.json` of the file's byte-level BPE vocabulary."""
  from tokenizers import (  # noqa: PLC0415
      AddedToken,
      Regex,
      Tokenizer,
      decoders,
      models,
      pre_tokenizers,
      processors,
  )

  kind = meta.get("tokenizer.ggml.model")
  _require(kind == "gpt2", path, f"tokenizer.ggml.model {kind!r} is not supported (only "
           "byte-level BPE, 'gpt2': Llama 3, Qwen2, SmolLM2; convert a sentencepiece model "
           "with transformers)")
  tokens = meta["tokenizer.ggml.tokens"]
  # A token outside the byte alphabet is spelled in it (as transformers does);
  # a control token outside it is a llama.cpp mislabel and is not added.
  spelling = _byte_alphabet()
  alphabet = set(spelling.values())
  vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
           for i, t in enumerate(tokens)}
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges,
                                   dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
  split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
  if split is None:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types)
                                if k == _CONTROL and set(t) <= alphabet])
  tokenizer.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED and t in vocab])
  bos_id = meta.get("tokenizer.ggml.bos_token_id")
  if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None and bos_id < len(tokens):
    # llama.cpp starts text with BOS by the file's flag (tokenizer_config.json
    # gets it as add_bos_token); transformers by tokenizer.json's
    # post-processor alone (5.x ignores add_bos_token for a plain tokenizer.json):
    # the folder says it both ways, so both encode the same ids.
    bos = next(t for t, i in vocab.items() if i == bos_id)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
  return json.loads(tokenizer.to_str())


def tokenizer_config(meta: dict) -> dict:
  """`tokenizer_config.json`: special tokens by name, BOS/EOS adding, the chat template."""
  tokens = meta.get("tokenizer.ggml.tokens") or []
  config = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
  for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                    ("pad_token", "padding")):
    token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
    config[name] = tokens[token_id] if token_id is not None and token_id < len(tokens) else None
  if meta.get("tokenizer.chat_template"):
    config["chat_template"] = meta["tokenizer.chat_template"]
  return config


def convert(gguf_path: str, out: str) -> dict:
  """Writes the folder for `gguf_path` into `out`; returns its config.

  Raises:
    GgufError: naming the file and the key or tensor it cannot convert.
  """
  import gguf  # noqa: PLC0415
  from safetensors.numpy import save_file  # noqa: PLC0415

  _require(os.path.isfile(gguf_path), gguf_path, "no such file")
  try:
    reader = gguf.GGUFReader(gguf_path)
  except (ValueError, OSError) as e:
    raise GgufError(f"{gguf_path}: not a readable GGUF file ({e})") from e
  meta = read_metadata(reader)
  config = hf_config_of(meta, {t.name for t in reader.tensors}, gguf_path)
  # The file must make a decoder arl_jax runs exactly, before anything is written.
  hf_config.model_config_from_hf(config, where=f"{gguf_path} (as config.json)")
  tokenizer = tokenizer_json(meta, gguf_path)
  weights = dict(tensors(reader, config, gguf_path))
  os.makedirs(out, exist_ok=True)
  save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  for name, content in (("config.json", config), ("tokenizer.json", tokenizer),
                        ("tokenizer_config.json", tokenizer_config(meta))):
    with open(os.path.join(out, name), "w", encoding="utf-8") as f:
      json.dump(content, f, indent=1, ensure_ascii=False)
  return config


def main(argv: list[str] | None = None) -> int:
  import argparse  # noqa: PLC0415

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", required=True, help="the .gguf file")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  args = parser.parse_args(argv)
  try:
    config = convert(args.gguf, args.out)
  except (GgufError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {config['architectures'][0]}, {config['num_hidden_layers']} layers, "
        f"vocabulary {config['vocab_size']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
