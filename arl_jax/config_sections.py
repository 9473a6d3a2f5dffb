"""The config's schema: one frozen dataclass per section of an experiment file.

A section's fields are its keys, listed here once: `config_lib.build` checks a
config's keys against them (unknown keys are errors), and a field without a
default must be given. Each section checks its own values in `__post_init__`
and names the key it refuses (`sampler.top_p: must be in (0, 1], got 0.0`);
checks that span sections (a batch that must split over the learner's fsdp
axis, a prompt that must fit the sampler) are `config_lib.build`'s.

The sections `mesh`, `data`, `tokenizer` and `checkpoint` are the dataclasses
their components take as they are (`mesh_lib.MeshConfig`,
`prompt_source.DataConfig`, `tokenizer.TokenizerConfig`,
`checkpointing.CheckpointConfig`); the others are turned into their
components' settings by `config_lib.build`.
"""

from __future__ import annotations

import dataclasses

from arl_jax import advantages as advantages_lib
from arl_jax import checkpointing
from arl_jax.envs import prompt_source
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.learner import losses as losses_lib
from arl_jax.metrics import writer as writer_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import paged_names
from arl_jax.models import segment_attention as segment_attention_lib
from arl_jax.orchestrator import buffer as buffer_lib
from arl_jax.orchestrator import staleness
from arl_jax.sampler import engine_config, weight_updates
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
    writers: metric sinks besides the progress line, comma-separated
      (`metrics/writer.py`; JSON lines always).
    compilation_cache: JAX's persistent compilation cache: "auto" (the
      folder JAX is told to use, else `~/.cache/arl_jax/jit`), a folder, or
      "" (off); a second start of the same config reads its programs
      instead of compiling them (`compile_cache.py`).
  """

  seed: int
  num_steps: int
  log_every: int
  eval_every: int
  eval_size: int
  writers: str = "jsonl"
  compilation_cache: str = "auto"

  def __post_init__(self):
    _check(isinstance(self.compilation_cache, str), "compilation_cache",
           f"must be 'auto', a folder or '' (off), got {self.compilation_cache!r}")
    for key in ("num_steps", "log_every", "eval_every", "eval_size"):
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
  gives it (`hf_path`: then the shape keys come from its config.json)."""

  d_model: int | None = None
  num_layers: int | None = None
  num_heads: int | None = None
  num_kv_heads: int | None = None
  head_dim: int | None = None
  mlp_dim: int | None = None
  rope_theta: float | None = None
  tie_embeddings: bool | None = None
  max_seq_len: int
  param_dtype: str
  value_head: bool
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
  num_workers: int
  timeout_s: float

  def __post_init__(self):
    _check(_is_int(self.num_workers) and self.num_workers >= 1, "env.num_workers",
           f"must be an int >= 1, got {self.num_workers!r}")
    _check(self.timeout_s >= 0, "env.timeout_s",
           f"must be >= 0 (0: no limit), got {self.timeout_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerSection:
  """The `sampler` section (`sampler/engine.py`, `sampler/sampling.py`)."""

  num_slots: int
  prompt_len: int
  prompt_buckets: tuple[int, ...]
  max_new_tokens: int
  temperature: float
  top_k: int
  top_p: float
  weight_update: str
  kv_policy: str
  param_dtype: str
  # Compile every program shape the engine can use at its start
  # (`sampler/precompile.py`), so that no rare shape compiles late in a run.
  precompile: bool = True
  # The KV cache (`sampler/engine_config.py`): "dense" (every slot holds
  # prompt_len + max_new_tokens columns; a decode step attends over all of
  # them) or "paged" (slots take pages of `page_size` columns from a pool of
  # `kv_pages` as they grow, 0: enough for every slot at full length; a step
  # attends over the longest live context; a full pool preempts the youngest
  # slot); "auto": paged from 1,024 columns a slot (`sampler/auto_settings.py`).
  kv_cache: str = "auto"
  page_size: int = 16
  kv_pages: int = 0
  # Paged: the pool takes this fraction of a sampler device's memory instead
  # of `kv_pages` (0: off); `--dry_run` prints the pages it makes.
  kv_memory_fraction: float = 0.0
  # The samples of a group are prefilled once; the others start from that
  # prefill (and, paged, share the prompt's pages): `sampler/engine.py`.
  share_prompts: bool = True
  # Decode steps per device call while nothing waits between steps (one host
  # round trip per burst; a publish or new work waits for the burst's end);
  # 0: auto, 4 where a decode step is estimated under a host round trip.
  decode_burst: int = 0
  # Contexts wider than this many columns are prefilled a chunk per engine
  # iteration, between decode steps of the other slots (0: in one call).
  prefill_chunk: int = 0
  # Paged: decode attention through the decoder's XLA code ("xla") or JAX's
  # Pallas kernels: "pallas" (paged attention, GPU sampler devices only),
  # "ragged" (ragged paged attention over an interleaved pool, TPU only).
  paged_attention: str = "xla"

  def __post_init__(self):
    object.__setattr__(self, "prompt_buckets", tuple(int(b) for b in self.prompt_buckets))
    _check(isinstance(self.kv_memory_fraction, (int, float))
           and 0 <= self.kv_memory_fraction < 1, "sampler.kv_memory_fraction",
           f"must be in [0, 1) (0: off), got {self.kv_memory_fraction!r}")
    _check(not self.kv_memory_fraction or self.kv_cache != "dense",
           "sampler.kv_memory_fraction", "sizes a paged KV pool: it needs kv_cache='paged' "
           "(or 'auto')")
    _check(not (self.kv_memory_fraction and self.kv_pages), "sampler.kv_memory_fraction",
           f"and sampler.kv_pages={self.kv_pages} both size the pool: set one of them")
    _check(_is_int(self.decode_burst) and self.decode_burst >= 0,
           "sampler.decode_burst", f"must be an int >= 1 (0: auto), got {self.decode_burst!r}")
    _check(_is_int(self.prefill_chunk) and self.prefill_chunk >= 0, "sampler.prefill_chunk",
           f"must be an int >= 0 (0: off), got {self.prefill_chunk!r}")
    _check(self.paged_attention in paged_names.ATTENTIONS, "sampler.paged_attention",
           f"must be one of {paged_names.ATTENTIONS}, got {self.paged_attention!r}")
    _check(self.paged_attention == "xla" or self.kv_cache != "dense", "sampler.paged_attention",
           f"={self.paged_attention!r} reads a paged pool: it needs kv_cache='paged' (or 'auto')")
    _check(isinstance(self.share_prompts, bool), "sampler.share_prompts",
           f"must be True or False, got {self.share_prompts!r}")
    _check(self.kv_cache in (*engine_config.KV_CACHES, "auto"), "sampler.kv_cache",
           f"must be one of {(*engine_config.KV_CACHES, 'auto')}, got {self.kv_cache!r}")
    _check(isinstance(self.page_size, int) and self.page_size >= 1, "sampler.page_size",
           f"must be an int >= 1, got {self.page_size!r}")
    _check(isinstance(self.kv_pages, int) and self.kv_pages >= 0, "sampler.kv_pages",
           f"must be an int >= 0 (0: every slot at full length), got {self.kv_pages!r}")
    _check(self.weight_update in weight_updates.WEIGHT_UPDATE_MODES, "sampler.weight_update",
           f"must be one of {weight_updates.WEIGHT_UPDATE_MODES}, got {self.weight_update!r}")
    _check(self.kv_policy in weight_updates.KV_POLICIES, "sampler.kv_policy",
           f"must be one of {weight_updates.KV_POLICIES}, got {self.kv_policy!r}")
    _check(self.param_dtype in ("float32", "bfloat16"), "sampler.param_dtype",
           f"must be float32 or bfloat16, got {self.param_dtype!r}")
    _check(self.top_k >= 0, "sampler.top_k", f"must be >= 0 (0: off), got {self.top_k}")
    _check(0.0 < self.top_p <= 1.0, "sampler.top_p", f"must be in (0, 1], got {self.top_p}")
    _check(all(0 < b <= self.prompt_len for b in self.prompt_buckets), "sampler.prompt_buckets",
           f"{self.prompt_buckets}: every bucket must be in [1, sampler.prompt_len="
           f"{self.prompt_len}]")
    _check(self.max_new_tokens >= 1, "sampler.max_new_tokens", "must be >= 1")
    _check(self.temperature > 0, "sampler.temperature", f"must be > 0, got {self.temperature}")
    _check(isinstance(self.precompile, bool), "sampler.precompile",
           f"must be True or False, got {self.precompile!r}")

  @property
  def buckets(self) -> tuple[int, ...]:
    """The prompt buckets, ascending, the longest prompt (`prompt_len`) included."""
    return tuple(sorted(set(self.prompt_buckets) | {int(self.prompt_len)}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OrchestratorSection:
  """The `orchestrator` section (dispatcher, buffer: `orchestrator/`)."""

  batch_size: int
  group_size: int
  max_async_level: int
  max_off_policy_steps: int
  staleness_reference: str
  assembly: str
  window_fraction: float
  requeue_dropped: int
  mask_truncated_completions: bool

  def __post_init__(self):
    g, batch = self.group_size, self.batch_size
    _check(g >= 2, "orchestrator.group_size",
           f"must be >= 2 (group-relative advantages need a baseline), got {g}")
    _check(batch > 0 and batch % g == 0, "orchestrator.batch_size",
           f"{batch} rollouts is not a positive multiple of orchestrator.group_size={g}")
    _check(self.max_off_policy_steps >= 0, "orchestrator.max_off_policy_steps",
           f"K must be >= 0, got {self.max_off_policy_steps}")
    _check(self.max_async_level >= 0, "orchestrator.max_async_level",
           f"must be >= 0, got {self.max_async_level}")
    _check(self.staleness_reference in staleness.REFERENCES, "orchestrator.staleness_reference",
           f"must be one of {staleness.REFERENCES}, got {self.staleness_reference!r}")
    _check(self.assembly in buffer_lib.ASSEMBLY_POLICIES, "orchestrator.assembly",
           f"must be one of {buffer_lib.ASSEMBLY_POLICIES}, got {self.assembly!r}")
    _check(0.0 < self.window_fraction <= 1.0, "orchestrator.window_fraction",
           f"must be in (0, 1], got {self.window_fraction}")
    _check(_is_int(self.requeue_dropped) and self.requeue_dropped >= 0,
           "orchestrator.requeue_dropped",
           f"must be an int >= 0 (times a dropped prompt is dispatched again), got "
           f"{self.requeue_dropped!r}")
    _check(isinstance(self.mask_truncated_completions, bool),
           "orchestrator.mask_truncated_completions",
           f"must be True or False, got {self.mask_truncated_completions!r}")

  @property
  def groups_per_batch(self) -> int:
    return self.batch_size // self.group_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerSection:
  """The `learner` section (losses, advantages, optimizer: `learner/`)."""

  loss: str
  eps_low: float
  eps_high: float
  dual_clip: float
  rho_bar: float
  c_bar: float
  lam: float
  vf_coef: float
  tau: float
  tis_cap: float
  age_decay: float
  decoupled: bool
  aggregation: str
  kl_coef: float
  entropy_coef: float
  advantage: str
  num_epochs: int
  num_minibatches: int
  num_microbatches: int
  lr: float
  b1: float
  b2: float
  weight_decay: float
  max_grad_norm: float
  # Tokens whose float32 logits are computed at once when scoring (0: every
  # token of a microbatch): `learner/logprobs.py`.
  logprob_chunk: int = 0
  # Rollouts packed into rows of up to this many tokens, several a row (0:
  # one rollout a padded row): `packing.py`.
  pack_len: int = 0
  # Queries whose attention scores exist at once (0: a whole row's):
  # `models/segment_attention.py`.
  attention_chunk: int = 0
  # What the backward pass keeps of each decoder block: none | block | dots.
  remat: str = "none"
  # The training attention: auto (the learner platform's kernel: splash on
  # TPU, pallas_gpu on GPU, xla elsewhere) | xla | splash (TPU) | pallas_gpu
  # (GPU) | splash_interpret, pallas_gpu_interpret (anywhere, slowly):
  # `models/segment_attention.py`.
  attention: str = "xla"
  # The decoder's blocks as one lax.scan over their stacked parameters: the
  # same numbers; the backward pass's scratch exists once, not per layer.
  scan_layers: bool = False

  def __post_init__(self):
    _check(isinstance(self.scan_layers, bool), "learner.scan_layers",
           f"must be True or False, got {self.scan_layers!r}")
    _check(_is_int(self.attention_chunk) and self.attention_chunk >= 0,
           "learner.attention_chunk",
           f"must be an int >= 0 (0: a whole row), got {self.attention_chunk!r}")
    _check(self.attention in ("auto",) + segment_attention_lib.KERNELS, "learner.attention",
           f"must be one of {('auto',) + segment_attention_lib.KERNELS}, got {self.attention!r}")
    _check(self.remat in decoder_lib.REMAT_POLICIES, "learner.remat",
           f"must be one of {sorted(decoder_lib.REMAT_POLICIES)}, got {self.remat!r}")
    _check(_is_int(self.pack_len) and self.pack_len >= 0, "learner.pack_len",
           f"must be an int >= 0 (0: padded rows), got {self.pack_len!r}")
    _check(_is_int(self.logprob_chunk) and self.logprob_chunk >= 0, "learner.logprob_chunk",
           f"must be an int >= 0 (0: off), got {self.logprob_chunk!r}")
    _check(self.loss in losses_lib.LOSSES, "learner.loss",
           f"unknown loss {self.loss!r}; known: {sorted(losses_lib.LOSSES)}")
    _check(self.advantage in advantages_lib.ADVANTAGE_ESTIMATORS, "learner.advantage",
           f"must be one of {advantages_lib.ADVANTAGE_ESTIMATORS}, got {self.advantage!r}")
    _check(0 <= self.eps_low < 1 and self.eps_high >= 0, "learner.eps_low",
           "clip ranges must satisfy 0 <= eps_low < 1 and eps_high >= 0")
    _check(self.dual_clip == 0 or self.dual_clip > 1, "learner.dual_clip",
           f"must be 0 (off) or > 1, got {self.dual_clip}")
    _check(self.rho_bar >= 1, "learner.rho_bar", f"must be >= 1, got {self.rho_bar}")
    _check(0 < self.c_bar <= self.rho_bar, "learner.c_bar",
           f"must be in (0, learner.rho_bar={self.rho_bar}], got {self.c_bar}")
    _check(0 <= self.lam <= 1, "learner.lam", f"must be in [0, 1], got {self.lam}")
    _check(self.vf_coef >= 0, "learner.vf_coef", f"must be >= 0, got {self.vf_coef}")
    _check(self.tau > 0, "learner.tau", f"must be > 0, got {self.tau}")
    _check(self.tis_cap == 0 or self.tis_cap >= 1, "learner.tis_cap",
           f"must be 0 (off) or >= 1, got {self.tis_cap}")
    for key in ("age_decay", "kl_coef", "entropy_coef"):
      _check(getattr(self, key) >= 0, f"learner.{key}", f"must be >= 0, got {getattr(self, key)}")
    _check(self.aggregation in losses_lib.AGGREGATIONS, "learner.aggregation",
           f"must be one of {losses_lib.AGGREGATIONS}, got {self.aggregation!r}")
    for key in ("num_epochs", "num_minibatches", "num_microbatches"):
      value = getattr(self, key)
      _check(_is_int(value) and value >= 1, f"learner.{key}",
             f"must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSection:
  """The `warmup` section: `steps` supervised updates on `fraction` of the
  train prompts before RL (0 steps: none)."""

  steps: int = 0
  batch_size: int = 64
  lr: float = 1e-3
  fraction: float = 0.3

  def __post_init__(self):
    _check(_is_int(self.steps) and self.steps >= 0, "warmup.steps", "must be an int >= 0")
    _check(0 < self.fraction <= 1, "warmup.fraction", "must be in (0, 1]")
    _check(self.lr > 0, "warmup.lr", "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FleetConfig:
  """The `fleet` section: where sampling runs (`distributed/fleet.py`).

  Attributes:
    remote: sample in sampler processes that join over the network instead of
      in the learner process (the learner's `mesh.sampler` devices then only
      stage each version in the samplers' layout, and each sampler process
      needs that many devices).
    host: interface the learner listens on (`0.0.0.0`: every interface, for
      samplers on other hosts; they are given this host's address).
    port: control port (0: any free port; the address is printed and written
      to `WORKDIR/fleet.json`).
    heartbeat_s: how often a sampler reports (stats; it is alive).
    timeout_s: a sampler silent this long is lost and its groups reassigned.
  """

  remote: bool = False
  host: str = "127.0.0.1"
  port: int = 0
  heartbeat_s: float = 0.5
  timeout_s: float = 20.0

  def __post_init__(self):
    if self.heartbeat_s <= 0:
      raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
    if self.timeout_s < 4 * self.heartbeat_s:
      raise ValueError(f"timeout_s={self.timeout_s} must be >= 4 x heartbeat_s="
                       f"{self.heartbeat_s}, or a busy sampler would be declared lost")
    if not 0 <= self.port < 65536:
      raise ValueError(f"port must be in [0, 65535], got {self.port}")


# Section name -> its dataclass. A section whose fields all have defaults may
# be left out of a config.
SECTIONS = {
    "model": ModelSection,
    "mesh": mesh_lib.MeshConfig,
    "env": EnvSection,
    "sampler": SamplerSection,
    "orchestrator": OrchestratorSection,
    "learner": LearnerSection,
    "warmup": WarmupSection,
    "data": prompt_source.DataConfig,
    "tokenizer": tokenizer_lib.TokenizerConfig,
    "checkpoint": checkpointing.CheckpointConfig,
    "fleet": FleetConfig,
}


def keys(section_cls) -> tuple[str, ...]:
  """The keys of a section: its dataclass's init fields."""
  return tuple(f.name for f in dataclasses.fields(section_cls) if f.init)


def required_keys(section_cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(section_cls)
               if f.init and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING)
