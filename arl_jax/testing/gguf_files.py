"""Small GGUF files written by the tests themselves, and a reference reading of them.

`write_llama` writes a tiny Llama (or Qwen2) model as llama.cpp's converter
would: Q/K rows permuted (Llama), every 2-D weight in one quantisation type,
norms in float32, a byte-level BPE vocabulary with a control token and a
ChatML template. It returns the float32 values a correct reader must get for
each Hugging Face tensor, computed by `reference_dequantize`: llama.cpp's C
block formulas written out again, element by element, independent of the
`gguf` package's vectorised numpy code the converter uses.

Types the `gguf` package cannot quantise (the K-quants) are written as
random blocks whose scale fields are set to small finite halves.
"""

from __future__ import annotations

import numpy as np

# Bytes per block and values per block of each type written here.
BLOCKS = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256),
          "Q5_K": (176, 256), "Q6_K": (210, 256)}
FLOAT_TYPES = ("F32", "F16", "BF16")
ALL_TYPES = FLOAT_TYPES + tuple(BLOCKS)


def _half(raw: np.ndarray) -> float:
  return float(np.frombuffer(raw.tobytes(), np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
  if j < 4:
    return int(q[j]) & 63, int(q[j + 4]) & 63
  return ((int(q[j + 4]) & 0xF) | ((int(q[j - 4]) >> 6) << 4),
          (int(q[j + 4]) >> 4) | ((int(q[j]) >> 6) << 4))


def _block(kind: str, b: np.ndarray) -> list[float]:
  """One block's values, as ggml-quants.c's dequantize_row_* computes them."""
  y = []
  if kind == "Q8_0":
    d = _half(b[:2])
    y = [d * v for v in b[2:].view(np.int8)]
  elif kind in ("Q4_0", "Q4_1"):
    d = _half(b[:2])
    m, qs = (_half(b[2:4]), b[4:]) if kind == "Q4_1" else (-8.0 * d, b[2:])
    y = [d * (q & 0xF) + m for q in qs] + [d * (q >> 4) + m for q in qs]
  elif kind in ("Q4_K", "Q5_K"):
    d, dmin, scales = _half(b[0:2]), _half(b[2:4]), b[4:16]
    qh, ql = (b[16:48], b[48:176]) if kind == "Q5_K" else (None, b[16:144])
    for n, j in enumerate(range(0, 256, 64)):
      (s1, m1), (s2, m2) = _scale_min_k4(2 * n, scales), _scale_min_k4(2 * n + 1, scales)
      q = ql[32 * n:32 * n + 32]
      high = [0] * 32 if qh is None else [16 * bool(h & (1 << (2 * n))) for h in qh]
      y += [d * s1 * ((int(v) & 0xF) + hi) - dmin * m1 for v, hi in zip(q, high)]
      high = [0] * 32 if qh is None else [16 * bool(h & (2 << (2 * n))) for h in qh]
      y += [d * s2 * ((int(v) >> 4) + hi) - dmin * m2 for v, hi in zip(q, high)]
      del j
  elif kind == "Q6_K":
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _half(b[208:210])
    y = [0.0] * 256
    for half_ in range(2):
      l8, h8, s8, out = ql[64 * half_:], qh[32 * half_:], sc[8 * half_:], 128 * half_
      for lane in range(32):
        i = lane // 16
        q1 = ((int(l8[lane]) & 0xF) | (((int(h8[lane]) >> 0) & 3) << 4)) - 32
        q2 = ((int(l8[lane + 32]) & 0xF) | (((int(h8[lane]) >> 2) & 3) << 4)) - 32
        q3 = ((int(l8[lane]) >> 4) | (((int(h8[lane]) >> 4) & 3) << 4)) - 32
        q4 = ((int(l8[lane + 32]) >> 4) | (((int(h8[lane]) >> 6) & 3) << 4)) - 32
        y[out + lane] = d * s8[i] * q1
        y[out + lane + 32] = d * s8[i + 2] * q2
        y[out + lane + 64] = d * s8[i + 4] * q3
        y[out + lane + 96] = d * s8[i + 6] * q4
  return y


def reference_dequantize(kind: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """Float32 `shape` values of `raw` (uint8 blocks, row-major) of type `kind`."""
  size, per = BLOCKS[kind]
  blocks = np.asarray(raw, np.uint8).reshape(-1, size)
  values = [v for b in blocks for v in _block(kind, b)]
  assert len(values) == int(np.prod(shape)) and len(values) == len(blocks) * per
  return np.asarray(values, np.float32).reshape(shape)


def _encode(kind: str, values: np.ndarray, rng: np.random.Generator):
  """`(data, raw_dtype, expected float32)` of a 2-D float32 `values` stored as `kind`."""
  import gguf  # noqa: PLC0415

  qtype = gguf.GGMLQuantizationType[kind]
  if kind == "F32":
    return values, None, values
  if kind == "F16":
    data = values.astype(np.float16)
    return data, None, data.astype(np.float32)
  if kind == "BF16":
    data = gguf.quants.quantize(values, qtype)  # (uint8 bytes of bfloat16)
    as_bf16 = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return data, qtype, as_bf16.reshape(values.shape)
  size, per = BLOCKS[kind]
  rows, cols = values.shape
  if kind in ("Q8_0", "Q4_0", "Q4_1"):
    data = gguf.quants.quantize(values, qtype)
  else:  # random blocks with finite, small scales
    data = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind]
    for offset in scale_at:
      halves = rng.uniform(0.001, 0.01, (rows, cols // per)).astype(np.float16)
      data[..., offset:offset + 2] = halves.view(np.uint8).reshape(rows, cols // per, 2)
    data = data.reshape(rows, -1)
  return data, qtype, reference_dequantize(kind, data, values.shape)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's convert_hf_to_gguf permutation of Llama Q/K rows."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


# A byte-level BPE vocabulary: the 256 byte characters, a few merges, ChatML specials.
def _vocabulary():
  from arl_jax.models import gguf_convert  # noqa: PLC0415

  alphabet = gguf_convert._byte_alphabet()  # noqa: SLF001 - the same GPT-2 alphabet
  tokens = [alphabet[b] for b in range(256)]
  merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġ 1", "1 2"]
  tokens += ["Ġt", "he", "Ġthe", "Ġa", "in", "Ġ1", "12"]
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  types = [1] * len(tokens) + [3] * len(specials)
  return tokens + specials, merges, types


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_llama(path: str, kind: str, *, arch: str = "llama", d_model: int = 256,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                mlp_dim: int = 256, tied: bool = True, seed: int = 0,
                add_bos_token: bool = False) -> dict[str, np.ndarray]:
  """Writes a tiny model to `path`; returns `{hf tensor name: expected float32}`.
  Its BOS is `<|im_start|>`, added to text only with `add_bos_token`."""
  import gguf  # noqa: PLC0415

  rng = np.random.default_rng(seed)
  tokens, merges, types = _vocabulary()
  vocab, head_dim = len(tokens), d_model // num_heads
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(num_layers)
  writer.add_context_length(512)
  writer.add_embedding_length(d_model)
  writer.add_feed_forward_length(mlp_dim)
  writer.add_head_count(num_heads)
  writer.add_head_count_kv(num_kv_heads)
  writer.add_rope_freq_base(10_000.0)
  writer.add_layer_norm_rms_eps(1e-5)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("default")
  writer.add_token_list(tokens)
  writer.add_token_merges(merges)
  writer.add_token_types(types)
  writer.add_bos_token_id(tokens.index("<|im_start|>"))
  writer.add_eos_token_id(tokens.index("<|im_end|>"))
  writer.add_pad_token_id(tokens.index("<|endoftext|>"))
  writer.add_add_bos_token(add_bos_token)
  writer.add_chat_template(CHATML)
  expected = {}

  def add(gguf_name, hf, shape, scale, quantised=True, heads=None):
    values = rng.normal(0, scale, shape).astype(np.float32)
    if not quantised:  # norms and biases stay float32, as in real files
      data, raw, want = values, None, values
    else:
      data, raw, want = _encode(kind, values, rng)
    writer.add_tensor(gguf_name, data, raw_dtype=raw)
    expected[hf] = want if heads is None else _unpermute_for_test(want, heads)

  add("token_embd.weight", "model.embed_tokens.weight", (vocab, d_model), 0.5)
  for i in range(num_layers):
    b, h = f"blk.{i}.", f"model.layers.{i}."
    add(b + "attn_norm.weight", h + "input_layernorm.weight", (d_model,), 0.1, False)
    add(b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (d_model,), 0.1, False)
    llama = arch == "llama"
    add(b + "attn_q.weight", h + "self_attn.q_proj.weight", (num_heads * head_dim, d_model),
        0.1, heads=num_heads if llama else None)
    add(b + "attn_k.weight", h + "self_attn.k_proj.weight", (num_kv_heads * head_dim, d_model),
        0.1, heads=num_kv_heads if llama else None)
    add(b + "attn_v.weight", h + "self_attn.v_proj.weight", (num_kv_heads * head_dim, d_model),
        0.1)
    if arch == "qwen2":
      for name, rows in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
        add(b + f"attn_{name}.bias", h + f"self_attn.{name}_proj.bias", (rows * head_dim,), 0.1,
            False)
    add(b + "attn_output.weight", h + "self_attn.o_proj.weight", (d_model, num_heads * head_dim),
        0.1)
    add(b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (mlp_dim, d_model), 0.1)
    add(b + "ffn_up.weight", h + "mlp.up_proj.weight", (mlp_dim, d_model), 0.1)
    add(b + "ffn_down.weight", h + "mlp.down_proj.weight", (d_model, mlp_dim), 0.1)
  add("output_norm.weight", "model.norm.weight", (d_model,), 0.1, False)
  if not tied:
    add("output.weight", "lm_head.weight", (vocab, d_model), 0.5)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return expected


def _unpermute_for_test(w: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of `permute`, written from it (not from the converter)."""
  order = permute(np.arange(w.shape[0]), heads)  # stored row r holds original row order[r]
  out = np.empty_like(w)
  out[order] = w
  return out
