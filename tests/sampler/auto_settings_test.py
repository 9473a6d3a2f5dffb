"""`sampler.kv_cache="auto"` and `sampler.decode_burst=0` resolve from the
config's shapes and platform (`sampler/auto_settings.py`), and the run says
what was chosen."""

import jax
import pytest

from arl_jax.config import run_spec
from arl_jax.sampler import auto_settings
from arl_jax.testing import tiny


def test_the_kv_cache_is_paged_from_1024_columns_a_slot_or_when_a_pool_is_asked_for():
  auto = dict(kv_pages=0, kv_memory_fraction=0.0, paged_attention="xla")
  assert auto_settings.kv_cache("auto", length=1023, **auto).value == "dense"
  choice = auto_settings.kv_cache("auto", length=1024, **auto)
  assert choice.value == "paged" and "1024 columns a slot >= 1024" in choice.reason
  assert auto_settings.kv_cache("auto", length=64, **{**auto, "kv_pages": 40}).value == "paged"
  assert auto_settings.kv_cache("auto", length=64,
                                **{**auto, "paged_attention": "pallas"}).value == "paged"
  assert auto_settings.kv_cache("dense", length=4096, **auto) == auto_settings.Choice("dense")


def test_decode_bursts_where_a_step_is_estimated_under_a_host_round_trip():
  # A 0.02M model on 32 slots: ~0.014 ms a CPU step (measured 0.2-0.3 ms, host-bound).
  assert auto_settings.decode_burst(0, num_params=20_000, num_slots=32, platform="cpu").value == 4
  # 3.2M on 32 slots: ~2.3 ms estimated (measured 5-9 ms; bursts did not pay).
  choice = auto_settings.decode_burst(0, num_params=3_200_000, num_slots=32, platform="cpu")
  assert choice.value == 1 and ">= a host round trip" in choice.reason
  # The same model on an accelerator, and planned devices (taken as one).
  assert auto_settings.decode_burst(0, num_params=3_200_000, num_slots=32,
                                    platform="tpu").value == 4
  assert auto_settings.decode_burst(0, num_params=500_000_000, num_slots=256,
                                    platform=None).value == 1
  assert auto_settings.decode_burst(2, num_params=1, num_slots=1, platform="cpu") == (
      auto_settings.Choice(2))


@pytest.mark.parametrize("max_new_tokens, kv_cache", [(5, "dense"), (1100, "paged")])
def test_a_config_s_auto_settings_resolve_and_are_named(max_new_tokens, kv_cache):
  config = tiny.load_config("arith", None)
  config.sampler.max_new_tokens = max_new_tokens
  config.model.max_seq_len = 2048
  spec = run_spec.build(config, jax.devices()[:1])
  assert spec.engine.kv_cache == kv_cache
  assert any(c.startswith(f"kv_cache={kv_cache} (auto: ") for c in spec.choices)
  # 0.43M parameters on 128 CPU slots: ~1.2 ms a step estimated, no bursts.
  assert spec.engine.decode_burst == 1
  assert any(c.startswith("decode_burst=1 (auto: a cpu decode step") for c in spec.choices)
  planned = run_spec.build(config, list(range(8)))  # (--dry_run_devices: an accelerator)
  assert planned.engine.decode_burst == 4


def test_explicit_settings_are_kept_and_not_reported():
  config = tiny.load_config("arith", None)
  config.sampler.update(kv_cache="paged", decode_burst=2)
  spec = run_spec.build(config, jax.devices()[:1])
  assert (spec.engine.kv_cache, spec.engine.decode_burst, spec.choices) == ("paged", 2, ())
  config.sampler.update(kv_cache="auto", kv_memory_fraction=0.5, decode_burst=-1)
  with pytest.raises(run_spec.ConfigError, match=r"sampler.decode_burst: must be an int >= 1 "
                                                   r"\(0: auto\), got -1"):
    run_spec.build(config, jax.devices()[:1])
