"""Training attention by blocks of queries (`segment_attention.py`), the
decoder's remat policies and its scan over layers: the same values and
gradients as the whole-row attention under `decoder.segment_mask`, and less
memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arl_jax.models import decoder as decoder_lib
from arl_jax.models import model_config as model_config_lib
from arl_jax.models import segment_attention as segment_attention_lib


def _model(**overrides):
  cfg = model_config_lib.ModelConfig(**{
      **dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
             head_dim=8, mlp_dim=64, max_seq_len=256), **overrides})
  model = decoder_lib.Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def _rows(length=37):
  """Two rows: three segments then padding, and one left-padded segment."""
  ids = np.zeros((2, length), np.int32)
  ids[0, :10], ids[0, 10:11], ids[0, 11:30] = 1, 2, 3
  ids[1, 5:] = 1
  positions = np.zeros_like(ids)
  for r in range(2):
    for k in range(1, ids[r].max() + 1):
      cols = np.flatnonzero(ids[r] == k)
      positions[r, cols] = np.arange(len(cols))
  tokens = np.random.default_rng(0).integers(0, 64, ids.shape).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(ids), jnp.asarray(positions)


def _objective(graphdef, params, attn_mask, remat="none", scan_layers=False):
  tokens, ids, positions = _rows()
  logits, _ = nnx.merge(graphdef, params)(tokens, positions, attn_mask, remat=remat,
                                          scan_layers=scan_layers)
  # Padding queries attend to nothing: their outputs are ignored.
  return jnp.sum(jnp.where((ids > 0)[..., None], jnp.tanh(logits), 0.0)), logits


def _assert_same(ids, want, got):
  """`(objective, logits, gradients)` of two attentions agree on real tokens."""
  (want, want_logits, want_grads), (got, got_logits, got_grads) = want, got
  on = np.asarray(ids) > 0
  np.testing.assert_allclose(np.asarray(got_logits)[on], np.asarray(want_logits)[on],
                             atol=1e-5)
  # A sum over ~4,700 tokens: float32 rounding in another order (~1e-6).
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # Gradients up to ~35 in size: float32 rounding of sums in another order.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4), want_grads,
               got_grads)


@pytest.mark.parametrize("chunk", [0, 8, 13, 64])
def test_blocks_of_queries_equal_the_whole_row(chunk):
  graphdef, params = _model()
  _, ids, _ = _rows()
  mask = decoder_lib.segment_mask(ids)
  segments = segment_attention_lib.Segments(ids, chunk)
  grad = jax.value_and_grad(lambda p, m: _objective(graphdef, p, m), has_aux=True)
  (want, want_logits), want_grads = grad(params, mask)
  (got, got_logits), got_grads = jax.jit(grad)(params, segments)
  _assert_same(ids, (want, want_logits, want_grads), (got, got_logits, got_grads))


@pytest.mark.parametrize("kernel", ["splash_interpret", "pallas_gpu_interpret"])
def test_the_tpu_and_gpu_kernels_in_interpret_mode_equal_the_xla_path(kernel):
  """JAX's TPU splash attention and GPU flash attention with the rows'
  segment ids (Pallas interpret mode on CPU; rows padded to 128 columns
  inside; GQA heads repeated for the GPU kernel): values and gradients."""
  graphdef, params = _model()
  _, ids, _ = _rows()
  grad = jax.value_and_grad(lambda p, m: _objective(graphdef, p, m), has_aux=True)
  (want, want_logits), want_grads = jax.jit(grad)(params, segment_attention_lib.Segments(ids))
  (got, got_logits), got_grads = jax.jit(grad)(
      params, segment_attention_lib.Segments(ids, kernel=kernel))
  _assert_same(ids, (want, want_logits, want_grads), (got, got_logits, got_grads))


def test_the_gpu_kernels_tiles_fit_its_shared_memory():
  """The forward tile narrows where JAX's default asked more shared memory
  than an H200 block has (float32, head_dim 128: 262,656 > 232,448 bytes,
  measured) and stays the default where the default compiled there."""
  sizes = segment_attention_lib.gpu_block_sizes
  assert sizes(64, 4).block_k == sizes(128, 2).block_k == 128  # (compiled on the H200)
  assert sizes(128, 4).block_k == 64 and sizes(256, 4).block_k == 32
  for head_dim in (16, 64, 80, 128, 256):
    for itemsize in (2, 4):
      tiles = 2 * 2 * sizes(head_dim, itemsize).block_k * head_dim * itemsize
      assert tiles <= segment_attention_lib.GPU_TILE_BUDGET_BYTES


def test_the_gpu_kernel_with_a_narrowed_tile_equals_the_xla_path():
  """float32 at head_dim 128 (key tiles of 64 columns), interpret mode:
  values and gradients as the XLA path over packed rows."""
  rng = np.random.default_rng(0)
  ids = np.zeros((1, 150), np.int32)
  ids[0, :70], ids[0, 70:140] = 1, 2
  q = jnp.asarray(rng.normal(size=(1, 150, 2, 128)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 1, 150, 128)), jnp.float32) for _ in range(2))
  live = jnp.asarray(ids > 0)[:, :, None, None]

  def loss_and_out(kernel, q, k, v):
    out = segment_attention_lib.attend(
        q, k, v, segment_attention_lib.Segments(jnp.asarray(ids), kernel=kernel))
    return jnp.sum(jnp.where(live, jnp.tanh(out), 0.0)), out

  want = jax.value_and_grad(lambda *a: loss_and_out("xla", *a), argnums=(0, 1, 2),
                            has_aux=True)(q, k, v)
  got = jax.value_and_grad(lambda *a: loss_and_out("pallas_gpu_interpret", *a),
                           argnums=(0, 1, 2), has_aux=True)(q, k, v)
  on = ids > 0
  np.testing.assert_allclose(np.asarray(got[0][1])[on], np.asarray(want[0][1])[on], atol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, atol=1e-4)


def test_the_accelerator_kernels_need_their_platform():
  from arl_jax.config import run_spec
  from arl_jax.testing import tiny
  config = tiny.load_config()
  config.learner.attention = "splash"
  with pytest.raises(run_spec.ConfigError, match="learner.attention: 'splash' is the TPU"):
    run_spec.build(config)
  config.learner.attention = "pallas_gpu"
  with pytest.raises(run_spec.ConfigError, match="learner.attention: 'pallas_gpu' is the GPU"):
    run_spec.build(config)
  config.learner.attention = "auto"  # the platform's kernel: XLA's on CPU
  assert run_spec.build(config).loss.scoring.attention == "xla"
  config.learner.attention = "flash"
  with pytest.raises(run_spec.ConfigError, match="learner.attention: must be one of"):
    run_spec.build(config)


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_policies_change_no_gradient(remat):
  graphdef, params = _model()
  _, ids, _ = _rows()
  segments = segment_attention_lib.Segments(ids, 8)
  grad = lambda r: jax.jit(jax.grad(lambda p: _objective(graphdef, p, segments, r)[0]))(params)
  want = grad("none")
  # To float32 rounding of the largest entry (~250 here): a rematerialised
  # program may fuse, so round, differently (with the tests' XLA flags it
  # does, by ~3 ulp of 250); a wrong gradient is off by far more.
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * scale), want,
               grad(remat))
  with pytest.raises(ValueError, match="remat must be one of"):
    _objective(graphdef, params, segments, "all")


def _scratch_mib(chunk, remat, length=2048, num_layers=2, scan_layers=False):
  """XLA's planned temporary MiB for the gradient over one row of `length`."""
  graphdef, params = _model(num_heads=8, num_kv_heads=8, max_seq_len=length,
                            num_layers=num_layers)
  ids = jnp.ones((1, length), jnp.int32)
  tokens = jnp.zeros((1, length), jnp.int32)
  positions = jnp.arange(length)[None]

  def objective(p):
    logits, _ = nnx.merge(graphdef, p)(tokens, positions,
                                       segment_attention_lib.Segments(ids, chunk), remat=remat,
                                       scan_layers=scan_layers)
    return jnp.sum(logits)

  compiled = jax.jit(jax.grad(objective)).lower(params).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_blocks_and_remat_bound_the_scores_kept_for_the_backward_pass():
  """Whole-row scores of 8 heads over 2,048 tokens are 128 MiB a layer, kept
  for the backward pass; blocks of 256 queries keep an eighth of that."""
  whole = _scratch_mib(0, "none")
  blocks = _scratch_mib(256, "block")
  assert whole > 2 * 128  # two layers' scores
  assert blocks < whole / 4, (whole, blocks)


@pytest.mark.parametrize("remat", ["none", "block"])
def test_a_scan_over_layers_changes_no_value_or_gradient(remat):
  graphdef, params = _model(num_layers=3)
  _, ids, _ = _rows()
  segments = segment_attention_lib.Segments(ids, 8)

  def run(scan_layers):
    objective = lambda p: _objective(graphdef, p, segments, remat, scan_layers)
    (value, logits), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params)
    return value, logits, grads

  _assert_same(ids, run(False), run(True))


def test_a_scan_over_layers_plans_a_blocks_scratch_once():
  """Unrolled, XLA:CPU plans each layer's backward scratch apart (it grows
  with the layers); one scan body's exists once."""
  unrolled = {n: _scratch_mib(256, "block", num_layers=n) for n in (2, 8)}
  scanned = {n: _scratch_mib(256, "block", num_layers=n, scan_layers=True) for n in (2, 8)}
  assert unrolled[8] - unrolled[2] > 20, unrolled
  assert scanned[8] - scanned[2] < 5, scanned
