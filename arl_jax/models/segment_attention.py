"""Training attention over rows of segments, a block of queries at a time.

The learner's rows hold one rollout (padded) or several (packed): a token
attends to the earlier tokens of its own segment only. Materialising the
scores of a whole row takes `heads x T x T` float32 per row and layer, kept
for the backward pass: ~10 GiB for one 16k-token row of a 10-head layer. With
`chunk` set the queries are taken `chunk` at a time (a `lax.map` whose body
is rematerialised on the backward pass), so at most `heads x chunk x T`
scores exist at once; the mask of each block is built from the segment ids,
never `[T, T]`. Every query's computation is the same as over the whole row
(float32 scores and softmax, the same mask value), so the results agree to
float rounding (<= 1e-6, `tests/models/segment_attention_test.py`).

This is the XLA path, for every platform; it still computes every pair of a
row's columns (masked), so a row costs `T^2` whatever its segments. On TPU,
`kernel="splash"` runs JAX's Pallas splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) with the rows' segment
ids: a fused flash-style kernel that never materialises the scores and skips
the blocks its causal mask rules out. On GPU, `kernel="pallas_gpu"` runs
JAX's Pallas (Triton) flash attention (`jax.experimental.pallas.ops.gpu.
attention.mha`, segment ids, causal). `"splash_interpret"` and
`"pallas_gpu_interpret"` run the same kernels in Pallas interpret mode
anywhere (slowly): that is how their values and gradients are tested against
the XLA path on CPU. Rows are padded to a multiple of 128 columns for them
(padding is segment 0). Not wired: cuDNN attention (`jax.nn.
dot_product_attention` takes no segment ids, only a `[T, T]` mask). XLA
cannot partition a Mosaic or Triton call, so under a sharded learner mesh
the kernels run per device in a `shard_map` (rows over `fsdp`, key/value
heads over `tp`; attention is independent per row and head). On one H200
(`benchmarks/attention_kernels.py`) the GPU kernel ran 2.2-4.1x the XLA path
forward and backward in bfloat16 and 1.4-1.6x in float32, where its dots round as
TF32 does (errors ~1e-3 against the XLA path's float32). The splash kernel's
speed is not measured (no TPU was lent).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

# As the decoder's: a query whose keys are all masked (padding) gets a uniform
# softmax instead of NaN, and its output is ignored.
MASK_VALUE = -1e30

# How the attention of training rows is computed (`learner.attention`).
KERNELS = ("xla", "splash", "splash_interpret", "pallas_gpu", "pallas_gpu_interpret")


@flax.struct.dataclass
class Segments:
  """The attention of training rows, in place of a `[B, T, T]` mask.

  Attributes:
    ids: `[B, T]` int32, 0 on padding, k on a row's k-th sequence.
    chunk: static, queries per block of the XLA path (0: the whole row).
    kernel: static, one of `KERNELS`.
    mesh: static, the mesh the rows are sharded on (the learner's), or None:
      a kernel then runs on each device's rows and heads (`_per_shard`).
  """

  ids: jax.Array
  chunk: int = flax.struct.field(pytree_node=False, default=0)
  kernel: str = flax.struct.field(pytree_node=False, default="xla")
  mesh: jax.sharding.Mesh | None = flax.struct.field(pytree_node=False, default=None)


def attend(q, k, v, segments: Segments):
  """Causal attention within segments.

  Args:
    q: `[B, T, H, Dh]` queries (RoPE applied, not yet scaled).
    k, v: `[B, K, T, Dh]` keys and values (K divides H).
    segments: the rows' segments.

  Returns:
    `[B, T, H, Dh]` float32.
  """
  b, t, h, dh = q.shape
  kv_heads = k.shape[1]
  q = q.reshape(b, t, kv_heads, h // kv_heads, dh).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,Dh]
  if segments.kernel not in KERNELS:
    raise ValueError(f"attention kernel must be one of {KERNELS}, got {segments.kernel!r}")
  if segments.kernel != "xla":
    kernel = _splash if segments.kernel.startswith("splash") else _pallas_gpu
    kernel = functools.partial(kernel, interpret=segments.kernel.endswith("_interpret"))
    if segments.mesh is not None and segments.mesh.size > 1:
      kernel = _per_shard(kernel, segments.mesh, b, kv_heads)
    out = kernel(q, k, v, segments.ids)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)
  k, v = k.astype(jnp.float32), v.astype(jnp.float32)
  ids = segments.ids
  key_ids = ids[:, None, :]  # [B, 1, T]
  key_cols = jnp.arange(t)

  def block(q_block, q_ids, q_cols):
    """Queries `[B, K, G, C, Dh]` at columns `q_cols` `[C]` with ids `[B, C]`."""
    scores = jnp.einsum("bkgcd,bksd->bkgcs", q_block.astype(jnp.float32), k) / math.sqrt(dh)
    mask = ((q_cols[:, None] >= key_cols[None, :])[None] & (q_ids[:, :, None] == key_ids)
            & (key_ids > 0))  # [B, C, T]
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    return jnp.einsum("bkgcs,bksd->bkgcd", jax.nn.softmax(scores, axis=-1), v)

  chunk = segments.chunk
  if not chunk or chunk >= t:
    out = block(q, ids, key_cols)
  else:
    pad = -t % chunk
    n = (t + pad) // chunk
    q_blocks = jnp.pad(q, ((0, 0),) * 3 + ((0, pad), (0, 0)))
    q_blocks = jnp.moveaxis(q_blocks.reshape(b, kv_heads, -1, n, chunk, dh), 3, 0)
    id_blocks = jnp.moveaxis(jnp.pad(ids, ((0, 0), (0, pad))).reshape(b, n, chunk), 1, 0)
    col_blocks = jnp.arange(t + pad).reshape(n, chunk)
    outs = jax.lax.map(lambda xs: jax.checkpoint(block)(*xs), (q_blocks, id_blocks, col_blocks))
    out = jnp.moveaxis(outs, 0, 3).reshape(b, kv_heads, -1, t + pad, dh)[:, :, :, :t]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)


@functools.cache
def _splash_kernel(length: int, group: int, interpret: bool):
  """The splash MQA kernel for rows of `length` (a multiple of 128) and
  `group` query heads per key/value head: causal, segments by id."""
  block = next(n for n in (512, 256, 128) if length % n == 0)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block,
                            block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length))] * group)
  # Built eagerly, whatever trace asks first: the kernel holds the mask's
  # block tables as arrays, and a cached kernel built inside one trace would
  # leak its tracers into the next (each scan or map body is a trace).
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def _splash(q, k, v, ids, *, interpret: bool):
  """Splash attention of `q` `[B, K, G, T, Dh]` over `k`, `v` `[B, K, T, Dh]`:
  `[B, K, G, T, Dh]` float32. Each key/value head with its query heads is one
  MQA call; rows are padded to a multiple of 128 columns (segment 0)."""
  b, kv_heads, group, t, dh = q.shape
  pad = -t % 128
  columns = lambda x, axis: jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])
  q = columns(q / math.sqrt(dh), 3)
  k, v, ids = columns(k, 2), columns(v, 2), columns(ids, 1)
  kernel = _splash_kernel(t + pad, group, interpret)

  def row(q_row, k_row, v_row, ids_row):  # [K, G, T, Dh], [K, T, Dh], [K, T, Dh], [T]
    segment_ids = splash.SegmentIds(q=ids_row, kv=ids_row)
    return jax.vmap(lambda qg, kg, vg: kernel(qg, kg, vg, segment_ids=segment_ids))(
        q_row, k_row, v_row)

  out = jax.vmap(row)(q, k, v, ids)
  return out[:, :, :, :t].astype(jnp.float32)


def _per_shard(kernel, mesh: jax.sharding.Mesh, rows: int, kv_heads: int):
  """`kernel(q, k, v, ids)` run on each device's rows (over `fsdp`, the
  learner's data axis) and key/value heads (over `tp`, as the attention
  weights that make them). An axis that does not divide its dimension stays
  whole (its shards then compute the same values)."""
  def axis(name, size):
    n = dict(mesh.shape).get(name, 1)
    return name if n > 1 and size % n == 0 else None
  row, head = axis("fsdp", rows), axis("tp", kv_heads)
  heads, ids = P(row, head), P(row)
  return jax.shard_map(kernel, mesh=mesh, in_specs=(heads, heads, heads, ids), out_specs=heads,
                       check_vma=False)


# A GPU block's shared memory (232,448 bytes on an H200) holds the forward
# kernel's pipelined key and value tiles: 2 stages x 2 x block_k x head_dim.
# In float32 at head_dim 128 JAX's default 128-column tile asks 262,656 bytes
# and fails to compile ("Shared memory size limit exceeded", measured on an
# H200 with jax 0.11.2, `benchmarks/attention_kernels.py`), so the tile is
# halved until the tiles fit in this budget (headroom for the other buffers).
GPU_TILE_BUDGET_BYTES = 192 * 1024
_GPU_STAGES = 2  # the kernel's default num_stages


def gpu_block_sizes(head_dim: int, itemsize: int):
  """The GPU flash kernel's tiles for a head width and dtype size: JAX's
  defaults, with the forward key/value tile narrowed (to no less than 16
  columns) until `GPU_TILE_BUDGET_BYTES` holds its pipelined copies."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # noqa: PLC0415
  padded = 1 << max(head_dim - 1, 0).bit_length()  # (the kernel pads the head to a power of 2)
  block_k = 128
  while block_k > 16 and _GPU_STAGES * 2 * block_k * padded * itemsize > GPU_TILE_BUDGET_BYTES:
    block_k //= 2
  return dataclasses.replace(gpu_attention.BlockSizes.get_default(), block_k=block_k)


def _pallas_gpu(q, k, v, ids, *, interpret: bool):
  """Pallas GPU flash attention of `q` `[B, K, G, T, Dh]` over `k`, `v`
  `[B, K, T, Dh]`: `[B, K, G, T, Dh]` float32. The kernel is multi-head only,
  so each key/value head is repeated for its `G` query heads (the gradient
  sums over the copies); rows are padded to a multiple of 128 columns."""
  from jax.experimental.pallas.ops.gpu import attention as gpu_attention  # noqa: PLC0415
  b, kv_heads, group, t, dh = q.shape
  pad = -t % 128
  q = q.reshape(b, kv_heads * group, t, dh).transpose(0, 2, 1, 3)  # [B, T, H, Dh]
  k, v = (jnp.repeat(x, group, axis=1).transpose(0, 2, 1, 3) for x in (k, v))
  q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
  out = gpu_attention.mha(q, k, v, jnp.pad(ids, ((0, 0), (0, pad))), sm_scale=1 / math.sqrt(dh),
                          causal=True, interpret=interpret,
                          block_sizes=gpu_block_sizes(dh, q.dtype.itemsize))
  return out[:, :t].transpose(0, 2, 1, 3).reshape(b, kv_heads, group, t, dh).astype(jnp.float32)
