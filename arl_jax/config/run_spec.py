"""The one module that reads a ConfigDict: it validates it and builds frozen,
keyword-only dataclasses for each component. Nothing else sees the config.

Every check runs here, before anything is created or compiled; every error names its key.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import ml_collections

from arl_jax.config import inputs as inputs_lib
from arl_jax.config import schema as sections
from arl_jax.core import packing as packing_lib
from arl_jax.core import schedule, settings
from arl_jax.distributed import fleet_config
from arl_jax.envs import env_api, prompt_source, registry
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.gateway import agent_config
from arl_jax.judges import judged_env
from arl_jax.learner import checkpointing, loss_registry
from arl_jax.learner import loss_settings as loss_settings_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.metrics import writer as writer_lib
from arl_jax.models import hf_config, peft_adapters
from arl_jax.models import model_config as model_config_lib
from arl_jax.models import paged_attention as paged_attention_lib
from arl_jax.orchestrator import orchestrator_config
from arl_jax.sampler import auto_settings, engine_config
from arl_jax.sampler import sampling as sampling_lib
from arl_jax.sharding import mesh_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
  """Everything a run needs, validated, as small frozen dataclasses."""

  # The top-level keys: seed, length, logging, evaluation, writers, the
  # compilation cache (`spec.run.seed`, ...).
  run: sections.RunSection
  checkpoint: checkpointing.CheckpointConfig
  fleet: fleet_config.FleetConfig  # where sampling runs: here, or in sampler processes
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
  engine: engine_config.EngineConfig
  sampler_model: model_config_lib.ModelConfig  # the model as the sampler runs it (dtype)
  sampling: sampling_lib.SamplingSettings
  # (the orchestrator, its dispatcher and its buffer each take it whole)
  orchestrator: orchestrator_config.OrchestratorConfig
  loss: loss_settings_lib.LossSettings
  packing: packing_lib.Packing | None  # how the learner's rows hold rollouts (None: padded)
  optim: optim_lib.OptimConfig
  warmup: sections.WarmupSection
  warmup_optim: optim_lib.OptimConfig  # (the warmup section's optimizer keys)
  # Settings left to `auto`, as chosen (`sampler/auto_settings.py`; the header prints them).
  choices: tuple[str, ...] = ()
  kv_cache_setting: str = "auto"  # `sampler.kv_cache` as written (`fit.with_new_tokens`)
  # Rollouts from an OpenAI-client agent through the run's gateway (off: the env's own).
  agent: agent_config.AgentConfig = agent_config.AgentConfig()
  replay: schedule.ReplayConfig = schedule.ReplayConfig()  # (record, or follow: schedule.py)


class ConfigError(ValueError):
  """A configuration problem, raised before any expensive work."""


def _require(cond: bool, key: str, message: str) -> None:
  if not cond:
    raise ConfigError(f"config.{key}: {message}")


def _wrap(key: str, fn, **kwargs):
  """Builds a dataclass, re-raising its own checks as ConfigErrors: with the
  key they name, or with `key` when they name none."""
  try:
    return fn(**kwargs)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config.{key}: {e}") from e


def _check_keys(cfg: Mapping, name: str, extra_keys: tuple[str, ...] = ()) -> None:
  """Checks section `name`'s keys in `cfg` against the schema (`extra_keys`:
  keys it may hold besides, checked elsewhere)."""
  given = sections.of(cfg, name)
  known = sections.keys(name) + sections.subsections(name) + extra_keys
  unknown = sorted(set(given or {}) - set(known))
  _require(not unknown, name, f"unknown key(s) {unknown}; known keys: {sorted(known)}")
  missing = sorted(set(sections.required_keys(name)) - set(given or {}))
  _require(not missing, name, "missing section" if given is None else f"missing key(s) {missing}")


def _build(cfg: Mapping, name: str, cls, **derived):
  """`cls` (one of section `name`'s dataclasses) from the section's keys and the
  sections inside it that are its fields (`sections.inner`), and `derived` (fields
  the run decides). Its checks' errors name the key: `config.sampler.top_p: ...`."""
  given = {k: v for k, v in (sections.of(cfg, name) or {}).items() if k in settings.keys(cls)}
  given.update({k: _build(cfg, inner, c) for k, inner, c in sections.inner(name, cls)})
  try:
    return cls(**given, **derived)
  except settings.SettingError as e:
    if e.key in settings.keys(cls):
      raise ConfigError(f"config.{name}.{e.key}: {e.message}") from e
    # (a derived field, refused: say where the run took it from)
    source = settings.derived_fields(cls).get(e.key, "?")
    raise ConfigError(f"config.{name}: {e} ({e.key} is {source}'s)") from e
  except (ValueError, TypeError) as e:
    message = str(e)
    # Some sections' checks start with the key they refuse ("env.path: ...");
    # a component's say it in their own words.
    first = message.split(" ", 1)[0]
    named = first.startswith(f"{name}.") and first.endswith(":")
    raise ConfigError(f"config.{message}" if named else f"config.{name}: {message}") from e


@dataclasses.dataclass(frozen=True)
class Resolved:
  """A validated config: the spec, and the inputs loaded to validate it (the
  run uses them as they are: nothing is loaded twice)."""

  spec: RunSpec
  inputs: inputs_lib.Inputs


def build(config: ml_collections.ConfigDict, devices: Sequence | None = None,
          device_memory: int | None = None) -> RunSpec:
  """Validates `config` and returns the RunSpec (`resolve` also keeps the inputs).

  Raises:
    ConfigError: naming the key, for any invalid or inconsistent setting.
  """
  return resolve(config, devices, device_memory).spec


def resolve(config: ml_collections.ConfigDict, devices: Sequence | None = None,
            device_memory: int | None = None) -> Resolved:
  """Validates `config` and returns the RunSpec with the run's inputs.

  Args:
    config: the experiment ConfigDict (see `configs/arith.py`).
    devices: devices to plan meshes on (default `jax.devices()`); only counted,
      nothing is placed or compiled.
    device_memory: bytes of one sampler device, for
      `sampler.kv_memory_fraction` (default: what the devices report).

  Raises:
    ConfigError: naming the key, for any invalid or inconsistent setting.
  """
  cfg = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else dict(config)
  top_keys = sections.keys("<top level>")
  unknown = sorted(set(cfg) - set(top_keys) - set(sections.top_level()))
  _require(not unknown, "<top level>", f"unknown key(s) {unknown}; known keys: "
           f"{sorted(top_keys + sections.top_level())}")
  for key in sections.required_keys("<top level>"):
    _require(key in cfg, key, "missing")
  run = _wrap("<top level>", sections.RunSection, **{k: cfg[k] for k in top_keys if k in cfg})
  for name in run.writer_names:
    try:
      writer_lib.check_available(name)
    except ImportError as e:
      raise ConfigError(f"config.writers: {e}") from e
  env_cfg = cfg.get("env", {})
  _require("name" in env_cfg, "env.name", "missing")
  _require(env_cfg["name"] in registry.ENVS, "env.name",
           f"unknown environment {env_cfg['name']!r}; known: {sorted(registry.ENVS)}")
  env_entry = registry.ENVS[env_cfg["name"]]
  env_fields = tuple(f.name for f in dataclasses.fields(env_entry.config_cls) if f.init)
  for name in sections.SECTIONS:
    _check_keys(cfg, name, env_fields if name == "env" else ())
  # Each section's first dataclass (the sampler's `EngineConfig`, with the
  # orchestrator's group size and the run's seed; `SamplingSettings` waits for
  # the tokenizer's tokens, in `_spec`).
  parts = {name: _build(cfg, name, classes[0])
           for name, classes in sections.SECTIONS.items() if name != "sampler"}
  parts["sampler"] = _build(cfg, "sampler", sections.SECTIONS["sampler"][0],
                            group_size=parts["orchestrator"].group_size, seed=run.seed)
  env = _wrap("env", env_entry.config_cls,
              **{k: v for k, v in env_cfg.items() if k not in sections.keys("env")})
  tokenizer = _tokenizer(parts["tokenizer"])
  model = dataclasses.replace(_model(parts["model"], tokenizer), lora=parts["learner.lora"])
  inputs, data = _inputs(parts, env_entry, env, tokenizer, eval_size=run.eval_size)
  _require(parts["sampler"].prompt_len + parts["sampler"].max_new_tokens <= model.max_seq_len,
           "sampler.prompt_len", f"prompt_len + max_new_tokens = "
           f"{parts['sampler'].prompt_len + parts['sampler'].max_new_tokens} exceeds the model "
           f"context model.max_seq_len={model.max_seq_len}")
  spec = _spec(cfg, run, parts, env=env, model=model, data=data, inputs=inputs)
  learner_devices, sampler_devices, sampler_shape, fsdp = _check_meshes(spec, parts, devices)
  layout, attention = spec.loss.layout, spec.loss.scoring.attention
  if layout.pack_len:
    # Each minibatch packed on its own, into rows its microbatches and the
    # learner's data shards split evenly.
    spec = dataclasses.replace(spec, packing=packing_lib.Packing(
        pack_len=layout.pack_len, num_slices=layout.num_minibatches,
        row_multiple=layout.num_microbatches * fsdp,
        attention_width=packing_lib.attention_width(spec.model)))
  # (devices being planned, `--dry_run_devices` or a launcher's check, have no
  # platform: the kernels' platform checks wait for the real ones)
  learner_platforms = sorted({getattr(d, "platform", "?") for d in learner_devices})
  if attention == "auto":  # the platform's kernel (XLA where there is none)
    kernel = {("tpu",): "splash", ("gpu",): "pallas_gpu"}.get(tuple(learner_platforms), "xla")
    spec = dataclasses.replace(spec, loss=dataclasses.replace(
        spec.loss, scoring=dataclasses.replace(spec.loss.scoring, attention=kernel)))
  learner_planned = learner_platforms == ["?"]
  _require(attention != "splash" or learner_platforms == ["tpu"] or learner_planned,
           "learner.attention", f"'splash' is the TPU kernel; the learner devices are "
           f"{learner_platforms} (use 'xla', or 'splash_interpret' to run it slowly anywhere)")
  _require(attention != "pallas_gpu" or learner_platforms == ["gpu"] or learner_planned,
           "learner.attention", f"'pallas_gpu' is the GPU kernel; the learner devices are "
           f"{learner_platforms} (use 'xla', or 'pallas_gpu_interpret' to run it slowly "
           "anywhere)")
  platforms = sorted({getattr(d, "platform", "?") for d in sampler_devices})
  planned = platforms == ["?"]
  kernel = parts["sampler"].paged_attention
  _require(kernel != "pallas" or platforms == ["gpu"] or planned,
           "sampler.paged_attention", f"'pallas' is the GPU kernel; the sampler devices are "
           f"{platforms} (use 'xla', or 'pallas_interpret' to run it slowly anywhere)")
  _require(kernel != "ragged" or platforms == ["tpu"] or planned,
           "sampler.paged_attention", f"'ragged' is the TPU kernel; the sampler devices are "
           f"{platforms} (use 'xla'; JAX's TPU interpret mode cannot run this kernel)")
  if kernel == "ragged":  # (per device: the heads of one `tp` shard)
    m, tp = spec.sampler_model, sampler_shape.get("tp", 1)
    problem = paged_attention_lib.ragged_geometry_problem(
        num_heads=m.num_heads // tp, num_kv_heads=m.num_kv_heads // tp, head_dim=m.head_dim,
        dtype=m.param_dtype)
    _require(problem is None, "sampler.paged_attention", f"'ragged': {problem} (use 'xla')")
  engine, choices = auto_settings.resolve(spec.engine, num_params=spec.sampler_model.num_params,
                                         platform=None if planned else platforms[0])
  spec = dataclasses.replace(spec, engine=engine, choices=choices,
                             kv_cache_setting=spec.engine.kv_cache)
  if engine.kv_memory_fraction:
    spec = _size_kv_pool(spec, engine.kv_memory_fraction, sampler_shape.get("tp", 1),
                         device_memory or mesh_lib.reported_memory(sampler_devices))
  return Resolved(spec=spec, inputs=inputs)


def _tokenizer(cfg: tokenizer_lib.TokenizerConfig):
  try:
    return tokenizer_lib.make_tokenizer(cfg)
  except (OSError, ValueError, ImportError) as e:
    raise ConfigError(f"config.tokenizer: {e}") from e


def _model(m: sections.ModelSection, tokenizer) -> model_config_lib.ModelConfig:
  """The decoder: from the `model` keys, or from `model.hf_path`'s config.json."""
  if not m.hf_path:
    return _wrap("model", model_config_lib.ModelConfig, vocab_size=tokenizer.vocab_size,
                 **m.shape(), max_seq_len=m.max_seq_len, param_dtype=m.param_dtype,
                 value_head=m.value_head)
  try:
    hf = hf_config.read_config(m.hf_path)
  except (OSError, ValueError) as e:
    raise ConfigError(f"config.model.hf_path: {e}") from e
  model = _wrap("model.hf_path", hf_config.model_config_from_hf, hf=hf,
                param_dtype=m.param_dtype, max_seq_len=m.max_seq_len, value_head=m.value_head,
                where=os.path.join(m.hf_path, "config.json"))
  _require(tokenizer.vocab_size <= model.vocab_size, "tokenizer",
           f"{tokenizer.vocab_size} tokens, more than the model's vocab_size "
           f"{model.vocab_size} ({m.hf_path}/config.json)")
  return model


def _inputs(parts: dict, env_entry, env, tokenizer, *, eval_size: int):
  """Loads both prompt splits and checks them against the sampler (prompts
  measured the way the environment encodes them, so the check cannot drift
  from what the sampler and the warm-up receive). Returns the run's inputs
  and the data config (with the file lines too long to sample)."""
  name, s, data = parts["env"].name, parts["sampler"], parts["data"]
  _require(not (data.num_epochs and name == "mixture"), "data.num_epochs",
           "a mixture streams its environments endlessly (by weight); use 0")
  eval_env = env_entry.make_env_fn(env, tokenizer, for_eval=True)
  loaded = {}
  for split in env_api.SPLITS:
    key = f"data.{split}_path" if data.path(split) else "env"
    try:
      prompts = prompt_source.load(name, env, data, split)
      # A file's prompt too long for the sampler is a bad line of the file
      # (named; skipped with data.on_malformed='skip'); the env's own are checked below.
      data, prompts = prompt_source.drop_long_prompts(
          data, prompts, lambda p: len(eval_env.encode_prompt(p)), s.prompt_len)
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.{key}: {e}") from e
    _require(bool(prompts.prompts), key,
             f"env {name!r} has no {split!r} prompts with these settings")
    loaded[split] = prompts
  every = [p for split in env_api.SPLITS for p in loaded[split].prompts]
  longest = max(len(eval_env.encode_prompt(p)) for p in every)
  _require(longest <= s.prompt_len, "sampler.prompt_len",
           f"a prompt of env {name!r} has {longest} tokens, longer than "
           f"sampler.prompt_len={s.prompt_len}")
  demonstrations = [eval_env.demonstration(p) for p in every]
  known = [d for d in demonstrations if d is not None]
  _require(len(known) == len(every) or not parts["warmup"].steps, "warmup.steps",
           f"env {name!r} knows no correct completion for {len(every) - len(known)} prompt(s) "
           "(Environment.demonstration), so it cannot warm up on them; set warmup.steps=0")
  longest_answer = max((len(d.completion_ids) for d in known), default=0)
  _require(longest_answer <= s.max_new_tokens, "sampler.max_new_tokens",
           f"the longest correct answer of env {name!r} needs {longest_answer} tokens (EOS "
           f"included), more than sampler.max_new_tokens={s.max_new_tokens}: it could never "
           "be rewarded")
  train_env = env_entry.make_env_fn(env, tokenizer)
  if parts["judge"].enabled:  # (its verdict joins the training reward; evaluation keeps the env's)
    train_env = _wrap("judge", judged_env.JudgedEnvironment.make, env=train_env,
                      cfg=parts["judge"], tokenizer=tokenizer)
  inputs = inputs_lib.Inputs(
      tokenizer=tokenizer, env=train_env, eval_env=eval_env,
      train=loaded["train"], heldout=loaded["heldout"],
      eval_prompts=inputs_lib.eval_prompts(eval_env, loaded["heldout"].prompts, eval_size))
  return inputs, data


def _spec(config: Mapping, run: sections.RunSection, parts: dict, *, env, model, data,
          inputs) -> RunSpec:
  """The components' settings, with the checks that span sections."""
  o, s = parts["orchestrator"], parts["sampler"]
  loss_name = parts["learner"].loss  # (the section's first dataclass: its `Objective`)
  g = o.group_size
  _require(s.num_slots >= g and s.num_slots % g == 0, "sampler.num_slots",
           f"{s.num_slots} must be a positive multiple of orchestrator.group_size={g}")
  _require(o.overlong_buffer < s.max_new_tokens, "orchestrator.overlong_buffer",
           f"{o.overlong_buffer} tokens: not below sampler.max_new_tokens={s.max_new_tokens}")
  _require(not model.value_head or loss_name == "vtrace", "model.value_head",
           f"a critic is trained only by learner.loss='vtrace', got {loss_name!r}")
  _require(not model.lora.init_from or model.lora.enabled, "learner.lora.init_from",
           "starts adapters from a PEFT folder: it needs learner.lora.rank > 0")
  if model.lora.init_from:
    try:
      peft_adapters.check_matches(model.lora.init_from, model.lora)
    except (OSError, ValueError) as e:
      raise ConfigError(f"config.learner.lora.init_from: {e}") from e
  tokenizer, eval_env = inputs.tokenizer, inputs.eval_env
  sampling = _build(config, "sampler", sampling_lib.SamplingSettings, eos_id=tokenizer.eos_id,
                    pad_id=tokenizer.pad_id,
                    stop_ids=env_api.sampler_stop_ids(tokenizer, eval_env))
  loss = _loss(config, parts["learner"], s, sampling, model)
  slices = loss.layout.num_minibatches * loss.layout.num_microbatches
  _require(o.batch_size % slices == 0, "learner.num_microbatches",
           f"orchestrator.batch_size={o.batch_size} rows do not split into num_minibatches x "
           f"num_microbatches = {slices} equal slices")
  try:
    parts["agent"].check_runnable(remote_sampler=parts["fleet"].remote)
    parts["replay"].check_runnable(eval_env.multi_turn, parts["fleet"], parts["agent"])
  except ValueError as e:
    raise ConfigError(f"config.{e}") from e
  return RunSpec(
      run=run, checkpoint=parts["checkpoint"],
      fleet=parts["fleet"], model=model,
      model_hf_path=parts["model"].hf_path, mesh=_mesh(parts["mesh"]), env_name=parts["env"].name,
      env=env, data=data, tokenizer=parts["tokenizer"], num_env_workers=parts["env"].num_workers,
      env_timeout_s=float(parts["env"].timeout_s),
      # (kv_cache and decode_burst, if auto, are chosen once the sampler's
      # platform is known: `auto_settings.resolve`)
      engine=dataclasses.replace(s, multi_turn=eval_env.multi_turn),
      # (the sampler runs every parameter in its dtype, the base included)
      sampler_model=dataclasses.replace(model, param_dtype=s.param_dtype,
                                        lora=dataclasses.replace(model.lora, base_dtype="auto")),
      sampling=sampling,
      orchestrator=o,
      loss=loss, packing=None, optim=_build(config, "learner", optim_lib.OptimConfig),
      warmup=parts["warmup"], warmup_optim=_build(config, "warmup", sections.WarmupOptim),
      agent=parts["agent"], replay=parts["replay"])


def _loss(config: Mapping, objective: loss_settings_lib.Objective,
          engine: engine_config.EngineConfig, sampling: sampling_lib.SamplingSettings,
          model) -> loss_settings_lib.LossSettings:
  """The learner section's loss parts, `objective` with its derived fields."""
  parts = {name: _build(config, "learner", part)
           for name, part in loss_settings_lib.PARTS.items() if name != "objective"}
  objective = dataclasses.replace(objective, critic=model.value_head,
                                  norm_constant=float(engine.max_new_tokens),
                                  temperature=float(sampling.temperature))
  knobs = tuple(_build(config, "learner", cls) for cls in loss_registry.KNOBS)
  return _wrap("learner", loss_settings_lib.LossSettings, objective=objective, knobs=knobs,
               **parts)


def _mesh(mesh: mesh_lib.MeshConfig) -> mesh_lib.MeshConfig:
  """The mesh section with its axes as tuples (a config writes lists)."""
  return dataclasses.replace(
      mesh, learner=tuple((str(a), int(n)) for a, n in mesh.learner),
      sampler=tuple((str(a), int(n)) for a, n in mesh.sampler))


def _check_meshes(spec: RunSpec, parts: dict, devices: Sequence | None
                  ) -> tuple[list, list, dict, int]:
  """Plans the meshes now (counting devices only), so that a mesh needing more
  devices than exist fails here, not after compilation; returns the learner's
  and the sampler's devices, the sampler's mesh shape, and the size of the
  learner's fsdp axis."""
  try:
    learner_devs, sampler_devs = mesh_lib.role_devices(spec.mesh, devices)
    learner_shape = dict(mesh_lib.resolve_shape(spec.mesh.learner, len(learner_devs), "learner"))
    sampler_shape = dict(mesh_lib.resolve_shape(spec.mesh.sampler, len(sampler_devs), "sampler"))
  except ValueError as e:
    raise ConfigError(f"config.{e}") from e
  fsdp, batch = learner_shape.get("fsdp", 1), parts["orchestrator"].batch_size
  _require(batch % fsdp == 0, "orchestrator.batch_size",
           f"{batch} rows do not split over the learner's fsdp axis of size {fsdp}")
  w = spec.warmup
  _require(w.steps == 0 or w.batch_size % fsdp == 0, "warmup.batch_size",
           f"{w.batch_size} rows do not split over the learner's fsdp axis of size {fsdp}")
  data = sampler_shape.get("data", 1)
  _require(spec.engine.num_slots % data == 0, "sampler.num_slots",
           f"{spec.engine.num_slots} slots do not split over the sampler's data axis of "
           f"size {data}")
  return learner_devs, sampler_devs, sampler_shape, fsdp


def unknown_key_message(argv: Sequence[str], error: Exception) -> str:
  """One line for a `--config.<key>=...` override of a key the config lacks.

  ml_collections raises an AttributeError around a KeyError whose text is the
  bare key, quoted, and maybe a second line with a suggestion.
  """
  inner = error.args[0] if error.args and isinstance(error.args[0], BaseException) else error
  text = str(inner.args[0]) if inner.args else str(inner)
  lines = text.splitlines() or ["?"]
  key, hint = lines[0].strip("'\""), " ".join(line.strip() for line in lines[1:])
  overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
  named = [o for o in overrides if o.split(".")[-1] == key] or overrides
  return (f"{', '.join(named)}: the config has no key {key!r}" + (f" ({hint})" if hint else "")
          + " (--dry_run lists its keys)")


def _size_kv_pool(spec: RunSpec, fraction: float, tp: int, device_memory: int | None) -> RunSpec:
  """`spec` with a paged KV pool of `fraction` of a sampler device's memory."""
  key = "sampler.kv_memory_fraction"
  _require(device_memory is not None, key,
           f"={fraction} needs the sampler devices' memory, which they do not report (a CPU "
           "backend, or devices being planned): set sampler.kv_pages instead, or give "
           "--dry_run_device=KIND or --dry_run_device_gib=N")
  page_bytes = spec.engine.page_size * engine_config.kv_bytes_per_column(spec.sampler_model, tp)
  pages = max(int(fraction * device_memory) // page_bytes, 1)
  try:
    engine = dataclasses.replace(spec.engine, kv_pages=pages, kv_memory_fraction=0.0)
  except ValueError as e:  # a pool too small for one sequence
    raise ConfigError(f"config.{key}: {fraction} of {device_memory / 2**30:.2f} GiB makes "
                      f"{pages} pages of {page_bytes} bytes; {e}") from e
  return dataclasses.replace(spec, engine=engine)
