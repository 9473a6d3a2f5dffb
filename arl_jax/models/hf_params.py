"""Hugging Face safetensors <-> the decoder's params, through one declarative table.

`param_table(cfg)` lists, for every arl_jax parameter, the Hugging Face tensor
it comes from and the layout change between the two (`LAYOUTS`): Hugging Face
stores `nn.Linear` weights as `[out, in]` with heads flattened; arl_jax keeps
`[in, out]` with heads as their own axis, so that the sharding rules can name
them. Import and export both walk this table, so they cannot disagree.

Import (`load_params`) reads one tensor at a time from the `*.safetensors`
shards (memory-mapped; `safetensors`' numpy loader, and the file's own byte
offsets for bfloat16, which numpy lacks), converts it on the host, and puts it
straight into its sharded layout on the learner mesh: the whole model is
never on one device, nor on the host at once. Export (`save_params`) gathers
one parameter at a time and streams it into float32 or bfloat16 safetensors
(sharded with an index past 5 GiB) plus `config.json` that `transformers` loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from arl_jax.models import hf_config, init_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.sharding import rules as rules_lib

# File dtypes an import converts from (to the param dtype).
_FLOAT_DTYPES = tuple(np.dtype(d) for d in (np.float32, np.float16, np.float64,
                                            ml_dtypes.bfloat16))
# Hugging Face tensors a checkpoint may hold that arl_jax does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _heads_in(w, shape):  # HF [H*Dh, D] -> [D, H, Dh]
  return w.T.reshape(shape)


def _heads_in_hf(x, shape):  # [D, H, Dh] -> [H*Dh, D]
  return x.reshape(x.shape[0], -1).T


def _heads_out(w, shape):  # HF [D, H*Dh] -> [H, Dh, D]
  return w.T.reshape(shape)


def _heads_out_hf(x, shape):  # [H, Dh, D] -> [D, H*Dh]
  return x.reshape(-1, x.shape[-1]).T


# name -> (to arl_jax, to Hugging Face); each takes the array and the target shape.
LAYOUTS = {
    "same": (lambda w, shape: w.reshape(shape), lambda x, shape: x.reshape(shape)),
    "transpose": (lambda w, shape: w.T, lambda x, shape: x.T),
    "heads_in": (_heads_in, _heads_in_hf),
    "heads_out": (_heads_out, _heads_out_hf),
}


@dataclasses.dataclass(frozen=True)
class HfParam:
  """One row of the table: the Hugging Face tensor, its shape there, the layout change."""

  name: str
  hf_shape: tuple[int, ...]
  layout: str


def param_table(cfg: model_config_lib.ModelConfig) -> dict[tuple, HfParam]:
  """arl_jax param path (as in `nnx.State`) -> its Hugging Face tensor."""
  d, h, k, dh, f, v = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                       cfg.vocab_size)
  table = {
      ("embed",): HfParam("model.embed_tokens.weight", (v, d), "same"),
      ("final_norm", "scale"): HfParam("model.norm.weight", (d,), "same"),
  }
  if not cfg.tie_embeddings:
    table[("lm_head",)] = HfParam("lm_head.weight", (v, d), "transpose")
  for i in range(cfg.num_layers):
    layer = f"model.layers.{i}"
    rows = {
        ("attn_norm", "scale"): (f"{layer}.input_layernorm.weight", (d,), "same"),
        ("mlp_norm", "scale"): (f"{layer}.post_attention_layernorm.weight", (d,), "same"),
        ("attn", "q_proj"): (f"{layer}.self_attn.q_proj.weight", (h * dh, d), "heads_in"),
        ("attn", "k_proj"): (f"{layer}.self_attn.k_proj.weight", (k * dh, d), "heads_in"),
        ("attn", "v_proj"): (f"{layer}.self_attn.v_proj.weight", (k * dh, d), "heads_in"),
        ("attn", "o_proj"): (f"{layer}.self_attn.o_proj.weight", (d, h * dh), "heads_out"),
        ("mlp", "gate"): (f"{layer}.mlp.gate_proj.weight", (f, d), "transpose"),
        ("mlp", "up"): (f"{layer}.mlp.up_proj.weight", (f, d), "transpose"),
        ("mlp", "down"): (f"{layer}.mlp.down_proj.weight", (d, f), "transpose"),
    }
    if cfg.qkv_bias:
      rows[("attn", "q_bias")] = (f"{layer}.self_attn.q_proj.bias", (h * dh,), "same")
      rows[("attn", "k_bias")] = (f"{layer}.self_attn.k_proj.bias", (k * dh,), "same")
      rows[("attn", "v_bias")] = (f"{layer}.self_attn.v_proj.bias", (k * dh,), "same")
    if cfg.out_bias:
      rows[("attn", "o_bias")] = (f"{layer}.self_attn.o_proj.bias", (d,), "same")
    if cfg.qk_norm:
      rows[("attn", "q_norm", "scale")] = (f"{layer}.self_attn.q_norm.weight", (dh,), "same")
      rows[("attn", "k_norm", "scale")] = (f"{layer}.self_attn.k_norm.weight", (dh,), "same")
    for path, (name, shape, layout) in rows.items():
      table[("blocks", i, *path)] = HfParam(name, shape, layout)
  return table


def state_path(path) -> tuple:
  """A `tree_map_with_path` path of an nnx.State leaf -> its param path."""
  return tuple(p.key for p in path if isinstance(p, jax.tree_util.DictKey))


class SafetensorsFolder:
  """The tensors of a Hugging Face folder's `*.safetensors` shards, read one at a time.

  Every shard's header is read and checked up front (cheap: the tensors are
  not touched), so a truncated download, a corrupt file or an index that does
  not match its shards is an error naming the file before anything is loaded.
  """

  def __init__(self, folder: str, file: str = "model.safetensors"):
    """`file`: the one-file name (`adapter_model.safetensors` for a PEFT
    adapter); `<file>.index.json` names the shards of a sharded one."""
    self.folder = folder
    index = os.path.join(folder, f"{file}.index.json")
    self._headers: dict[str, dict] = {}  # shard -> its parsed header
    if os.path.isfile(index):
      self.files = _weight_map(index)
    else:
      single = os.path.join(folder, file)
      if not os.path.isfile(single):
        raise FileNotFoundError(f"{folder}: neither {file} nor {file}.index.json")
      self._headers[single] = _header(single)
      self.files = dict.fromkeys(self._headers[single], single)
    for name, path in self.files.items():
      if path not in self._headers:
        if not os.path.isfile(path):
          raise FileNotFoundError(f"{index}: puts {name} in {os.path.basename(path)}, "
                                  f"but {path} does not exist")
        self._headers[path] = _header(path)
      if name not in self._headers[path]:
        raise hf_config.HfConfigError(
            f"{index}: puts {name} in {os.path.basename(path)}, but that shard has no "
            "such tensor (the index and the shards disagree)")

  def names(self) -> list[str]:
    return list(self.files)

  def read(self, name: str) -> np.ndarray:
    """One tensor as a host numpy array (bfloat16 as `ml_dtypes.bfloat16`).

    The header was checked when the folder was opened, so a failure here is a
    file cut or changed since, or bytes safetensors refuses: named, never a
    bare `struct.error` or mmap error.
    """
    path = self.files[name]
    entry = self._headers[path][name]
    if entry["dtype"] == "BF16":  # safetensors' numpy loader has no bfloat16
      try:
        return _read_raw(path, entry, ml_dtypes.bfloat16)
      except (OSError, ValueError, struct.error) as e:
        raise _unreadable(path, name, e) from e
    import safetensors  # noqa: PLC0415 - only needed to import (the `hf` extra)
    try:
      with safetensors.safe_open(path, framework="numpy") as f:
        return f.get_tensor(name)
    except (OSError, ValueError, safetensors.SafetensorError) as e:
      raise _unreadable(path, name, e) from e


def _unreadable(path: str, name: str, e: Exception) -> hf_config.HfConfigError:
  return hf_config.HfConfigError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e}); "
                                 "the file looks truncated or corrupt")


def _weight_map(index: str) -> dict[str, str]:
  """tensor name -> shard path, from a `model.safetensors.index.json`."""
  with open(index, encoding="utf-8") as f:
    try:
      weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
      raise hf_config.HfConfigError(f"{index}: not a JSON object ({e})") from e
  if not isinstance(weight_map, dict) or not all(
      isinstance(v, str) for v in weight_map.values()):
    raise hf_config.HfConfigError(
        f"{index}: weight_map must be an object of tensor name -> shard file")
  folder = os.path.dirname(index)
  return {name: os.path.join(folder, file) for name, file in weight_map.items()
          if name != "__metadata__"}


# safetensors dtype -> bytes per element, to check each tensor's byte range.
_ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _header(path: str) -> dict:
  """A shard's tensor entries (`dtype`, `shape`, `data_offsets`), each checked
  to lie inside the file: a truncated download fails here, naming the file
  and the first tensor it cut, instead of as a `struct.error` or an mmap error
  at the first read."""
  corrupt = f"{path}: looks truncated or corrupt"
  file_size = os.path.getsize(path)
  with open(path, "rb") as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise hf_config.HfConfigError(f"{corrupt}: {file_size} bytes, shorter than the 8-byte "
                                    "header length")
    (size,) = struct.unpack("<Q", prefix)
    if size > file_size - 8:
      raise hf_config.HfConfigError(f"{corrupt}: its header claims {size} bytes, the file "
                                    f"holds {file_size - 8} after the length")
    try:
      header = json.loads(f.read(size))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise hf_config.HfConfigError(f"{corrupt}: its header is not JSON ({e})") from e
  if not isinstance(header, dict):
    raise hf_config.HfConfigError(f"{corrupt}: its header is not a JSON object")
  header.pop("__metadata__", None)
  data_size = file_size - 8 - size
  for name, entry in header.items():
    try:
      begin, end = entry["data_offsets"]
      count = int(np.prod(entry["shape"], dtype=np.int64))
      itemsize = _ITEMSIZES.get(entry["dtype"])
      valid = (all(type(x) is int for x in (begin, end)) and 0 <= begin <= end
               and (itemsize is None or end - begin == count * itemsize))
    except (KeyError, TypeError, ValueError):
      valid = False
    if not valid:
      raise hf_config.HfConfigError(f"{corrupt}: tensor {name} has a malformed header entry "
                                    f"{entry}")
    if end > data_size:
      raise hf_config.HfConfigError(
          f"{corrupt}: tensor {name} needs bytes up to {end} of the data, the file holds "
          f"{data_size} (cut short?)")
  return header


def _read_raw(path: str, entry: dict, dtype) -> np.ndarray:
  with open(path, "rb") as f:
    (size,) = struct.unpack("<Q", f.read(8))
  begin, end = entry["data_offsets"]
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size + begin, shape=(end - begin,))
  return np.frombuffer(data, dtype=dtype).reshape(entry["shape"])


def load_params(folder: str, cfg: model_config_lib.ModelConfig, mesh: Mesh,
                rules: rules_lib.Rules, *, beside: tuple[str, ...] = ()):
  """`(graphdef, params)`: the folder's weights as an nnx.State laid out on
  `mesh` by `rules`, in `cfg.param_dtype`. A value head (not in Hugging Face
  checkpoints) keeps its zero initialisation. `beside`: tensors the caller
  reads itself (a reward model's `score.weight`), not the decoder's.

  Raises:
    FileNotFoundError: a missing shard or tensor.
    hf_config.HfConfigError: a tensor whose shape differs from `cfg`'s (named),
      one the table does not know (the model has parts this decoder lacks), a
      stored `lm_head.weight` unlike the embedding it is tied to, a truncated
      or corrupt shard, or an index that disagrees with its shards.
  """
  source = SafetensorsFolder(folder)
  table = param_table(cfg)
  known = {row.name for row in table.values()}
  if cfg.tie_embeddings:
    known.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    _check_tied_head(source)
  unknown = [n for n in source.names()
             if n not in known and n not in beside and not n.endswith(_IGNORED_SUFFIXES)]
  if unknown:
    raise hf_config.HfConfigError(
        f"{folder}: tensors this decoder has no place for: {unknown[:5]}"
        f"{' ...' if len(unknown) > 5 else ''} (another architecture?)")
  # Shapes and shardings only: nothing is initialised and then thrown away.
  graphdef, abstract = init_lib.abstract_model(cfg)
  shardings = rules_lib.state_shardings(abstract, mesh, rules)
  dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.float32

  def load(path, leaf, sharding):
    key = state_path(path)
    if key == ("value_head",):  # zero-initialised, as in the decoder
      return jax.device_put(np.zeros(leaf.shape, dtype), sharding)
    row = table[key]
    if row.name not in source.files:
      raise FileNotFoundError(f"{folder}: tensor {row.name} (for {'.'.join(map(str, key))}) "
                              "is in no safetensors shard")
    w = source.read(row.name)
    if tuple(w.shape) != row.hf_shape:
      raise hf_config.HfConfigError(
          f"{folder}: {row.name} has shape {tuple(w.shape)}; config.json implies {row.hf_shape}")
    if w.dtype not in _FLOAT_DTYPES:
      raise hf_config.HfConfigError(
          f"{folder}: {row.name} is stored as {w.dtype}; the decoder runs in float32 or "
          "bfloat16 and imports float weights only (quantised checkpoints are not supported)")
    # No conversion copy when the file already holds the param dtype (astype(copy=False)
    # and the layout changes are views): the placed copy is device_put's.
    value = LAYOUTS[row.layout][0](w, leaf.shape).astype(dtype, copy=False)
    return jax.device_put(value, sharding)

  params = jax.tree_util.tree_map_with_path(load, abstract, shardings)
  return graphdef, params


def _check_tied_head(source: SafetensorsFolder, rows_per_chunk: int = 4096):
  """A tied config whose files also hold an `lm_head.weight`: accepted only if
  that copy is the embedding. transformers unties the two when they differ
  and uses the stored head, so ignoring it would give other logits."""
  head, embed = "lm_head.weight", "model.embed_tokens.weight"
  if head not in source.files or embed not in source.files:
    return  # (no copy; a missing embedding is named where it is loaded)
  h, e = source.read(head), source.read(embed)
  same = h.shape == e.shape
  # In chunks of rows: a float32 copy of a whole 150k-token vocabulary is GBs.
  for start in range(0, e.shape[0] if same else 0, rows_per_chunk):
    rows = slice(start, start + rows_per_chunk)
    if not np.array_equal(h[rows].astype(np.float32), e[rows].astype(np.float32)):
      same = False
      break
  if not same:
    raise hf_config.HfConfigError(
        f"{source.files[head]}: holds {head} {tuple(h.shape)}, which differs from {embed} "
        f"{tuple(e.shape)}, but config.json has tie_word_embeddings=true (transformers would "
        "untie them and use the stored head); set tie_word_embeddings to false if the model "
        "has its own output layer")


# numpy dtype -> safetensors dtype name, for the dtypes an export writes.
EXPORT_DTYPES = {"float32": (np.dtype(np.float32), "F32"),
                 "bfloat16": (np.dtype(ml_dtypes.bfloat16), "BF16")}


def save_params(params, cfg: model_config_lib.ModelConfig, folder: str, family: str,
                base_config: dict | None = None, *, dtype: str = "float32",
                max_shard_bytes: int = 5 * 2**30) -> list[str]:
  """Writes `params` as a Hugging Face folder that `transformers` loads:
  safetensors in `dtype` (`float32` or `bfloat16`), split into shards of at
  most `max_shard_bytes` with a `model.safetensors.index.json` when one file
  would be larger, and `config.json` (`base_config` updated with `cfg`'s
  shapes and `dtype`). Streams: each parameter is gathered to the host,
  converted and written in turn (the file layout is known from the table
  first), so the host never holds more than one of them. Returns the files."""
  if dtype not in EXPORT_DTYPES:
    raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
  np_dtype, st_dtype = EXPORT_DTYPES[dtype]
  os.makedirs(folder, exist_ok=True)
  table = param_table(cfg)
  leaves = {state_path(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  rows = [(key, row) for key, row in table.items() if key in leaves]  # (value head: not HF)
  missing = sorted(".".join(map(str, k)) for k in table if k not in leaves)
  if missing:
    raise ValueError(f"params lack {missing[:5]} for a {family} export")
  nbytes = lambda row: int(np.prod(row.hf_shape)) * np_dtype.itemsize
  shards, size = [[]], 0
  for key, row in rows:
    if shards[-1] and size + nbytes(row) > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((key, row))
    size += nbytes(row)
  if len(shards) == 1:
    names = ["model.safetensors"]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {row.name: name for name, shard in zip(names, shards) for _, row in shard}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": sum(nbytes(r) for _, r in rows)},
                 "weight_map": weight_map}, f, indent=2)
  for name, shard in zip(names, shards):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _, row in shard:
      header[row.name] = {"dtype": st_dtype, "shape": list(row.hf_shape),
                          "data_offsets": [offset, offset + nbytes(row)]}
      offset += nbytes(row)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    with open(os.path.join(folder, name), "wb") as f:
      f.write(struct.pack("<Q", len(blob)) + blob)
      for key, row in shard:
        host = np.asarray(jax.device_get(leaves[key]), np.float32)
        out = LAYOUTS[row.layout][1](host, row.hf_shape).astype(np_dtype)
        f.write(np.ascontiguousarray(out).tobytes())
  base = dict(base_config or {})
  config = hf_config.hf_config_from_model(cfg, family, base)
  config["dtype"] = dtype
  with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return names
