"""Where a run starts: the restore order, and the checks on what it resumes.

1. This workdir's newest intact checkpoint (the whole run: learner state, open
   work, counters). Newer damaged steps are skipped, said so, and set aside.
2. `checkpoint.resume_from`, another folder's newest intact checkpoint.
3. `checkpoint.init_from`: another checkpoint's params only (version 0, a
   fresh optimizer and prompt stream).
4. `model.hf_path`: a Hugging Face folder's weights.
5. A random init (also the layout template that 1 and 2 restore onto).

With LoRA (`learner.lora.rank` > 0) 3-5 give the frozen base, and the
adapters start fresh (B = 0: the base model); a critic's value head, which
trains beside them, is the one 3-5 bring (trained, or zero). A checkpoint
holds what trains (the adapters and that head), so a resume reads its base
from 3-5 again, and refuses a
checkpoint trained on another base (its record names the base it was
trained on: `base_identity`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
from flax import nnx

from arl_jax.learner import checkpointing
from arl_jax.learner import train_state as train_state_lib
from arl_jax.models import fingerprint as fingerprint_lib
from arl_jax.models import hf_params, init_lib, peft_adapters
from arl_jax.models import lora as lora_lib
from arl_jax.orchestrator import work_record
from arl_jax.sharding import rules as rules_lib

# Config keys a resumed run may change without a warning: how long it runs,
# what it logs, where it saves, and how it is laid out on devices.
_FREE_TO_CHANGE = ("num_steps", "log_every", "eval_every", "eval_size", "writers", "checkpoint.",
                   "fleet.", "mesh.")


@dataclasses.dataclass(frozen=True)
class Checkpoints:
  """Attributes:
    saver: where this run saves (None: checkpointing is off).
    resume: what it resumes from (None: a fresh start).
    own: `resume` is this workdir's own folder (its records continue).
  """

  saver: checkpointing.Checkpointer | None
  resume: checkpointing.Checkpointer | None
  own: bool

  def close(self) -> None:
    if self.resume is not None and self.resume is not self.saver:
      self.resume.close()
    if self.saver is not None:
      self.saver.close()


def open_checkpoints(cfg: checkpointing.CheckpointConfig, workdir: str) -> Checkpoints:
  own = os.path.join(workdir, "checkpoints")
  saver = checkpointing.Checkpointer(own, cfg) if cfg.enabled else None
  if saver is not None and saver.latest_step() is not None:
    return Checkpoints(saver, saver, own=True)
  if not cfg.enabled and os.path.isdir(own):
    reader = checkpointing.Checkpointer(own, cfg)
    if reader.latest_step() is not None:
      return Checkpoints(None, reader, own=True)
    reader.close()
  if cfg.resume_from:
    return Checkpoints(saver, existing(cfg.resume_from, "checkpoint.resume_from", cfg), own=False)
  return Checkpoints(saver, None, own=False)


def existing(path: str, key: str, cfg) -> checkpointing.Checkpointer:
  """A checkpoint folder the config names, which must hold a checkpoint."""
  if not os.path.isdir(path):  # (a Checkpointer would create it)
    raise FileNotFoundError(f"{key}={path!r}: no such folder")
  reader = checkpointing.Checkpointer(path, cfg)
  if reader.latest_step() is None:
    raise FileNotFoundError(f"{key}={path!r}: no checkpoint there")
  return reader


def initial_params(spec, mesh, resuming: bool, print_fn):
  """`(graphdef, params)` a run starts from, laid out on the learner `mesh`
  (steps 3-5 of the restore order; a resume restores onto these): the
  model's base, and with LoRA fresh adapters beside it."""
  base = base_params(spec, mesh, resuming, print_fn)
  if not spec.model.lora.enabled:
    return init_lib.abstract_model(spec.model)[0], base
  rules, lora = rules_lib.LEARNER_RULES, spec.model.lora
  if lora.init_from and not resuming:
    graphdef = init_lib.abstract_model(spec.model)[0]
    adapters = peft_adapters.load(lora.init_from, spec.model, mesh, rules)
    print_fn(f"LoRA adapters from {lora.init_from}")
  else:  # (fresh, or the template a resume restores the saved ones onto)
    graphdef, adapters = init_lib.init_adapters(spec.model, mesh, rules, spec.run.seed)
  print_fn(f"LoRA: rank {spec.model.lora.rank} adapters on {', '.join(spec.model.lora.targets)}"
           f"{' and the value head' if spec.model.value_head else ''}"
           f" ({spec.model.trainable_params:,} trainable parameters; the base's "
           f"{spec.model.num_params - spec.model.value_head * spec.model.d_model:,} frozen)")
  if spec.model.value_head:
    # The critic the base brings (a checkpoint's trained head, else zero)
    # trains on beside the adapters, in their dtype (read in the base's:
    # a bfloat16 `base_dtype` rounds a float32 critic once, here).
    head, base = nnx.split_state(base, lora_lib.TrainsBesideAdapters, ...)
    adapters = nnx.split_state(adapters, lora_lib.LoraParam, ...)[0]
    base = nnx.merge_state(base, jax.tree.map(lambda x: x.astype(spec.model.param_dtype), head))
  return graphdef, lora_lib.merge(adapters, base)


