"""The config schema: every key declared once (`settings.py`), documented, in
the base every built-in config derives from (`base_config.py`); a setting
added to a component's dataclass reaches a run with no other change."""

import dataclasses

import jax
import pytest

from arl_jax.config import base_config, builtin, run_spec, schema
from arl_jax.core import settings
from arl_jax.envs import registry
from arl_jax.sampler import engine_config, sampling
from arl_jax.testing import tiny


def _schema():
  """(section, dataclass) for every section, the top level and every environment."""
  yield "<top level>", schema.RunSection
  for name, classes in schema.SECTIONS.items():
    for cls in classes:
      yield name, cls
  for env, entry in registry.ENVS.items():
    if entry.config_cls.__module__.startswith("arl_jax."):  # (not tests' own)
      yield f"env {env}", entry.config_cls


def test_every_key_is_declared_once_and_documented():
  for name, classes in schema.SECTIONS.items():
    keys = [k for cls in classes for k in settings.keys(cls)]
    assert len(keys) == len(set(keys)), f"{name}: a key declared twice in {keys}"
  for name, cls in _schema():
    undocumented = sorted(set(settings.keys(cls)) - set(settings.attribute_docs(cls)))
    assert not undocumented, f"{name}: {cls.__name__}'s docstring documents no {undocumented}"


def test_attribute_docs_reads_google_style_attributes():
  @dataclasses.dataclass
  class Example:
    """Summary.

    Attributes:
      alpha: the first,
        continued.
      beta: the second.

    Not an attribute: text after the section.
    """

    alpha: int = 0
    beta: int = 0

  assert settings.attribute_docs(Example) == {"alpha": "the first, continued.",
                                               "beta": "the second."}


def test_the_base_holds_every_key_with_a_default_and_configs_derive_from_it():
  for env in ("arith", "math_answer", "tool_agent", "mixture"):
    base = base_config.make(env)
    for name, cls in _schema():
      if name.startswith("env ") and name != f"env {env}":
        continue
      section = base if name == "<top level>" else base[name.split(" ")[0]]
      assert set(settings.defaults(cls)) <= set(section), (env, name)
  for name in ("arith", "math_answer", "tool_agent"):
    config = builtin.load(name)
    base = base_config.make(config.env.name)
    assert config.sampler.attention_block == base.sampler.attention_block  # (stated nowhere)
  with pytest.raises(ValueError, match="unknown environment 'chess'"):
    base_config.make("chess")


def test_derived_fields_are_not_keys():
  config = tiny.load_config("arith", "tiny")
  config.unlock()
  config.sampler.group_size = 4  # (the orchestrator's)
  with pytest.raises(run_spec.ConfigError,
                     match=r"config.sampler: unknown key\(s\) \['group_size'\]"):
    run_spec.build(config, jax.devices()[:1])


def test_a_setting_added_to_the_schema_reaches_the_run_with_no_other_change(monkeypatch):
  """What adding a sampler setting takes: a field (with its default, doc and
  check) on the dataclass, and its use. The base config, overrides, the
  checks' messages and the run's settings follow."""

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class WithLookahead(engine_config.EngineConfig):
    """Attributes:
      lookahead: an example setting.
    """

    lookahead: int = 3

    def __post_init__(self):
      super().__post_init__()
      settings.check(self.lookahead >= 0, "lookahead", f"must be >= 0, got {self.lookahead}")

  monkeypatch.setitem(schema.SECTIONS, "sampler",
                      (WithLookahead, sampling.SamplingSettings))
  config = tiny.load_config("arith", "tiny")
  assert config.sampler.lookahead == 3
  devices = jax.devices()[:1]
  assert run_spec.build(config, devices).engine.lookahead == 3
  config.sampler.lookahead = 5
  assert run_spec.build(config, devices).engine.lookahead == 5
  config.sampler.lookahead = -1
  with pytest.raises(run_spec.ConfigError, match=r"config.sampler.lookahead: must be >= 0"):
    run_spec.build(config, devices)
