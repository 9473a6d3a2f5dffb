"""The public API (`import arl_jax`): the names a user scripts against, lazy
(importing the package starts no JAX), documented in the README, and enough
to load a config from a path, register an environment and train on it."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

import arl_jax
from arl_jax.envs import env_api

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_the_package_loads_nothing_heavy():
  out = subprocess.run([sys.executable, "-c", "import arl_jax, sys; print(json.dumps("
                        "sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules)))"
                        .replace("json.dumps", "__import__('json').dumps")],
                       capture_output=True, text=True, check=True, cwd="/")
  assert json.loads(out.stdout) == []


def test_every_api_name_resolves_and_the_readme_lists_exactly_them():
  for name in arl_jax.__all__:
    assert getattr(arl_jax, name) is not None, name
  with pytest.raises(AttributeError, match="no attribute 'nope'.*the API"):
    arl_jax.nope  # noqa: B018
  readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
  section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
  assert sorted(set(re.findall(r"`arl_jax\.(\w+)", section))) == arl_jax.__all__


def test_a_config_loads_by_name_or_by_path(tmp_path, monkeypatch):
  assert "arith" in arl_jax.config_names()
  by_name = arl_jax.load_config("arith", "tiny")
  monkeypatch.chdir(tmp_path)
  (tmp_path / "mine.py").write_text(
      "import arl_jax\n\n\ndef get_config(arg=None):\n"
      "  config = arl_jax.load_config('arith', arg)\n  config.num_steps = 7\n  return config\n")
  by_path = arl_jax.load_config("mine.py", "tiny")
  assert by_path.num_steps == 7 and by_name.num_steps != 7
  with pytest.raises(FileNotFoundError, match=r"no config file 'other.py' \(from .*\); built-in"):
    arl_jax.load_config("other.py")
  config = arl_jax.load_config("arith", "tiny")
  config.sampler.temperature = -1.0
  with pytest.raises(arl_jax.ConfigError, match="sampler.temperature"):
    arl_jax.build_spec(config)


def test_a_config_file_written_against_the_old_module_paths_still_loads(tmp_path, monkeypatch):
  """Before issue 53 a config imported `arl_jax.config_base` and `arl_jax.sweep`:
  such a file loads for one more release, each old path a DeprecationWarning
  that names the new one."""
  import importlib
  import warnings

  from arl_jax import _moved
  monkeypatch.chdir(tmp_path)
  (tmp_path / "old.py").write_text(
      "from arl_jax import config_base, sweep\n\n\ndef get_config(arg=None):\n"
      "  config = config_base.make('arith')\n  config.update(num_steps=3)\n"
      "  config.env.max_operand = 9\n"
      "  config.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,\n"
      "                      head_dim=16, mlp_dim=64, max_seq_len=32, rope_theta=1e4,\n"
      "                      tie_embeddings=True)\n"
      "  config.sampler.update(num_slots=32, prompt_len=6, max_new_tokens=3)\n"
      "  config.orchestrator.update(batch_size=32, group_size=4)\n"
      "  return config\n\n\ndef get_sweep(arg=None):\n"
      "  return sweep.product(sweep.axis('seed', [0, 1]))\n")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    config = arl_jax.load_config("old.py")
    for old, new in _moved.MOVED.items():
      before, after = importlib.import_module(old), importlib.import_module(new)
      public = [n for n in vars(after) if not n.startswith("_")]
      assert public and all(getattr(before, n) is getattr(after, n) for n in public), old
  assert arl_jax.build_spec(config).run.num_steps == 3
  said = {str(w.message).split(" moved")[0] for w in caught
          if issubclass(w.category, DeprecationWarning)}
  assert {"arl_jax.config_base", "arl_jax.sweep"} <= said
  assert any("arl_jax.config_base moved to arl_jax.config.base_config" in str(w.message)
             for w in caught)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LetterConfig:
  letter: str = "a"


class _LetterEnv(arl_jax.Environment):
  """Reward 1 for a completion that starts with the configured letter."""

  name = "letter"

  def __init__(self, cfg, tokenizer):
    self._cfg, self._tokenizer = cfg, tokenizer

  def encode_prompt(self, prompt):
    return env_api.encode_user_prompt(self._tokenizer, prompt.text)

  def score(self, prompt, completion_ids):
    return float(self._tokenizer.decode([int(t) for t in completion_ids]).startswith(
        self._cfg.letter))


def _letter_prompts(cfg, split):
  offset = 0 if split == "train" else 1000
  return [arl_jax.TextPrompt(prompt_id=offset + i, text=f"{i}", answer=cfg.letter)
          for i in range(40)]


def test_a_registered_environment_trains_through_the_api(tmp_path):
  entry = arl_jax.EnvEntry(_LetterConfig, lambda cfg, tok, for_eval=False: _LetterEnv(cfg, tok),
                           _letter_prompts)
  arl_jax.register_env("letter", entry)
  with pytest.raises(ValueError, match="'letter' is already registered"):
    arl_jax.register_env("letter", entry)
  arl_jax.register_env("letter", entry, replace=True)
  config = arl_jax.load_config("arith", "tiny")
  config.env = {"name": "letter", "letter": "b", "num_workers": 1, "timeout_s": 10.0}
  config.warmup.steps = 0  # (no demonstrations)
  config.num_steps, config.eval_every = 2, 0
  result = arl_jax.run(config, str(tmp_path / "run"), print_fn=lambda line: None)
  assert result.final_version == 2 and len(result.history) == 2
  run = arl_jax.load_run(str(tmp_path / "run"))
  assert [r["version"] for r in run.steps] == [1, 2]
  assert all(list(r["reward_by_env"]) == ["letter"] for r in run.steps)
  assert len(arl_jax.plot_all([str(tmp_path / "run")], str(tmp_path / "plots"))) >= 3