def base_params(spec, mesh, resuming: bool, print_fn):
  """The model's params without adapters (steps 3-5 of the restore order)."""
  rules, model = rules_lib.LEARNER_RULES, spec.model.base
  # (a LoRA checkpoint holds no base: a resume reads it where the run first did)
  fresh_base = not resuming or spec.model.lora.enabled
  if fresh_base and spec.checkpoint.init_from:
    init = existing(spec.checkpoint.init_from, "checkpoint.init_from", spec.checkpoint)
    if "base" in init.read_run(init.latest_step()):
      raise checkpointing.CheckpointFormatError(
          f"checkpoint.init_from={spec.checkpoint.init_from}: its checkpoints hold LoRA adapters, "
          "not a model; merge them into their base (python -m arl_jax.export_hf --checkpoint=... "
          "--hf_path=BASE --out=FOLDER) and start from model.hf_path=FOLDER, or start the "
          "adapters from a PEFT folder (learner.lora.init_from)")
    _, abstract = init_lib.abstract_model(model)
    shardings = rules_lib.state_shardings(abstract, mesh, rules)
    params = init.restore_params(checkpointing.abstract_like(abstract, shardings))
    print_fn(f"initialised params from {init.directory} (step {init.latest_step()})")
    init.close()
    return params
  if fresh_base and spec.model_hf_path:
    start = time.monotonic()
    _, params = hf_params.load_params(spec.model_hf_path, model, mesh, rules)
    print_fn(f"imported {spec.model_hf_path} ({model.num_params / 1e6:.1f}M params, "
             f"{time.monotonic() - start:.1f}s)")
    return params
  return init_lib.init_params(model, mesh, rules, spec.run.seed)[1]


@dataclasses.dataclass(frozen=True)
class Beginning:
  """What a run starts from.

  Attributes:
    graphdef: the decoder's graph definition.
    params: the starting params (a fresh start: before any warm-up).
    restored: the checkpoint resumed (None: a fresh start).
    state_shardings: the restored TrainState's shardings (None: a fresh start).
    own: `restored` is this workdir's own (its records continue).
    base: a LoRA run's frozen base, identified (`base_identity`); None
      without adapters.
  """

  graphdef: object
  params: object
  restored: checkpointing.Restored | None = None
  state_shardings: object = None
  own: bool = False
  base: dict | None = None

  @property
  def version(self) -> int:
    return int(self.restored.run["version"]) if self.restored is not None else 0


def begin(spec, mesh, checkpoints: Checkpoints, *, optimizer, config: dict, set_aside: bool,
          print_fn) -> Beginning:
  """Follows the restore order (module docstring) onto the learner `mesh`."""
  resuming = checkpoints.resume is not None
  graphdef, params = initial_params(spec, mesh, resuming, print_fn)
  trainable, frozen = lora_lib.split(params)
  base = base_identity(spec, frozen) if spec.model.lora.enabled else None
  if not resuming:
    return Beginning(graphdef=graphdef, params=params, base=base)
  # Restored onto the layout of freshly initialised params (what trains: a
  # LoRA checkpoint holds the adapters, its base came from `initial_params`).
  state, state_shardings = train_state_lib.create(trainable, optimizer, mesh)
  restored = resume(checkpoints, state=state, state_shardings=state_shardings,
                    reference=state.params if spec.loss.objective.kl_coef > 0 else None,
                    config=config, print_fn=print_fn, set_aside=set_aside, base=base)
  print_fn(f"resumed from {checkpoints.resume.directory} at version {restored.run['version']}: "
           f"{restored.run['work'].describe()}")
  return Beginning(graphdef=graphdef, params=lora_lib.merge(restored.state.params, frozen),
                   restored=restored, state_shardings=state_shardings, own=checkpoints.own,
                   base=base)


def base_identity(spec, frozen) -> dict:
  """What identifies a LoRA run's frozen base: where it came from and its
  content fingerprint (`models/fingerprint.py`), saved in every checkpoint."""
  source = (f"checkpoint {spec.checkpoint.init_from}" if spec.checkpoint.init_from else
            f"Hugging Face folder {spec.model_hf_path}" if spec.model_hf_path else
            f"random init (seed {spec.run.seed})")
  return {"source": source, "fingerprint": fingerprint_lib.fingerprint(frozen)}


class AnotherBase(RuntimeError):
  """A checkpoint's adapters were trained on another base than this run's
  (or it holds adapters and this run has none, or the reverse)."""


