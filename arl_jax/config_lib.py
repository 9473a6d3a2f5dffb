"""The one module that reads a ConfigDict: it validates it and builds frozen,
keyword-only dataclasses for each component. Nothing else sees the config.

Every check runs here, before any parameter is created or function compiled,
and every error names the offending config key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import ml_collections

from arl_jax import checkpointing
from arl_jax.distributed import fleet as fleet_lib
from arl_jax.envs import env_api, prompt_source, registry
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.learner import advantages as advantages_lib
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import update as update_lib
from arl_jax.metrics import writer as writer_lib
from arl_jax.models import hf_config
from arl_jax.models import model_config as model_config_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.orchestrator import staleness
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import sampling
from arl_jax.sharding import mesh_lib

# The schema: each section and its keys. Unknown keys are errors.
_TOP_KEYS = ("seed", "num_steps", "log_every", "eval_every", "eval_size")
# Optional top-level keys and their defaults.
_OPTIONAL_TOP_KEYS = {"writers": "jsonl"}
# Optional sections (every key has a default in its dataclass).
_OPTIONAL_SECTIONS = {"checkpoint": checkpointing.CheckpointConfig,
                      "fleet": fleet_lib.FleetConfig}
# Model keys that a Hugging Face folder's config.json provides (`model.hf_path`).
_MODEL_SHAPE_KEYS = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                     "rope_theta", "tie_embeddings")
_SECTIONS = {
    "model": ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
              "max_seq_len", "rope_theta", "tie_embeddings", "param_dtype", "value_head"),
    "mesh": ("placement", "learner_devices", "learner", "sampler"),
    # Plus the fields of the chosen environment's config (registry.ENVS).
    "env": ("name", "num_workers", "timeout_s"),
    "sampler": ("num_slots", "prompt_len", "prompt_buckets", "max_new_tokens", "temperature",
                "top_k", "top_p", "weight_update", "kv_policy", "param_dtype"),
    "orchestrator": ("batch_size", "group_size", "max_async_level", "max_off_policy_steps",
                     "staleness_reference", "assembly", "window_fraction", "requeue_dropped",
                     "mask_truncated_completions"),
    "learner": ("loss", "eps_low", "eps_high", "dual_clip", "rho_bar", "c_bar", "lam",
                "vf_coef", "tau", "tis_cap",
                "age_decay", "decoupled", "aggregation", "kl_coef", "entropy_coef", "advantage",
                "num_epochs", "num_minibatches", "num_microbatches", "lr", "b1", "b2",
                "weight_decay", "max_grad_norm"),
    "warmup": ("steps", "batch_size", "lr", "fraction"),
    "data": ("train_path", "heldout_path", "on_malformed", "num_epochs"),
    "tokenizer": ("kind", "path", "eos_token", "bos_token", "pad_token", "chat_template"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupConfig:
  """Supervised warm-up before RL: `steps` updates on `fraction` of the train prompts."""

  steps: int = 0
  batch_size: int = 64
  lr: float = 1e-3
  fraction: float = 0.3


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """Everything a run needs, validated, as small frozen dataclasses."""

  seed: int
  num_steps: int
  log_every: int
  eval_every: int
  eval_size: int
  writers: tuple[str, ...]  # metric sinks besides the progress line (metrics/writer.py)
  checkpoint: checkpointing.CheckpointConfig
  fleet: fleet_lib.FleetConfig  # where sampling runs: here, or in sampler processes
  model: model_config_lib.ModelConfig
  # A Hugging Face folder whose config.json gave `model` and whose weights
  # start the run when nothing is resumed ("": none).
  model_hf_path: str
  mesh: mesh_lib.MeshConfig
  env_name: str
  env: object  # the environment's config dataclass (registry.ENVS[env_name].config_cls)
  data: prompt_source.DataConfig
  tokenizer: tokenizer_lib.TokenizerConfig
  num_env_workers: int
  env_timeout_s: float
  engine: engine_lib.EngineConfig
  sampler_model: model_config_lib.ModelConfig  # the model as the sampler runs it (dtype)
  sampling: sampling.SamplingSettings
  dispatch: dispatcher_lib.DispatchConfig
  buffer: buffer_lib.BufferConfig
  mask_truncated_completions: bool
  loss: update_lib.LossSettings
  advantage_estimator: str
  optim: optim_lib.OptimConfig
  warmup: WarmupConfig


class ConfigError(ValueError):
  """A configuration problem, raised before any expensive work."""


def _check_keys(section: Mapping, name: str, allowed: Sequence[str]) -> None:
  unknown = sorted(set(section.keys()) - set(allowed))
  if unknown:
    raise ConfigError(f"config.{name}: unknown key(s) {unknown}; known keys: {sorted(allowed)}")


def _require(cond: bool, key: str, message: str) -> None:
  if not cond:
    raise ConfigError(f"config.{key}: {message}")


def _wrap(key: str, fn, **kwargs):
  """Builds a component config, re-raising its own checks with the config key."""
  try:
    return fn(**kwargs)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.{key}: {e}") from e


def _tuples(value) -> tuple[tuple[str, int], ...]:
  return tuple((str(name), int(size)) for name, size in value)


def build(config: ml_collections.ConfigDict, devices: Sequence | None = None) -> RunSpec:
  """Validates `config` and returns the RunSpec.

  Args:
    config: the experiment ConfigDict (see `configs/arith.py`).
    devices: devices to plan meshes on (default `jax.devices()`); only counted,
      nothing is placed or compiled.

  Raises:
    ConfigError: naming the key, for any invalid or inconsistent setting.
  """
  cfg = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  _check_keys(cfg, "<top level>",
              _TOP_KEYS + tuple(_OPTIONAL_TOP_KEYS) + tuple(_SECTIONS) + tuple(_OPTIONAL_SECTIONS))
  cfg = {**_OPTIONAL_TOP_KEYS, **cfg}
  _require("env" in cfg and "name" in cfg["env"], "env.name", "missing")
  env_name = cfg["env"]["name"]
  _require(env_name in registry.ENVS, "env.name",
           f"unknown environment {env_name!r}; known: {sorted(registry.ENVS)}")
  env_entry = registry.ENVS[env_name]
  env_fields = tuple(f.name for f in dataclasses.fields(env_entry.config_cls) if f.init)
  for name, keys in _SECTIONS.items():
    _require(name in cfg, name, "missing section")
    if name == "env":  # the env's own fields have defaults; the common keys do not
      _check_keys(cfg[name], name, keys + env_fields)
    elif name == "model":
      _check_keys(cfg[name], name, keys + ("hf_path",))
      if cfg[name].get("hf_path"):  # the shapes come from the folder's config.json
        given = sorted(set(_MODEL_SHAPE_KEYS) & set(cfg[name]))
        _require(not given, "model.hf_path", f"{given} come from the model's config.json; "
                 "remove them (or model.hf_path)")
        keys = tuple(k for k in keys if k not in _MODEL_SHAPE_KEYS)
    else:
      _check_keys(cfg[name], name, keys)
    missing = sorted(set(keys) - set(cfg[name]))
    _require(not missing, name, f"missing key(s) {missing}")
  for key in _TOP_KEYS:
    _require(key in cfg, key, "missing")
  _require(cfg["num_steps"] >= 0, "num_steps", f"must be >= 0, got {cfg['num_steps']}")
  for key in ("log_every", "eval_every", "eval_size"):
    _require(cfg[key] >= 0, key, f"must be >= 0, got {cfg[key]}")

  writers = tuple(w.strip() for w in str(cfg["writers"]).split(",") if w.strip())
  unknown = sorted(set(writers) - set(writer_lib.WRITERS))
  _require(not unknown, "writers",
           f"unknown writer(s) {unknown}; known: {list(writer_lib.WRITERS)}")
  for name in writers:
    try:
      writer_lib.check_available(name)
    except ImportError as e:
      raise ConfigError(f"config.writers: {e}") from e

  checkpoint_cfg = cfg.get("checkpoint", {})
  _check_keys(checkpoint_cfg, "checkpoint",
              tuple(f.name for f in dataclasses.fields(checkpointing.CheckpointConfig)))
  checkpoint = _wrap("checkpoint", checkpointing.CheckpointConfig, **checkpoint_cfg)
  fleet_cfg = cfg.get("fleet", {})
  _check_keys(fleet_cfg, "fleet", tuple(f.name for f in dataclasses.fields(fleet_lib.FleetConfig)))
  fleet = _wrap("fleet", fleet_lib.FleetConfig, **fleet_cfg)

  tokenizer_cfg = _wrap("tokenizer", tokenizer_lib.TokenizerConfig, **cfg["tokenizer"])
  try:
    tokenizer = tokenizer_lib.make_tokenizer(tokenizer_cfg)
  except (OSError, ValueError, ImportError) as e:
    raise ConfigError(f"config.tokenizer: {e}") from e
  s, o, m, lc, w = (cfg["sampler"], cfg["orchestrator"], cfg["model"], cfg["learner"],
                    cfg["warmup"])

  model_hf_path = m.get("hf_path", "")
  if model_hf_path:
    try:
      hf = hf_config.read_config(model_hf_path)
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.model.hf_path: {e}") from e
    model = _wrap("model.hf_path", hf_config.model_config_from_hf, hf=hf,
                  param_dtype=m["param_dtype"], max_seq_len=m["max_seq_len"],
                  value_head=m["value_head"],
                  where=os.path.join(model_hf_path, "config.json"))
    _require(tokenizer.vocab_size <= model.vocab_size, "tokenizer",
             f"{tokenizer.vocab_size} tokens, more than the model's vocab_size "
             f"{model.vocab_size} ({model_hf_path}/config.json)")
  else:
    model = _wrap("model", model_config_lib.ModelConfig, vocab_size=tokenizer.vocab_size,
                  **{k: v for k, v in m.items() if k != "hf_path"})

  env_cfg = cfg["env"]
  env_kwargs = {k: v for k, v in env_cfg.items() if k not in _SECTIONS["env"]}
  env = _wrap("env", env_entry.config_cls, **env_kwargs)
  _require(env_cfg["num_workers"] >= 1, "env.num_workers", "must be >= 1")
  _require(env_cfg["timeout_s"] >= 0, "env.timeout_s",
           f"must be >= 0 (0: no limit), got {env_cfg['timeout_s']}")

  # Orchestration.
  g, batch = o["group_size"], o["batch_size"]
  _require(g >= 2, "orchestrator.group_size",
           f"must be >= 2 (group-relative advantages need a baseline), got {g}")
  _require(batch > 0 and batch % g == 0, "orchestrator.batch_size",
           f"{batch} rollouts is not a positive multiple of orchestrator.group_size={g}")
  k = o["max_off_policy_steps"]
  _require(k >= 0, "orchestrator.max_off_policy_steps", f"K must be >= 0, got {k}")
  _require(o["max_async_level"] >= 0, "orchestrator.max_async_level",
           f"must be >= 0, got {o['max_async_level']}")
  _require(o["staleness_reference"] in staleness.REFERENCES, "orchestrator.staleness_reference",
           f"must be one of {staleness.REFERENCES}, got {o['staleness_reference']!r}")
  _require(o["assembly"] in buffer_lib.ASSEMBLY_POLICIES, "orchestrator.assembly",
           f"must be one of {buffer_lib.ASSEMBLY_POLICIES}, got {o['assembly']!r}")
  _require(0.0 < o["window_fraction"] <= 1.0, "orchestrator.window_fraction",
           f"must be in (0, 1], got {o['window_fraction']}")
  _require(type(o["requeue_dropped"]) is int and o["requeue_dropped"] >= 0,
           "orchestrator.requeue_dropped",
           f"must be an int >= 0 (times a dropped prompt is dispatched again), "
           f"got {o['requeue_dropped']!r}")
  _require(isinstance(o["mask_truncated_completions"], bool),
           "orchestrator.mask_truncated_completions",
           f"must be True or False, got {o['mask_truncated_completions']!r}")
  groups_per_batch = batch // g
  dispatch = dispatcher_lib.DispatchConfig(
      group_size=g, groups_per_batch=groups_per_batch, max_async_level=o["max_async_level"],
      max_off_policy_steps=k, staleness_reference=o["staleness_reference"],
      requeue_dropped=o["requeue_dropped"])
  buffer = buffer_lib.BufferConfig(
      max_off_policy_steps=k, staleness_reference=o["staleness_reference"],
      assembly=o["assembly"],
      window_groups=max(1, round(o["window_fraction"] * groups_per_batch)))

  # Sampler.
  _require(s["weight_update"] in engine_lib.WEIGHT_UPDATE_MODES, "sampler.weight_update",
           f"must be one of {engine_lib.WEIGHT_UPDATE_MODES}, got {s['weight_update']!r}")
  _require(s["kv_policy"] in engine_lib.KV_POLICIES, "sampler.kv_policy",
           f"must be one of {engine_lib.KV_POLICIES}, got {s['kv_policy']!r}")
  _require(s["param_dtype"] in ("float32", "bfloat16"), "sampler.param_dtype",
           f"must be float32 or bfloat16, got {s['param_dtype']!r}")
  _require(s["top_k"] >= 0, "sampler.top_k", f"must be >= 0 (0: off), got {s['top_k']}")
  _require(0.0 < s["top_p"] <= 1.0, "sampler.top_p", f"must be in (0, 1], got {s['top_p']}")
  buckets = tuple(int(b) for b in s["prompt_buckets"])
  _require(all(0 < b <= s["prompt_len"] for b in buckets), "sampler.prompt_buckets",
           f"{buckets}: every bucket must be in [1, sampler.prompt_len={s['prompt_len']}]")
  buckets = tuple(sorted(set(buckets) | {int(s["prompt_len"])}))
  _require(s["num_slots"] >= g and s["num_slots"] % g == 0, "sampler.num_slots",
           f"{s['num_slots']} must be a positive multiple of orchestrator.group_size={g}")
  _require(s["max_new_tokens"] >= 1, "sampler.max_new_tokens", "must be >= 1")
  _require(s["temperature"] > 0, "sampler.temperature", f"must be > 0, got {s['temperature']}")
  context = s["prompt_len"] + s["max_new_tokens"]
  _require(context <= model.max_seq_len, "sampler.prompt_len",
           f"prompt_len + max_new_tokens = {context} exceeds the model context "
           f"model.max_seq_len={model.max_seq_len}")
  # Measure prompts and answers the way the environment encodes them, so the
  # check cannot drift from what the sampler and warm-up actually receive.
  env_instance = env_entry.make_env_fn(env, tokenizer, for_eval=True)
  data_cfg = _wrap("data", prompt_source.DataConfig, **cfg["data"])
  _require(not (data_cfg.num_epochs and env_name == "mixture"), "data.num_epochs",
           "a mixture streams its environments endlessly (by weight); use 0")
  prompts_by_split = {}
  for split in env_api.SPLITS:
    key = f"data.{split}_path" if data_cfg.path(split) else "env"
    try:
      loaded = prompt_source.load(env_name, env, data_cfg, split)
      # A file's prompt too long for the sampler is a bad line of the file
      # (named; skipped with data.on_malformed='skip'); the env's own are checked below.
      data_cfg, loaded = prompt_source.drop_long_prompts(
          data_cfg, loaded, lambda p: len(env_instance.encode_prompt(p)), s["prompt_len"])
      prompts_by_split[split] = loaded.prompts
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.{key}: {e}") from e
    _require(bool(prompts_by_split[split]), key,
             f"env {env_name!r} has no {split!r} prompts with these settings")
  all_prompts = [p for prompts in prompts_by_split.values() for p in prompts]
  longest = max(len(env_instance.encode_prompt(p)) for p in all_prompts)
  _require(longest <= s["prompt_len"], "sampler.prompt_len",
           f"a prompt of env {env_cfg['name']!r} has {longest} tokens, longer than "
           f"sampler.prompt_len={s['prompt_len']}")
  longest_answer = max(len(env_instance.demonstration(p).completion_ids) for p in all_prompts)
  _require(longest_answer <= s["max_new_tokens"], "sampler.max_new_tokens",
           f"the longest correct answer of env {env_cfg['name']!r} needs {longest_answer} "
           f"tokens (EOS included), more than sampler.max_new_tokens={s['max_new_tokens']}: "
           "it could never be rewarded")
  engine_multi_turn = env_api.is_multi_turn(env_instance)
  engine = engine_lib.EngineConfig(
      num_slots=s["num_slots"], group_size=g, prompt_buckets=buckets,
      max_new_tokens=s["max_new_tokens"], weight_update=s["weight_update"],
      kv_policy=s["kv_policy"], seed=cfg["seed"],
      multi_turn=engine_multi_turn)
  sampling_settings = sampling.SamplingSettings(
      temperature=float(s["temperature"]), top_k=int(s["top_k"]), top_p=float(s["top_p"]),
      eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
      stop_ids=env_api.sampler_stop_ids(tokenizer, env_instance))

  # Learner.
  _require(lc["loss"] in losses_lib.LOSSES, "learner.loss",
           f"unknown loss {lc['loss']!r}; known: {sorted(losses_lib.LOSSES)}")
  _require(lc["advantage"] in advantages_lib.ADVANTAGE_ESTIMATORS, "learner.advantage",
           f"must be one of {advantages_lib.ADVANTAGE_ESTIMATORS}, got {lc['advantage']!r}")
  _require(0 <= lc["eps_low"] < 1 and lc["eps_high"] >= 0, "learner.eps_low",
           "clip ranges must satisfy 0 <= eps_low < 1 and eps_high >= 0")
  _require(lc["dual_clip"] == 0 or lc["dual_clip"] > 1, "learner.dual_clip",
           f"must be 0 (off) or > 1, got {lc['dual_clip']}")
  _require(lc["rho_bar"] >= 1, "learner.rho_bar", f"must be >= 1, got {lc['rho_bar']}")
  _require(0 < lc["c_bar"] <= lc["rho_bar"], "learner.c_bar",
           f"must be in (0, learner.rho_bar={lc['rho_bar']}], got {lc['c_bar']}")
  _require(0 <= lc["lam"] <= 1, "learner.lam", f"must be in [0, 1], got {lc['lam']}")
  _require(lc["vf_coef"] >= 0, "learner.vf_coef", f"must be >= 0, got {lc['vf_coef']}")
  _require(not model.value_head or lc["loss"] == "vtrace", "model.value_head",
           f"a critic is trained only by learner.loss='vtrace', got {lc['loss']!r}")
  _require(lc["tau"] > 0, "learner.tau", f"must be > 0, got {lc['tau']}")
  _require(lc["tis_cap"] == 0 or lc["tis_cap"] >= 1, "learner.tis_cap",
           f"must be 0 (off) or >= 1, got {lc['tis_cap']}")
  for key in ("age_decay", "kl_coef", "entropy_coef"):
    _require(lc[key] >= 0, f"learner.{key}", f"must be >= 0, got {lc[key]}")
  _require(lc["aggregation"] in losses_lib.AGGREGATIONS, "learner.aggregation",
           f"must be one of {losses_lib.AGGREGATIONS}, got {lc['aggregation']!r}")
  for key in ("num_epochs", "num_minibatches", "num_microbatches"):
    _require(type(lc[key]) is int and lc[key] >= 1, f"learner.{key}",
             f"must be an int >= 1, got {lc[key]!r}")
  slices = lc["num_minibatches"] * lc["num_microbatches"]
  _require(batch % slices == 0, "learner.num_microbatches",
           f"orchestrator.batch_size={batch} rows do not split into num_minibatches x "
           f"num_microbatches = {slices} equal slices")
  loss = _wrap(
      "learner", update_lib.LossSettings,
      name=lc["loss"], eps_low=float(lc["eps_low"]), eps_high=float(lc["eps_high"]),
      dual_clip=float(lc["dual_clip"]) if lc["dual_clip"] else None,
      rho_bar=float(lc["rho_bar"]), c_bar=float(lc["c_bar"]), lam=float(lc["lam"]),
      critic=model.value_head, vf_coef=float(lc["vf_coef"]), tau=float(lc["tau"]),
      tis_cap=float(lc["tis_cap"]) if lc["tis_cap"] else None,
      age_decay=float(lc["age_decay"]), decoupled=bool(lc["decoupled"]),
      aggregation=lc["aggregation"], norm_constant=float(s["max_new_tokens"]),
      kl_coef=float(lc["kl_coef"]), entropy_coef=float(lc["entropy_coef"]),
      temperature=float(s["temperature"]), num_epochs=lc["num_epochs"],
      num_minibatches=lc["num_minibatches"], num_microbatches=lc["num_microbatches"])
  optim = _wrap("learner", optim_lib.OptimConfig, lr=lc["lr"], b1=lc["b1"], b2=lc["b2"],
                weight_decay=lc["weight_decay"], max_grad_norm=lc["max_grad_norm"])
  _require(w["steps"] >= 0, "warmup.steps", "must be >= 0")
  _require(0 < w["fraction"] <= 1, "warmup.fraction", "must be in (0, 1]")
  _require(w["lr"] > 0, "warmup.lr", "must be > 0")

  # Meshes: plan them now (counting devices only) so that a mesh needing more
  # devices than exist fails here, not after compilation.
  mesh = mesh_lib.MeshConfig(placement=cfg["mesh"]["placement"],
                             learner_devices=cfg["mesh"]["learner_devices"],
                             learner=_tuples(cfg["mesh"]["learner"]),
                             sampler=_tuples(cfg["mesh"]["sampler"]))
  try:
    learner_devs, sampler_devs = mesh_lib.role_devices(mesh, devices)
    learner_shape = dict(mesh_lib.resolve_shape(mesh.learner, len(learner_devs), "learner"))
    sampler_shape = dict(mesh_lib.resolve_shape(mesh.sampler, len(sampler_devs), "sampler"))
  except ValueError as e:
    raise ConfigError(f"config.{e}") from e
  fsdp = learner_shape.get("fsdp", 1)
  _require(batch % fsdp == 0, "orchestrator.batch_size",
           f"{batch} rows do not split over the learner's fsdp axis of size {fsdp}")
  _require(w["steps"] == 0 or w["batch_size"] % fsdp == 0, "warmup.batch_size",
           f"{w['batch_size']} rows do not split over the learner's fsdp axis of size {fsdp}")
  data = sampler_shape.get("data", 1)
  _require(s["num_slots"] % data == 0, "sampler.num_slots",
           f"{s['num_slots']} slots do not split over the sampler's data axis of size {data}")

  return RunSpec(
      seed=cfg["seed"], num_steps=cfg["num_steps"], log_every=cfg["log_every"],
      eval_every=cfg["eval_every"], eval_size=cfg["eval_size"], writers=writers,
      checkpoint=checkpoint, fleet=fleet, model=model, model_hf_path=model_hf_path,
      mesh=mesh,
      env_name=env_name, env=env, data=data_cfg, tokenizer=tokenizer_cfg,
      num_env_workers=env_cfg["num_workers"],
      env_timeout_s=float(env_cfg["timeout_s"]), engine=engine,
      sampler_model=dataclasses.replace(model, param_dtype=s["param_dtype"]),
      sampling=sampling_settings, dispatch=dispatch, buffer=buffer,
      mask_truncated_completions=o["mask_truncated_completions"], loss=loss,
      advantage_estimator=lc["advantage"], optim=optim,
      warmup=WarmupConfig(steps=w["steps"], batch_size=w["batch_size"], lr=w["lr"],
                          fraction=w["fraction"]))
