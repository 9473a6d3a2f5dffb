"""A resolved RunSpec travels to sampler processes as JSON and arrives equal."""

import json

import pytest

from arl_jax.config import run_spec
from arl_jax.core import spec_codec
from arl_jax.testing import tiny


@pytest.mark.parametrize("name, arg", [("arith", "tiny"), ("tool_agent", "mixed"),
                                       ("math_answer", None)])
def test_a_run_spec_round_trips_through_json(name, arg):
  spec = run_spec.build(tiny.load_config(name, arg))
  text = json.dumps(spec_codec.to_json(spec))
  again = spec_codec.from_json(json.loads(text))
  assert again == spec
  hash(again.sampling)  # still a valid jit static argument (tuples stayed tuples)


def test_only_this_package_s_dataclasses_are_rebuilt():
  with pytest.raises(ValueError, match="not a class of arl_jax"):
    spec_codec.from_json({"__dataclass__": "os.system", "command": "true"})
  with pytest.raises(ValueError, match="no class"):
    spec_codec.from_json({"__dataclass__": "arl_jax.config.run_spec.Nothing"})
  with pytest.raises(TypeError, match="cannot encode"):
    spec_codec.to_json(object())
