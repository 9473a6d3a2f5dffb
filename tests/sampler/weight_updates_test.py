"""The weight-update policies: when a new version goes live, which params
decode which slots, when admission waits, which versions are held."""

import pytest

from arl_jax.sampler import engine_config, weight_updates

Swap = weight_updates.Swap


@pytest.mark.parametrize("kv_policy, busy, want", [
    ("keep", True, Swap.NOW), ("keep", False, Swap.NOW),
    ("recompute", True, Swap.RECOMPUTE), ("recompute", False, Swap.NOW),
])
def test_in_flight_swaps_at_once_and_recomputes_only_active_caches(kv_policy, busy, want):
  policy = weight_updates.make_policy("in_flight", kv_policy)
  assert policy.on_publish(0, "p0", busy=False) is Swap.NOW
  assert policy.on_publish(1, "p1", busy=busy) is want
  assert policy.params(1) == "p1"
  # Only the newest version is held; every slot decodes with it.
  assert policy.retain({0, 1}) == 1
  assert policy.decode_versions([0, 0, 1], live=1) == [1]
  assert not policy.admission_paused


def test_pinned_holds_each_version_a_slot_started_on_until_it_is_unused():
  policy = weight_updates.make_policy("pinned")
  for version in range(3):
    assert policy.on_publish(version, f"p{version}", busy=True) is Swap.NOW
  assert policy.decode_versions([2, 0, 0, 2], live=2) == [0, 2]
  assert policy.retain({0, 2}) == 2
  assert policy.params(0) == "p0" and policy.params(2) == "p2"
  with pytest.raises(KeyError):
    policy.params(1)
  assert not policy.admission_paused


def test_drain_defers_while_slots_decode_and_pauses_admission_meanwhile():
  policy = weight_updates.make_policy("drain")
  assert policy.on_publish(0, "p0", busy=False) is Swap.NOW
  assert policy.on_publish(1, "p1", busy=True) is Swap.DEFER
  assert policy.admission_paused
  # The deferred version is not held: the live one decodes until the swap.
  assert policy.decode_versions([0, 0], live=0) == [0]
  assert policy.retain({0}) == 1 and policy.params(0) == "p0"
  # A newer publish during the drain wins once the slots are empty.
  assert policy.on_publish(2, "p2", busy=False) is Swap.NOW
  assert not policy.admission_paused
  assert policy.retain({2}) == 1 and policy.params(2) == "p2"


def test_policies_are_fresh_objects_per_engine():
  a, b = weight_updates.make_policy("pinned"), weight_updates.make_policy("pinned")
  a.on_publish(0, "p0", busy=False)
  with pytest.raises(KeyError):
    b.params(0)


def test_every_mode_has_a_policy_and_bad_names_are_clear_errors():
  assert weight_updates.WEIGHT_UPDATE_MODES == ("in_flight", "pinned", "drain")
  for mode in weight_updates.WEIGHT_UPDATE_MODES:
    for kv_policy in weight_updates.KV_POLICIES:
      assert isinstance(weight_updates.make_policy(mode, kv_policy),
                        weight_updates.WeightUpdatePolicy)
  with pytest.raises(ValueError, match="weight_update must be one of .* got 'lazy'"):
    weight_updates.make_policy("lazy")
  with pytest.raises(ValueError, match="kv_policy: must be one of .* got 'drop'"):
    engine_config.EngineConfig(prompt_len=4, kv_cache="dense", decode_burst=1, precompile=False,
                               num_slots=4, group_size=2, max_new_tokens=4, kv_policy="drop")