def check_base(run: dict, base: dict | None, where: str) -> None:
  """Refuses to resume adapters onto a base other than the one they were
  trained on, before anything is restored (`run`: a checkpoint of `where`'s
  record).

  Raises:
    AnotherBase: naming both bases.
  """
  saved = run.get("base")
  if saved == base or (saved is not None and base is not None
                       and saved.get("fingerprint") == base["fingerprint"]):
    return
  if base is None:
    raise AnotherBase(
        f"{where} holds LoRA adapters (trained on {saved.get('source')}), but this run has no "
        "adapters (learner.lora.rank=0): resume it with the rank it was trained with")
  if saved is None:
    raise AnotherBase(
        f"{where} was saved by a run without LoRA adapters; this run trains adapters "
        "(learner.lora.rank > 0): set rank=0 to resume it, or start from its params with "
        "checkpoint.init_from")
  raise AnotherBase(
      f"{where} holds LoRA adapters trained on another base: {saved.get('source')} "
      f"(fingerprint {saved.get('fingerprint')}); this run's base is {base['source']} "
      f"(fingerprint {base['fingerprint']}). Adapters only mean something on the base they "
      "were trained on: resume with that base (model.hf_path, checkpoint.init_from, seed)")


def resume(checkpoints: Checkpoints, *, state, state_shardings, reference, config: dict,
           print_fn, set_aside: bool = True, base: dict | None = None) -> checkpointing.Restored:
  """Restores the newest intact checkpoint of `checkpoints.resume` onto the
  layout of `state` (and `reference`, the KL penalty's params, if any).

  Damaged newer steps are reported; in the run's own folder they are moved
  aside (`set_aside`), so that the steps this run saves next do not collide
  with them. A config that differs from the checkpoint's in what the run
  does (not how long, or where) is reported too. `base`: this run's LoRA
  base (`base_identity`), checked against each checkpoint's before its
  state is read (`check_base`).
  """
  reader = checkpoints.resume

  def check_run(run: dict) -> dict:
    check_base(run, base, reader.directory)
    return prepare_run_record(run)

  abstract_reference = None
  if reference is not None:
    abstract_reference = checkpointing.abstract_like(reference, state_shardings.params)
  restored = reader.restore_latest_intact(
      checkpointing.abstract_like(state, state_shardings),
      abstract_reference=abstract_reference, check_run_fn=check_run)
  for step, why in restored.skipped:
    print_fn(f"warning: skipped checkpoint step {step}: {why}")
  if restored.skipped and checkpoints.own and set_aside:
    where = reader.set_aside([step for step, _ in restored.skipped])
    print_fn(f"moved the skipped step(s) to {where}")
  saved_config = restored.run.get("config")
  if saved_config is not None:
    changes = config_changes(saved_config, config)
    if changes:
      print_fn("warning: resuming with a config that differs from the checkpoint's in "
               f"{', '.join(changes)}; the saved open work and prompt stream go on under the "
               "new settings")
  return restored


def prepare_run_record(run: dict) -> dict:
  """`run` in this code's format (records of format 2 are upgraded), its open
  work read into a `work_record.WorkRecord` (an untyped one of format 3
  included).

  Raises:
    KeyError, TypeError, work_record.WorkRecordError: naming the key, if
      `run` lacks what a resume reads.
  """
  if run.get("format_version") == 2:  # flat counters, no record positions or config
    flat = _require(run, "counters", dict)
    run = {**run, "format_version": checkpointing.FORMAT_VERSION, "counters": {
        "groups_trained": flat.get("groups_trained"),
        "rollouts": {"sampler": {k: flat.get(k) for k in ("cancelled_rollouts",
                                                          "cancelled_tokens",
                                                          "cancelled_sampled_tokens")},
                     "env": {"errors": flat.get("env_errors"),
                             "timeouts": flat.get("env_timeouts"),
                             "turns": flat.get("env_turns")}}}}
  check_run_record(run)
  return {**run, "work": work_record.WorkRecord.from_json(run["work"])}


def check_run_record(run: dict) -> None:
  """Raises (naming the key) if `run` lacks what a resume reads."""
  _require(run, "version", int)
  _require(run, "work", dict)  # (its fields: `work_record.WorkRecord.from_json`)
  _require(run, "drop_ledger", dict)
  counters = _require(run, "counters", dict)
  _require(counters, "groups_trained", int, "counters.groups_trained")
  rollouts = _require(counters, "rollouts", dict, "counters.rollouts")
  _require(rollouts, "sampler", dict, "counters.rollouts.sampler")
  _require(rollouts, "env", dict, "counters.rollouts.env")


def _require(mapping: dict, key: str, kind, name: str | None = None):
  name = name or key
  if key not in mapping:
    raise KeyError(f"{name} is missing")
  if not isinstance(mapping[key], kind) or (kind is int and isinstance(mapping[key], bool)):
    raise TypeError(f"{name} is {type(mapping[key]).__name__}, not {kind.__name__}")
  return mapping[key]


def config_changes(saved: dict, current: dict) -> list[str]:
  """`key: old -> new` for each setting that changed, except those a resumed
  run may change freely (`_FREE_TO_CHANGE`)."""
  old, new = _flat(_jsonable(saved)), _flat(_jsonable(current))
  changes = []
  for key in sorted(set(old) | set(new)):
    if key.startswith(_FREE_TO_CHANGE) or old.get(key) == new.get(key):
      continue
    changes.append(f"{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}")
  return changes


def _jsonable(value):
  return json.loads(json.dumps(value, default=str))


def _flat(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix.rstrip("."): tree}
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f"{prefix}{key}."))
  return out
