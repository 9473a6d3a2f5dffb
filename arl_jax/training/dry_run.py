"""`--dry_run`: validate a config and plan its run without compiling or training.

The plan says, per role, the mesh, and the memory one device needs: exact for
the arrays whose shapes and shardings are known before anything runs (params
under each role's rule table, AdamW moments, gradients and their
microbatch accumulator, the KL reference, the sampler's KV cache and slot
state, the evaluation's caches and the sampled pass's params copy:
`evaluation_bytes`), and labelled rough estimates for the learner's
activations (which depend on what XLA keeps for the backward pass) and the
evaluation's inserts. A device's busiest moment holds what its roles always
hold and the largest of the update's, an evaluation's and (on a CPU
backend) a compilation's own memory, which come one after the other
(`RolePlan.peak`). On a CPU backend the process itself (the runtime, the
compiled programs) shares the devices' memory and comes on top
(`process_plan.py`, rough); `benchmarks/memory.py` measures the
plan against a run. It reads no device memory and compiles nothing, so it
can plan a TPU config on a laptop: `num_devices` overrides the device count
it plans for.

With LoRA (`learner.lora.rank` > 0) the learner holds the frozen base once
and the adapters with their moments, gradients and reference; the sampler
holds the base once (none of its own where, colocated, it reads the
learner's) and each version's adapters; a publish moves the adapters alone,
with a critic's value head (`Plan.publish_bytes`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np

from arl_jax.config import run_spec
from arl_jax.models import init_lib, lora
from arl_jax.sampler import engine_config, sampling
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib
from arl_jax.training import evaluation, process_plan

_GIB = 1024**3
# The share of a device's memory a plan may take: XLA's own scratch,
# fragmentation and the runtime take the rest.
USABLE = 0.9


# What exists only while one program runs: the update's gradients, their
# accumulator and its activations; the greedy evaluation's cache and its
# inserts' fresh keys and values. The evaluation runs between updates, so a
# role's busiest moment holds one of the two, never both.
UPDATE = ("gradients", "gradient_accumulator", "activations_rough")
EVALUATION = ("eval_kv_cache", "eval_insert_rough")
# On a CPU backend, compiling a program (the update's, the largest) takes
# working memory while it lasts, before the program runs.
COMPILE = ("compile_rough",)


@dataclasses.dataclass(frozen=True)
class RolePlan:
  """One role's mesh and per-device memory (bytes), by component."""

  role: str
  mesh: tuple[tuple[str, int], ...]
  memory: dict[str, int]

  @property
  def total(self) -> int:
    """Every component together (as if the update and an evaluation ran at once)."""
    return sum(self.memory.values())

  @property
  def peak(self) -> int:
    """The role at its busiest: what it always holds, and the largest of the
    update's, the greedy evaluation's and a compilation's own memory
    (`UPDATE`, `EVALUATION`, `COMPILE`)."""
    phases = [sum(self.memory.get(name, 0) for name in names)
              for names in (UPDATE, EVALUATION, COMPILE)]
    return self.total - sum(phases) + max(phases)


@dataclasses.dataclass(frozen=True)
class Plan:
  num_devices: int
  colocated: bool
  num_params: int
  learner: RolePlan
  sampler: RolePlan
  trainable_params: int = 0  # (0: every parameter trains)
  publish_bytes: int = 0  # what each publish moves to the sampler (one replica)
  # The process itself where a device's memory is the host's (a CPU backend:
  # `process_plan.cpu_process_bytes`); 0 on accelerators.
  process: int = 0

  def per_device_peak(self) -> int:
    """Bytes on the busiest device at its busiest (`RolePlan.peak`; both
    roles on one device when colocated), with the process where it shares
    the device's memory."""
    if self.colocated:
      return self.learner.peak + self.sampler.peak + self.process
    return max(self.learner.peak, self.sampler.peak) + self.process

  def record(self) -> dict:
    """The plan as a `memory.jsonl` row (bytes per device): what a run
    measures is set beside it (`benchmarks/memory.py`)."""
    return {"phase": "plan", "num_devices": self.num_devices, "colocated": self.colocated,
            "learner_mesh": dict(self.learner.mesh), "sampler_mesh": dict(self.sampler.mesh),
            "learner": dict(self.learner.memory), "sampler": dict(self.sampler.memory),
            "process": self.process, "busiest_device_bytes": self.per_device_peak()}


