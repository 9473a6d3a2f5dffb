"""The config's schema: the dataclasses whose fields are each section's keys.

A key is declared once, as a field with its default, its documentation (the
class's `Attributes:` or a comment) and its check (`settings.py`).
`SECTIONS` names each section's dataclasses; `run_spec.build` checks a
config's keys against their fields (unknown keys are errors, a key without a
default must be given) and builds them; `base_config.make` builds the base
every config derives from out of their defaults.

`sampler` (`EngineConfig` and `SamplingSettings`), `learner` (the parts of
`loss_settings.LossSettings` and `optim.OptimConfig`), `orchestrator`
(`OrchestratorConfig`, whose views the dispatcher and buffer take), `mesh`,
`data`, `tokenizer`, `checkpoint` and `fleet` are the components' own
dataclasses; `warmup` is defined here (its optimizer keys are the learner's,
`WarmupOptim`) and read as it is by the warm-up phase.
`model` and `env` are defined here and turned into the model's config (from a
Hugging Face folder, when given) and the environment's by `config_lib`. Checks that span
sections (a batch that must split over the learner's fsdp axis, a prompt
that must fit the sampler) are `run_spec.build`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from arl_jax.core import schedule, settings
from arl_jax.distributed import fleet_config
from arl_jax.envs import prompt_source
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.gateway import agent_config
from arl_jax.judges import judge_config
from arl_jax.learner import checkpointing, loss_registry, loss_settings, mismatch, optim
from arl_jax.metrics import writer as writer_lib
from arl_jax.models import lora
from arl_jax.orchestrator import adaptive_staleness, orchestrator_config
from arl_jax.sampler import engine_config, sampling
from arl_jax.sharding import mesh_lib


def _check(cond: bool, key: str, message: str) -> None:
  if not cond:
    raise ValueError(f"{key}: {message}")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSection:
  """The top-level keys.

  Attributes:
    seed: seeds the init, the prompt stream and the sampler's draws.
    num_steps: learner updates to run.
    log_every: a progress line every N updates, on the last and with each
      evaluation (0: none); in a terminal a live bar also shows every update
      (`metrics/progress.py`).
    eval_every: a held-out evaluation every N updates (0: none).
    eval_size: held-out prompts per evaluation.
    eval_slots: slots of the greedy evaluation (0: one per held-out prompt,
      all at once): fewer bound its KV cache, which lives on the learner's
      devices, at eval_slots x the slot length; the prompts wait their turn
      and each gets the greedy answer it would alone (up to how the batch's
      shape rounds the math; `training/evaluation.py`).
    eval_samples: besides the greedy answer, this many samples of each
      held-out prompt at eval_temperature, reported as unbiased pass@k and
      avg@n (`metrics/pass_at_k.py`; 0: greedy only); on the sampler
      mesh beside training (`training/sampled_eval.py`).
    eval_temperature: the sampled evaluation's temperature.
    eval_solved_reward: a sample whose reward is at least this counts as
      solved for pass@k.
    writers: metric sinks besides the progress line, comma-separated
      (`metrics/writer.py`; JSON lines always).
    compilation_cache: JAX's persistent compilation cache: "auto" (the
      folder JAX is told to use, else `~/.cache/arl_jax/jit`), a folder, or
      "" (off); a second start of the same config reads its programs
      instead of compiling them (`compile_cache.py`).
    release_host_memory: at the end of each phase (an update, an evaluation,
      a checkpoint) return the memory the process freed to the system
      (glibc's `malloc_trim`; `metrics/host_memory.release_free`). On a CPU
      backend, where the devices' memory is the process's, what XLA's
      threads free otherwise stays with the process and the resident size
      grows update after update (`benchmarks/memory.py`).
  """

  seed: int = 0
  num_steps: int
  log_every: int = 100
  eval_every: int = 0
  eval_size: int = 256
  eval_slots: int = 0
  eval_samples: int = 0
  eval_temperature: float = 1.0
  eval_solved_reward: float = 1.0
  writers: str = "jsonl"
  compilation_cache: str = "auto"
  release_host_memory: bool = True

  def __post_init__(self):
    _check(isinstance(self.compilation_cache, str), "compilation_cache",
           f"must be 'auto', a folder or '' (off), got {self.compilation_cache!r}")
    _check(isinstance(self.eval_temperature, (int, float)) and self.eval_temperature > 0,
           "eval_temperature", f"must be > 0 (greedy is the other evaluation), got "
           f"{self.eval_temperature!r}")
    _check(isinstance(self.eval_solved_reward, (int, float)), "eval_solved_reward",
           f"must be a number, got {self.eval_solved_reward!r}")
    for key in ("num_steps", "log_every", "eval_every", "eval_size", "eval_slots",
                "eval_samples"):
      value = getattr(self, key)
      _check(_is_int(value) and value >= 0, key, f"must be an int >= 0, got {value!r}")
    unknown = sorted(set(self.writer_names) - set(writer_lib.WRITERS))
    _check(not unknown, "writers",
           f"unknown writer(s) {unknown}; known: {list(writer_lib.WRITERS)}")

  @property
  def writer_names(self) -> tuple[str, ...]:
    return tuple(w.strip() for w in str(self.writers).split(",") if w.strip())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """The `model` section: the decoder's shape, or a Hugging Face folder that
  gives it (`hf_path`: then the shape keys come from its config.json).

  Attributes:
    d_model: width of the residual stream.
    num_layers: decoder blocks.
    num_heads: query heads.
    num_kv_heads: key/value heads (grouped-query attention; divides num_heads).
    head_dim: width of a head.
    mlp_dim: hidden width of the SwiGLU MLP.
    rope_theta: the rotary embedding's base.
    tie_embeddings: the output projection is the embedding's transpose.
    max_seq_len: the longest context the model serves (prompt + completion).
    param_dtype: the learner's parameter and compute dtype ("float32" or
      "bfloat16"; the sampler's is `sampler.param_dtype`).
    value_head: a critic head beside the policy (`learner.loss="vtrace"`).
    hf_path: a Hugging Face folder (config.json, safetensors) whose shape and
      weights start the run ("": a model from scratch, shaped by the keys above).
  """

  d_model: int | None = None
  num_layers: int | None = None
  num_heads: int | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  mlp_dim: int | None = None
  rope_theta: float | None = None
  tie_embeddings: bool | None = None
  max_seq_len: int
  param_dtype: str = "float32"
  value_head: bool = False
  hf_path: str = ""

  SHAPE_KEYS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "rope_theta", "tie_embeddings")

  def __post_init__(self):
    given = [k for k in self.SHAPE_KEYS if getattr(self, k) is not None]
    if self.hf_path:
      _check(not given, "model.hf_path", f"{given} come from the model's config.json; remove "
             "them (or model.hf_path)")
    else:
      missing = [k for k in self.SHAPE_KEYS if getattr(self, k) is None]
      _check(not missing, "model", f"missing key(s) {missing}")

  def shape(self) -> dict:
    """The shape keys, for `ModelConfig` (without `hf_path`)."""
    return {k: getattr(self, k) for k in self.SHAPE_KEYS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSection:
  """The `env` section's common keys (the rest are the fields of the chosen
  environment's config dataclass, `envs/registry.py`).

  Attributes:
    name: the environment (`registry.ENVS`).
    num_workers: concurrent environment calls.
    timeout_s: per call (0: no limit).
  """

  name: str
  num_workers: int = 2
  timeout_s: float = 30.0

  def __post_init__(self):
    _check(_is_int(self.num_workers) and self.num_workers >= 1, "env.num_workers",
           f"must be an int >= 1, got {self.num_workers!r}")
    _check(self.timeout_s >= 0, "env.timeout_s",
           f"must be >= 0 (0: no limit), got {self.timeout_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSection:
  """The `warmup` section: supervised updates on the correct answers of some
  train prompts before RL (its optimizer's keys: `WarmupOptim`).

  Attributes:
    steps: supervised updates (0: no warm-up).
    batch_size: demonstrations per update.
    fraction: share of the train prompts whose answers are shown.
  """

  steps: int = 0
  batch_size: int = 64
  fraction: float = 0.3

  def __post_init__(self):
    _check(_is_int(self.steps) and self.steps >= 0, "warmup.steps", "must be an int >= 0")
    _check(0 < self.fraction <= 1, "warmup.fraction", "must be in (0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupOptim(optim.OptimConfig):
  """The warm-up's optimizer: the learner's keys (`optim.OptimConfig`: `lr`,
  `lr_schedule` over the warm-up's steps, `lr_warmup_steps`, `lr_min`, AdamW's
  own), with a larger default rate (supervised targets, a few hundred steps)."""

  lr: float = 1e-3


# Section name -> the dataclasses whose fields are its keys (`settings.keys`;
# one section's classes declare disjoint keys). A section whose keys all have
# defaults may be left out of a config. A dotted name is a section inside
# another (`learner.lora`: `config.learner.lora.rank`), listed after it.
SECTIONS = {
    "model": (ModelSection,),
    "mesh": (mesh_lib.MeshConfig,),
    "env": (EnvSection,),
    "sampler": (engine_config.EngineConfig, sampling.SamplingSettings),
    "orchestrator": (orchestrator_config.OrchestratorConfig,),
    "orchestrator.staleness": (adaptive_staleness.StalenessPolicy,),
    # (each loss's knobs: `loss_registry.KNOBS`, declared beside the loss)
    "learner": (loss_settings.Objective, mismatch.Correction, *loss_registry.KNOBS,
                loss_settings.StepLayout, loss_settings.Scoring, optim.OptimConfig),
    "learner.lora": (lora.LoraConfig,),
    "warmup": (WarmupSection, WarmupOptim),
    "data": (prompt_source.DataConfig,),
    "tokenizer": (tokenizer_lib.TokenizerConfig,),
    "checkpoint": (checkpointing.CheckpointConfig,),
    "fleet": (fleet_config.FleetConfig,),
    "agent": (agent_config.AgentConfig,),
    "judge": (judge_config.JudgeConfig,),
    "replay": (schedule.ReplayConfig,),
}


def top_level() -> tuple[str, ...]:
  """The sections a config holds at its top level."""
  return tuple(name for name in SECTIONS if "." not in name)


def subsections(name: str) -> tuple[str, ...]:
  """The keys of section `name` that are sections themselves (`lora` of `learner`)."""
  return tuple(n.rpartition(".")[2] for n in SECTIONS if n.rpartition(".")[0] == name)


def inner(name: str, cls) -> list[tuple[str, str, type]]:
  """`(field, section, its class)` for each section inside section `name` that
  `cls` takes whole as a derived field (`orchestrator.staleness`, a field of
  `OrchestratorConfig`, whose checks read it with the orchestrator's keys)."""
  derived = settings.derived_fields(cls)
  return [(key, f"{name}.{key}", SECTIONS[f"{name}.{key}"][0])
          for key in subsections(name) if derived.get(key) == f"{name}.{key}"]


def of(config: Mapping, name: str):
  """Section `name` of `config` (a nested mapping), or None when it is absent."""
  for part in name.split("."):
    if not isinstance(config, Mapping) or part not in config:
      return None
    config = config[part]
  return config


def keys(name: str) -> tuple[str, ...]:
  """The keys of section `name` (`RunSection`'s for "<top level>")."""
  return tuple(k for cls in _classes(name) for k in settings.keys(cls))


def required_keys(name: str) -> tuple[str, ...]:
  return tuple(k for cls in _classes(name) for k in settings.required_keys(cls))


def _classes(name: str) -> tuple[type, ...]:
  return (RunSection,) if name == "<top level>" else SECTIONS[name]
