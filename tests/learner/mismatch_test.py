"""Mismatch corrections of the off-policy weight pi_prox / mu: golden numbers
(hand-computed in the comments), their metrics, and their settings' checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from arl_jax.core import settings
from arl_jax.learner import loss_settings, losses, mismatch
from arl_jax.learner.objectives import clipped_ratio as clipped_ratio_lib

# log w = log pi_prox - log mu: w = 1.2214, 0.6065, 1 | 1.6487, 0.7408 (+ padding).
LOG_W = np.array([[0.2, -0.5, 0.0], [0.5, -0.3, np.nan]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
E = np.exp


def _weights(**fields):
  return mismatch.behaviour_weights(jnp.asarray(LOG_W), jnp.asarray(MASK),
                                    mismatch.Correction(**fields))


def test_no_correction_is_the_weight_itself():
  w, metrics = _weights()
  np.testing.assert_allclose(w, [[E(0.2), E(-0.5), 1.0], [E(0.5), E(-0.3), 0.0]], rtol=1e-6)
  assert set(metrics) == {"behaviour_weight_mean"}


def test_token_mask_drops_tokens_outside_the_band():
  # Band [0.7, 1.3]: 0.6065 and 1.6487 fall outside (2 of 5 trained tokens).
  w, metrics = _weights(mismatch_mask="token", mismatch_low=0.7, mismatch_high=1.3)
  np.testing.assert_allclose(w, [[E(0.2), 0.0, 1.0], [0.0, E(-0.3), 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["mismatch_masked_fraction"], 2 / 5)


def test_sequence_mask_drops_sequences_by_their_geometric_mean():
  # Geometric means: row 0 e^-0.1 = 0.905, row 1 e^0.1 = 1.105. Band [0.92, 1.2]
  # drops row 0 (3 of 5 tokens); row 1 keeps its token weights.
  w, metrics = _weights(mismatch_mask="sequence", mismatch_low=0.92, mismatch_high=1.2)
  np.testing.assert_allclose(w, [[0.0, 0.0, 0.0], [E(0.5), E(-0.3), 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["mismatch_masked_fraction"], 3 / 5)


def test_sequence_truncated_importance_sampling_weighs_a_sequence_by_its_product():
  # Products: row 0 e^-0.3 = 0.7408 (kept), row 1 e^0.2 = 1.2214 > 1.1 (cut to 1.1).
  w, metrics = _weights(seq_tis_cap=1.1)
  np.testing.assert_allclose(w, [[E(-0.3)] * 3, [1.1, 1.1, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["seq_tis_truncated_fraction"], 2 / 5)
  # A long sequence's product overflows float32 in linear space; not here.
  w, _ = mismatch.behaviour_weights(jnp.full((1, 400), 0.5), jnp.ones((1, 400)),
                                    mismatch.Correction(seq_tis_cap=2.0))
  np.testing.assert_allclose(w, 2.0)


def test_token_truncation_after_the_mask():
  w, metrics = _weights(tis_cap=1.1, mismatch_mask="token", mismatch_low=0.7,
                        mismatch_high=1.3)
  np.testing.assert_allclose(w, [[1.1, 0.0, 1.0], [0.0, E(-0.3), 0.0]], rtol=1e-6)
  # Of the 3 tokens the mask kept (1.2214, 1, 0.7408) one is truncated; the
  # masked 1.6487 trains nothing, so it is no truncated token.
  np.testing.assert_allclose(metrics["tis_truncated_fraction"], 1 / 3)
  np.testing.assert_allclose(metrics["mismatch_masked_fraction"], 2 / 5)


def test_sequence_truncation_counts_only_the_sequences_the_mask_kept():
  # Band [0.92, 1.2] masks row 0 (geometric mean 0.905); its product 0.7408 is
  # under the cap anyway. Row 1's product 1.2214 > 1.1: both its tokens, of
  # the 2 kept, are truncated (the 3 masked ones are not counted).
  w, metrics = _weights(seq_tis_cap=1.1, mismatch_mask="sequence", mismatch_low=0.92,
                        mismatch_high=1.2)
  np.testing.assert_allclose(w, [[0.0] * 3, [1.1, 1.1, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(metrics["seq_tis_truncated_fraction"], 1.0)  # (not 2 / 5)


def test_a_masked_token_trains_nothing_but_keeps_its_place_in_the_mean():
  logp = np.zeros((2, 3), np.float32)
  proximal = np.zeros((2, 3), np.float32)  # r = 1: the loss is -w A
  behaviour = -np.nan_to_num(LOG_W)
  adv = np.ones((2, 3), np.float32)
  correction = mismatch.Correction(mismatch_mask="token", mismatch_low=0.7, mismatch_high=1.3)
  per_token, _ = clipped_ratio_lib.clipped_ratio(logp, behaviour, adv, MASK, proximal_logprobs=proximal,
                                      correction=correction)
  weights = losses.token_weights(jnp.asarray(MASK), "token_mean")
  # Kept: e^0.2, 1, e^-0.3 over all 5 trained tokens, not over the 3 kept.
  np.testing.assert_allclose(jnp.sum(weights * per_token), -(E(0.2) + 1 + E(-0.3)) / 5,
                             rtol=1e-6)


def test_a_correction_needs_the_proximal_policy():
  with pytest.raises(ValueError, match="needs proximal_logprobs"):
    clipped_ratio_lib.clipped_ratio(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32),
                         np.ones((1, 2), np.float32), np.ones((1, 2), np.float32),
                         correction=mismatch.Correction(tis_cap=2.0))


@pytest.mark.parametrize("fields,message", [
    (dict(tis_cap=0.5), "tis_cap: must be 0 \\(off\\) or >= 1"),
    (dict(seq_tis_cap=0.9), "seq_tis_cap: must be 0 \\(off\\) or >= 1"),
    (dict(tis_cap=2.0, seq_tis_cap=2.0), "seq_tis_cap: is a second truncation"),
    (dict(mismatch_mask="row"), "mismatch_mask: must be one of"),
    (dict(mismatch_low=1.2), "mismatch_low: the band must hold 1"),
    (dict(mismatch_high=0.9), "mismatch_low: the band must hold 1"),
])
def test_bad_settings_are_named(fields, message):
  with pytest.raises(settings.SettingError, match=message):
    mismatch.Correction(**fields)


def test_a_correction_makes_the_objective_decoupled_and_is_refused_by_vtrace():
  assert not loss_settings.LossSettings.of().is_decoupled
  for fields in (dict(tis_cap=2.0), dict(seq_tis_cap=3.0), dict(mismatch_mask="sequence")):
    assert loss_settings.LossSettings.of(**fields).is_decoupled
    with pytest.raises(ValueError, match="neither a decoupled objective nor a mismatch"):
      loss_settings.LossSettings.of(loss="vtrace", **fields)
