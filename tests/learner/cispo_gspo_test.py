"""CISPO, GSPO and GSPO-token against their formulas on hand-sized inputs
(hand-computed in the comments), where they differ from the clipped ratio,
and every loss equal on padded and packed rows."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.learner import loss_registry, losses, mismatch
from arl_jax.learner.objectives import cispo as cispo_lib
from arl_jax.learner.objectives import clipped_ratio as clipped_ratio_lib
from arl_jax.learner.objectives import gspo as gspo_lib

LOGP = np.array([[-1.0, -2.0, -0.5], [-0.5, -1.3, -9.0]], np.float32)
BEHAVIOUR = np.array([[-1.2, -1.5, -0.5], [-1.0, -1.0, -1.0]], np.float32)
ADV = np.array([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)  # the last token is padding
# log r = 0.2, -0.5, 0 | 0.5, -0.3; r = 1.2214, 0.6065, 1 | 1.6487, 0.7408.


def _grad(fn, logp=LOGP, adv=ADV, aggregation="token_mean", **knobs):
  weights = losses.token_weights(jnp.asarray(MASK), aggregation)

  def total(lp):
    return jnp.sum(weights * fn(lp, BEHAVIOUR, adv, MASK, **knobs)[0])
  return np.asarray(jax.grad(total)(jnp.asarray(logp)))


@pytest.mark.parametrize("jit", [False, True])
def test_cispo_golden(jit):
  # Weights clip(r, 0.8, 1.2) = 1.2, 0.8, 1 | 1.2, 0.8; loss -weight * A * logp:
  #   row 0 (A=2):  2.4, 3.2, 1.0;  row 1 (A=-1): -0.6, -1.04.
  fn = functools.partial(cispo_lib.cispo, eps_low=0.2, eps_high=0.2)
  per_token, metrics = (jax.jit(fn) if jit else fn)(LOGP, BEHAVIOUR, ADV, MASK)
  np.testing.assert_allclose(per_token, [[2.4, 3.2, 1.0], [-0.6, -1.04, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["clip_fraction"], 4 / 5, rtol=1e-6)


def test_cispo_weight_is_stop_gradient_and_keeps_clipped_tokens_training():
  # d loss_t / d logp_t = -clip(r_t) A_t exactly: the weight carries no gradient.
  grad = _grad(cispo_lib.cispo, aggregation="token_mean", eps_low=0.2, eps_high=0.2)
  expected = -np.array([[1.2, 0.8, 1.0], [1.2, 0.8, 0.0]]) * ADV * MASK / 5
  np.testing.assert_allclose(grad, expected, rtol=1e-6)
  # The clipped ratio zeroes token (0, 0) (r = 1.2214 > 1.2 with A > 0) and
  # token (1, 1) (r = 0.7408 < 0.8 with A < 0); CISPO still trains them.
  ppo = _grad(clipped_ratio_lib.clipped_ratio)
  assert ppo[0, 0] == 0 and ppo[1, 1] == 0
  assert grad[0, 0] < 0 and grad[1, 1] > 0
  # The default floor is 0 (eps_low = 1): a small ratio is not raised.
  per_token, _ = cispo_lib.cispo(LOGP, BEHAVIOUR, ADV, MASK)
  np.testing.assert_allclose(per_token[0, 1], -np.exp(-0.5) * 2 * -2.0, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_gspo_golden(jit):
  # Sequence ratios: s0 = exp(mean(0.2, -0.5, 0)) = e^-0.1 = 0.9048374,
  # s1 = exp(mean(0.5, -0.3)) = e^0.1 = 1.1051709. Inside (0.8, 1.2):
  #   row 0: -s0 A = -1.8096748 on each token; row 1: -s1 A = 1.1051709.
  fn = functools.partial(gspo_lib.gspo, eps_low=0.2, eps_high=0.2)
  per_token, metrics = (jax.jit(fn) if jit else fn)(LOGP, BEHAVIOUR, ADV, MASK)
  np.testing.assert_allclose(per_token, [[-1.8096748] * 3, [1.1051709, 1.1051709, 0.0]],
                             rtol=1e-6)
  assert float(metrics["clip_fraction"]) == 0.0
  # Advantages flipped and a range of 0.05: both sequences clipped, each at its
  # bound: row 0 (A=-2): -min(-2 s0, -2 * 0.95) = 1.9; row 1 (A=1): -1.05.
  flipped = -ADV / np.array([[1.0], [1.0]], np.float32)
  per_token, metrics = gspo_lib.gspo(LOGP, BEHAVIOUR, flipped, MASK, eps_low=0.05, eps_high=0.05)
  np.testing.assert_allclose(per_token, [[1.9] * 3, [-1.05, -1.05, 0.0]], rtol=1e-6)
  assert float(metrics["clip_fraction"]) == 1.0
  np.testing.assert_array_equal(
      _grad(gspo_lib.gspo, adv=flipped, eps_low=0.05, eps_high=0.05), np.zeros((2, 3)))


def test_gspo_gradient_is_the_sequence_ratio_over_the_length():
  # seq_mean_token_mean: loss = (L0 + L1) / 2 with L0 = -2 s0, L1 = s1, and
  # d s_i / d logp_t = s_i / |y_i|: row 0 -s0 / 3 per token, row 1 s1 / 4.
  s0, s1 = np.exp(-0.1), np.exp(0.1)
  grad = _grad(gspo_lib.gspo, aggregation="seq_mean_token_mean", eps_low=0.2, eps_high=0.2)
  np.testing.assert_allclose(grad, [[-s0 / 3] * 3, [s1 / 4, s1 / 4, 0.0]], rtol=1e-6)
  # Where the clipped ratio differs: it zeroes token (0, 0) (r = 1.2214 > 1.2,
  # A > 0); GSPO clips the sequence (0.905, inside) and trains every token.
  assert _grad(clipped_ratio_lib.clipped_ratio, aggregation="seq_mean_token_mean")[0, 0] == 0


def test_gspo_token_equals_gspo_with_sequence_advantages_and_reads_token_advantages():
  knobs = dict(eps_low=0.2, eps_high=0.2)
  for fn_knobs in (knobs, dict(eps_low=0.05, eps_high=0.05)):
    a, _ = gspo_lib.gspo(LOGP, BEHAVIOUR, ADV, MASK, **fn_knobs)
    b, _ = gspo_lib.gspo_token(LOGP, BEHAVIOUR, ADV, MASK, **fn_knobs)
    np.testing.assert_allclose(b, a, rtol=1e-6)
    np.testing.assert_allclose(_grad(gspo_lib.gspo_token, aggregation="seq_mean_token_mean",
                                     **fn_knobs),
                               _grad(gspo_lib.gspo, aggregation="seq_mean_token_mean", **fn_knobs),
                               rtol=1e-6)
  # Per-token advantages: the gradient at token t is -s_i A_t (times its weight).
  adv = np.array([[1.0, -1.0, 3.0], [2.0, 0.5, 0.0]], np.float32)
  s = np.exp(np.array([[-0.1] * 3, [0.1] * 3]))
  grad = _grad(gspo_lib.gspo_token, adv=adv, aggregation="token_mean", eps_low=0.5, eps_high=0.5)
  np.testing.assert_allclose(grad, -s * adv * MASK / 5, rtol=1e-6)


def test_gspo_token_equals_gspo_only_where_the_off_policy_weight_is_constant_per_sequence():
  """Decoupled, each token carries w_t = pi_prox / mu. GSPO's gradient spreads
  the sequence's summed weight over all its tokens (sum_t w_t * mean_t' g_t'),
  GSPO-token gives each token its own (sum_t w_t g_t): equal only when w is
  constant within each sequence (coupled: w = 1; or `seq_tis_cap`, one weight a
  sequence). Wide ranges so nothing clips."""
  proximal = LOGP - np.array([[0.0, 0.3, -0.2], [0.1, -0.4, 0.0]], np.float32)
  knobs = dict(eps_low=0.9, eps_high=9.0, proximal_logprobs=proximal)
  varying = [_grad(fn, aggregation="seq_mean_token_mean", **knobs)
             for fn in (gspo_lib.gspo, gspo_lib.gspo_token)]
  assert np.max(np.abs(varying[0] - varying[1])) > 0.05 * np.max(np.abs(varying[0]))
  per_sequence = mismatch.Correction(seq_tis_cap=10.0)
  same = [_grad(fn, aggregation="seq_mean_token_mean", correction=per_sequence, **knobs)
          for fn in (gspo_lib.gspo, gspo_lib.gspo_token)]
  np.testing.assert_allclose(same[1], same[0], rtol=1e-5, atol=1e-7)


# Two rollouts: A with 2 prompt + 3 completion tokens, B with 1 + 2. Padded:
# a row each (width 6); packed: one row (A's 5 tokens, then B's 3).
_PADDED_SEGMENTS = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], np.int32)
_PACKED_SEGMENTS = np.array([[1, 1, 1, 1, 1, 2, 2, 2]], np.int32)
_PADDED_MASK = np.array([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], np.float32)
_PACKED_MASK = np.array([[0, 0, 1, 1, 1, 0, 1, 1]], np.float32)


def _pack(padded):
  """The packed row of a padded `[2, 6]` array."""
  return np.concatenate([padded[0, :5], padded[1, :3]])[None]


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
@pytest.mark.parametrize("name,knobs", [
    ("clipped_ratio", {}),
    ("vtrace", dict(rho_bar=1.1)),
    ("m2po", dict(tau=0.05)),
    ("cispo", dict(eps_low=0.1, eps_high=0.1)),
    ("gspo", dict(eps_low=0.02, eps_high=0.02)),
    ("gspo_token", dict(eps_low=0.02, eps_high=0.02)),
    ("clipped_ratio", dict(proximal=True, correction=mismatch.Correction(
        seq_tis_cap=1.05, mismatch_mask="sequence", mismatch_low=0.8, mismatch_high=1.1))),
    ("gspo", dict(proximal=True, correction=mismatch.Correction(
        tis_cap=1.05, mismatch_mask="token", mismatch_low=0.7, mismatch_high=1.45))),
])
def test_every_loss_is_equal_on_padded_and_packed_rows(name, knobs, aggregation):
  rng = np.random.default_rng(7)
  logp = rng.uniform(-2, -0.1, (2, 6)).astype(np.float32)
  arrays = {"behaviour": logp + rng.normal(0, 0.3, (2, 6)).astype(np.float32),
            "proximal": logp + rng.normal(0, 0.1, (2, 6)).astype(np.float32),
            "adv": np.array([[1.5] * 6, [-0.5] * 6], np.float32)}
  knobs = dict(knobs)
  with_proximal = knobs.pop("proximal", False)

  def total(lp, a, mask, segments):
    weights = losses.token_weights(jnp.asarray(mask), aggregation, 4.0, segments)
    per_token, metrics = loss_registry.LOSSES[name].fn(
        lp, a["behaviour"], a["adv"], mask, segment_ids=segments,
        proximal_logprobs=a["proximal"] if with_proximal else None, **knobs)
    return jnp.sum(weights * per_token), metrics

  padded = jax.value_and_grad(total, has_aux=True)(
      jnp.asarray(logp), arrays, _PADDED_MASK, _PADDED_SEGMENTS)
  packed = jax.value_and_grad(total, has_aux=True)(
      jnp.asarray(_pack(logp)), {k: _pack(v) for k, v in arrays.items()}, _PACKED_MASK,
      _PACKED_SEGMENTS)
  (loss, metrics), grad = padded
  (packed_loss, packed_metrics), packed_grad = packed
  assert float(loss) != 0.0
  np.testing.assert_allclose(packed_loss, loss, rtol=1e-6)
  np.testing.assert_allclose(packed_grad, _pack(np.asarray(grad)), rtol=1e-6, atol=1e-8)
  for key in metrics:
    np.testing.assert_allclose(packed_metrics[key], metrics[key], rtol=1e-6, err_msg=key)