def _abstract_state(cfg) -> object:
  """The model's parameter shapes and logical axes (`init_lib.abstract_model`),
  kept: `fit`'s searches plan the same model dozens of times, and tracing a
  7B decoder's init takes seconds. The context length does not shape a
  parameter, so it is left out of the key."""
  return _abstract_state_of(dataclasses.replace(cfg, max_seq_len=1))


@functools.lru_cache(maxsize=8)
def _abstract_state_of(cfg) -> object:
  return init_lib.abstract_model(cfg)[1]


def _sharded_bytes(abstract_state, mesh_shape: dict[str, int], rules, dtype) -> int:
  """Bytes of one device's shard of every parameter, stored in `dtype`."""
  itemsize = np.dtype(dtype).itemsize
  total = 0
  for variable in jax.tree.leaves(abstract_state, is_leaf=lambda x: hasattr(x, "get_metadata")):
    shape = variable.get_value().shape
    axes = variable.get_metadata()["logical_axes"]
    shard = []
    for dim, name in zip(shape, axes):
      size = mesh_shape.get(rules[name], 1)
      if dim % size:
        raise ValueError(f"a parameter of shape {shape}: dimension {dim} ({name}) does not "
                         f"divide by mesh axis {rules[name]!r} of size {size}")
      shard.append(dim // size)
    total += math.prod(shard) * itemsize
  return total


def plan(spec: run_spec.RunSpec, num_devices: int, *, cpu: bool = False) -> Plan:
  """Meshes and per-device memory of `spec` on `num_devices` devices; `cpu`:
  they are the host's memory, shared with the process itself
  (`process_plan.cpu_process_bytes`)."""
  learner_devices, sampler_devices = mesh_lib.split_devices(spec.mesh, range(num_devices))
  learner_mesh = mesh_lib.resolve_shape(spec.mesh.learner, len(learner_devices), "learner")
  sampler_mesh = mesh_lib.resolve_shape(spec.mesh.sampler, len(sampler_devices), "sampler")
  lm, sm = dict(learner_mesh), dict(sampler_mesh)
  abstract_state = _abstract_state(spec.model)
  trainable, frozen = lora.split(abstract_state)  # (without adapters: all, nothing)
  adapters = bool(jax.tree.leaves(frozen))

  # Learner: what trains, with AdamW's two moments and the gradients in the
  # param dtype; with LoRA the frozen base beside it, in its own dtype.
  params = _sharded_bytes(trainable, lm, rules_lib.LEARNER_RULES, spec.model.param_dtype)
  learner = {"params": params} if not adapters else {
      "frozen_base": _sharded_bytes(frozen, lm, rules_lib.LEARNER_RULES, spec.model.base_dtype),
      "adapters": params}
  learner.update(adam_moments=2 * params, gradients=params)
  if spec.loss.layout.num_microbatches > 1:
    # The scan over microbatches carries the sum beside each one's gradients.
    learner["gradient_accumulator"] = params
  if spec.loss.objective.kl_coef > 0:
    learner["kl_reference_params"] = params
  cfg, engine = spec.model, spec.engine
  learner["activations_rough"] = learner_activations(
      spec.model, spec.loss.scoring, *learner_rows(spec, lm.get("fsdp", 1)),
      param_shards=lm.get("fsdp", 1) * lm.get("tp", 1))

  # Sampler: params in its dtype (replicated over `data`); while a swap is in
  # progress the old and new versions coexist, and `pinned` holds up to K + 1.
  # With LoRA the base is resident once and only the adapters have versions.
  sampler_dtype = spec.sampler_model.param_dtype
  sampler_params = _sharded_bytes(trainable, sm, rules_lib.SAMPLER_RULES, sampler_dtype)
  versions = (spec.orchestrator.max_off_policy_steps + 1
              if engine.weight_update == "pinned" else 2)
  what = "adapters" if adapters else "params"
  colocated = learner_devices == sampler_devices
  sampler = {} if not adapters else _sampler_base(spec, frozen, lm, sm, colocated)
  data, tp = sm.get("data", 1), sm.get("tp", 1)
  slots = math.ceil(engine.num_slots / data)
  per_column = engine_config.kv_bytes_per_column(spec.sampler_model, tp)
  if engine.paged:
    # The pool is whole on every `data` shard (`PagedKVCache.logical_axes`).
    kv_name = f"kv_cache_paged_{engine.pool_pages}x{engine.page_size}"
    kv = engine.pool_pages * engine.page_size * per_column
  else:
    kv_name, kv = "kv_cache", slots * engine.length * per_column
  sampler.update({f"{what}_x{versions}_versions": versions * sampler_params, kv_name: kv,
                  "slot_state": sampling.slot_state_bytes(
                      spec.sampler_model, num_slots=slots, length=engine.length,
                      num_stop_ids=len(spec.sampling.stop_ids),
                      top_logprobs=spec.sampling.top_logprobs)})
  learner_eval, sampler_eval = evaluation_bytes(spec, lm, sm)
  learner.update(learner_eval)
  if cpu:
    learner["compile_rough"] = process_plan.compile_transient_bytes(spec)
  sampler.update(sampler_eval)
  publish = _sharded_bytes(trainable, {}, rules_lib.SAMPLER_RULES, sampler_dtype)
  return Plan(num_devices=num_devices, colocated=colocated,
              num_params=cfg.num_params,
              learner=RolePlan("learner", learner_mesh, learner),
              sampler=RolePlan("sampler", sampler_mesh, sampler),
              trainable_params=cfg.trainable_params if adapters else 0, publish_bytes=publish,
              process=process_plan.cpu_process_bytes(spec) if cpu else 0)


def _sampler_base(spec: run_spec.RunSpec, frozen, lm: dict, sm: dict, colocated: bool) -> dict:
  """The sampler's LoRA base: `base_from_learner` (nothing more) where a
  colocated sampler in the base's dtype reads the learner's own arrays, both
  roles holding it whole on each device (`publish.shares_base` decides in
  the run, and also shares other equal layouts); else its own `base`."""
  dtype = spec.sampler_model.param_dtype
  own = _sharded_bytes(frozen, sm, rules_lib.SAMPLER_RULES, dtype)
  whole = _sharded_bytes(frozen, {}, rules_lib.SAMPLER_RULES, dtype)
  if (colocated and np.dtype(dtype) == np.dtype(spec.model.base_dtype) and own == whole
      and _sharded_bytes(frozen, lm, rules_lib.LEARNER_RULES, dtype) == whole):
    return {"base_from_learner": 0}
  return {"base": own}


def evaluation_bytes(spec: run_spec.RunSpec, lm: dict, sm: dict) -> tuple[dict, dict]:
  """`(learner, sampler)` bytes per device of the held-out evaluation
  (`evaluation.Evaluator`; as one controller lays it out): the greedy
  pass's dense KV cache, one slot a prompt (at most `eval_slots`), and its
  widest insert's, on the learner mesh (between updates); with
  `eval_samples` the sampled pass beside training on the sampler mesh: a
  whole copy of the params it evaluates (the sampler's dtype) and its cache
  of groups of `eval_samples` slots."""
  if not (spec.run.eval_every and spec.run.eval_size):
    return {}, {}
  greedy = evaluation.greedy_engine_config(spec.engine, spec.run.eval_size, spec.run.eval_slots)
  per_column = engine_config.kv_bytes_per_column(spec.model, lm.get("tp", 1))
  learner = {"eval_kv_cache": greedy.num_slots * greedy.length * per_column,
             # An insert's fresh keys and values of every layer, and their
             # copy moved to column 0 (`sampling.insert`), at its widest.
             "eval_insert_rough": 2 * greedy.insert_rows * max(greedy.prompt_buckets) * per_column}
  if not spec.run.eval_samples:
    return learner, {}
  sampled = evaluation.sampled_engine_config(spec.engine, spec.run.eval_size, spec.run.eval_samples)
  abstract_state = _abstract_state(spec.model)
  return learner, {
      "eval_sampled_params": _sharded_bytes(abstract_state, sm, rules_lib.SAMPLER_RULES,
                                            spec.sampler_model.param_dtype),
      "eval_sampled_kv_cache": math.ceil(sampled.num_slots / sm.get("data", 1)) * sampled.length
                               * engine_config.kv_bytes_per_column(spec.sampler_model,
                                                                   sm.get("tp", 1))}


def learner_rows(spec: run_spec.RunSpec, fsdp: int) -> tuple[int, int]:
  """`(rows, width)` of one microbatch on one learner device at its largest:
  rows of the longest rollouts (`prompt_len + max_new_tokens`), or packed
  rows as wide as they may get, split over `fsdp`."""
  loss, engine = spec.loss, spec.engine
  rows = spec.orchestrator.batch_size
  rows //= loss.layout.num_minibatches * loss.layout.num_microbatches
  rows = max(1, rows // fsdp)
  longest = engine.prompt_len + engine.max_new_tokens
  if spec.packing is None:
    return rows, longest
  width = max(spec.packing.pack_len, 1 << (longest - 1).bit_length())
  return max(1, math.ceil(rows * longest / width)), width


def learner_activations(cfg, scoring, rows: int, width: int, param_shards: int = 1) -> int:
  """Rough bytes of the activations of `rows x width` tokens of a decoder
  (`ModelConfig`) under `scoring` (`loss_settings.Scoring`) on one device.

  Per layer the backward pass keeps the block's saved inputs and outputs
  (all of them, the matmul outputs, or only the block's input:
  `learner.remat`), plus the attention scores of a whole row unless
  `learner.attention_chunk` computes them a block of queries at a time (then
  one block's exist at once, recomputed); then the float32 logits and their
  gradient, or a few `learner.logprob_chunk`s of them. One block's scratch
  counts once: a scan over the layers (`learner.scan_layers`) makes it so,
  for the price of a stacked copy of the blocks' parameters and its
  gradient (with LoRA: the adapters' only, and a copy of one layer's frozen
  base, which the scan picks a layer at a time; without remat the forward
  pass keeps every layer's copy for the backward, the trunk again; sharded
  as the parameters are: over `param_shards` devices);
  unrolled, XLA:CPU plans each layer's apart (`benchmarks/learner.py` part
  `long_row` measures both).
  """
  tokens = rows * width
  itemsize = np.dtype(cfg.param_dtype).itemsize
  block_internals = tokens * (8 * cfg.d_model + 3 * cfg.mlp_dim) * itemsize
  kept = {"none": block_internals, "dots": tokens * (4 * cfg.d_model + 2 * cfg.mlp_dim) * itemsize,
          "block": tokens * cfg.d_model * itemsize}[scoring.remat]
  total = cfg.num_layers * kept + (block_internals if scoring.remat != "none" else 0)
  scores = rows * cfg.num_heads * width * 4
  if scoring.attention_chunk:
    total += scores * min(scoring.attention_chunk, width)  # one block's, recomputed
  else:
    total += cfg.num_layers * scores * width
  if scoring.scan_layers:
    if cfg.lora.enabled:  # the adapters stacked with their gradient; the base a layer at a time
      base_copies = cfg.num_layers if scoring.remat == "none" else 1
      stacked = (base_copies * cfg.block_params * np.dtype(cfg.base_dtype).itemsize
                 + 2 * cfg.adapter_params * itemsize)
    else:
      stacked = 2 * cfg.num_layers * cfg.block_params * itemsize
    total += stacked // param_shards
  logit_tokens = min(scoring.logprob_chunk, tokens) if scoring.logprob_chunk else tokens
  return total + 3 * logit_tokens * cfg.vocab_size * 4


def format_plan(p: Plan, device_memory: int | None = None) -> str:
  """The plan as text; with `device_memory` (bytes), whether it fits."""
  lines = [f"devices: {p.num_devices} ({'colocated' if p.colocated else 'disaggregated'})",
           f"parameters: {p.num_params:,} ({p.num_params / 1e6:.2f}M)"]
  if p.trainable_params:
    lines.append(f"trained with LoRA: {p.trainable_params:,} parameters "
                 f"({100 * p.trainable_params / p.num_params:.2f}% of the base, frozen)")
  lines.append(f"each publish moves {p.publish_bytes / 2**20:,.1f} MiB to the sampler")
  for role in (p.learner, p.sampler):
    lines.append(f"{role.role} mesh {dict(role.mesh)}: {role.total / _GIB:.3f} GiB per device")
    lines += [f"  {name}: {size / _GIB:.3f} GiB" for name, size in role.memory.items()]
  if p.process:
    lines.append(f"process (a CPU backend: the runtime and compiled programs, rough): "
                 f"{p.process / _GIB:.3f} GiB")
  peak = p.per_device_peak()
  lines.append(f"busiest device: {peak / _GIB:.3f} GiB (what it always holds and the largest of "
               "the update's, an evaluation's and a compilation's"
               + ("; both roles share each device" if p.colocated else "")
               + ("; the process" if p.process else "") + ")")
  if device_memory:
    verdict = "fits" if peak <= USABLE * device_memory else "does NOT fit"
    lines.append(f"{verdict} in {device_memory / _GIB:.1f} GiB per device ({USABLE:.0%} usable)")
  return "\n".join(lines)
