"""The sampler engine: a thread that turns group requests into rollouts.

It runs *waves*: up to `num_slots` rows (whole groups) are admitted, prefilled
together and decoded step by step. Between two decode steps it

- swaps to the newest published params when `weight_update = "in_flight"`
  (active sequences continue; their KV entries stay as computed, the `keep`
  policy; later tokens record the new version), and
- ends the rows of cancelled groups, freeing their compute at once.

With `weight_update = "drain"` the swap waits until the wave is finished.
Shapes are fixed (`num_slots` x prompt bucket + `max_new_tokens`), so neither
prefill nor decode recompiles in steady state. Continuous slot refill is the
sampler engine issue's next step.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arl_jax import rollout as rollout_lib
from arl_jax.orchestrator import dispatcher as dispatcher_lib
from arl_jax.sampler import param_swap, sampling

WEIGHT_UPDATE_MODES = ("in_flight", "drain")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Attributes:
    num_slots: rows decoded together (a multiple of the group size and of the
      sampler mesh's data axis).
    group_size: G, rollouts per group (a group is admitted whole).
    prompt_len: P, the prompt bucket; prompts are left-padded to it.
    max_new_tokens: N, completion budget.
    weight_update: `in_flight` or `drain`.
    seed: base of the per-rollout PRNG keys.
  """

  num_slots: int
  group_size: int
  prompt_len: int
  max_new_tokens: int
  weight_update: str = "in_flight"
  seed: int = 0


@dataclasses.dataclass
class EngineStats:
  waves: int = 0
  swaps: int = 0
  sampled_tokens: int = 0
  cancelled_rollouts: int = 0
  cancelled_tokens: int = 0
  busy_seconds: float = 0.0


def _batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  data = "data" if "data" in mesh.axis_names else None
  return NamedSharding(mesh, P(data, *([None] * (ndim - 1))))


def _decode_state_shardings(mesh: Mesh, abstract_state: sampling.DecodeState):
  """Slots over the `data` axis; KV heads over `tp` (like the attention weights)."""
  tp = "tp" if "tp" in mesh.axis_names else None
  data = "data" if "data" in mesh.axis_names else None

  def spec(path, leaf):
    if leaf.ndim == 0:
      return NamedSharding(mesh, P())
    if leaf.ndim == 4:  # cache keys / values [B, K, S, Dh]
      return NamedSharding(mesh, P(data, tp, None, None))
    return _batch_sharding(mesh, leaf.ndim)

  return jax.tree_util.tree_map_with_path(spec, abstract_state)


def make_sampler_fns(*, graphdef, params_like, mesh: Mesh,
                     settings: sampling.SamplingSettings, num_slots: int, prompt_len: int,
                     max_new_tokens: int):
  """Jitted `(prefill_fn, decode_fn)` for fixed shapes, params as an argument.

  Both pin their output to one DecodeState layout: otherwise the first decode
  step sees prefill's layout and every later one decode's, and compiles twice.
  The decode step donates the state (the KV cache is updated in place).

  Args:
    graphdef: decoder graph definition.
    params_like: params or their ShapeDtypeStructs (only shapes are read).
    mesh: the mesh the slots live on (rows over its `data` axis if it has one).
    settings: static sampling settings.
    num_slots: B.
    prompt_len: P.
    max_new_tokens: N.

  Returns:
    `prefill_fn(params, version, tokens, mask, active, keys)` and
    `decode_fn(params, version, state, stop_rows)`.
  """
  b = num_slots
  prefill = functools.partial(sampling.prefill, graphdef, settings=settings,
                              max_new_tokens=max_new_tokens)
  decode = functools.partial(sampling.decode_step, graphdef, settings=settings)
  abstract_state = jax.eval_shape(
      prefill, params_like, jax.ShapeDtypeStruct((), jnp.int32),
      jax.ShapeDtypeStruct((b, prompt_len), jnp.int32),
      jax.ShapeDtypeStruct((b, prompt_len), jnp.bool_), jax.ShapeDtypeStruct((b,), jnp.bool_),
      jax.ShapeDtypeStruct((b, 2), jnp.uint32))
  state_shardings = _decode_state_shardings(mesh, abstract_state)
  prefill_fn = jax.jit(prefill, out_shardings=state_shardings)
  decode_fn = jax.jit(decode, out_shardings=state_shardings, donate_argnums=2)
  return prefill_fn, decode_fn


class SamplerEngine:
  """Generates rollouts on the sampler mesh in its own thread."""

  def __init__(self, *, cfg: EngineConfig, settings: sampling.SamplingSettings, graphdef,
               mesh: Mesh, publisher, dispatcher: dispatcher_lib.Dispatcher,
               on_group_fn: Callable[[dispatcher_lib.GroupRequest, list[rollout_lib.Rollout]],
                                     None]):
    """Args:
      cfg: engine settings.
      settings: sampling settings (temperature, eos).
      graphdef: decoder graph definition.
      mesh: the sampler mesh.
      publisher: a WeightPublisher (source of `(version, params)`).
      dispatcher: source of group requests.
      on_group_fn: called with each finished (not cancelled) group's rollouts.
    """
    if cfg.weight_update not in WEIGHT_UPDATE_MODES:
      raise ValueError(f"weight_update must be one of {WEIGHT_UPDATE_MODES}")
    self._cfg = cfg
    self._settings = settings
    self._mesh = mesh
    self._publisher = publisher
    self._dispatcher = dispatcher
    self._on_group_fn = on_group_fn
    self._cancelled: set[int] = set()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.stats = EngineStats()
    self.version: int | None = None
    self._params = None
    self._graphdef = graphdef
    self._rows = lambda x: jax.device_put(x, _batch_sharding(mesh, np.ndim(x)))
    self._prefill_fn = self._decode_fn = None  # built from the first published params

  # -- control ---------------------------------------------------------------

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="sampler-engine", daemon=True)
    self._thread.start()

  def stop(self, raise_errors: bool = True) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if raise_errors:
      self.raise_if_failed()

  def raise_if_failed(self) -> None:
    if self._error is not None:
      raise RuntimeError("sampler engine failed") from self._error

  def cancel(self, group_ids) -> None:
    with self._lock:
      self._cancelled.update(group_ids)

  # -- loop --------------------------------------------------------------------

  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self._maybe_swap()
        if self.version is None:
          time.sleep(0.01)
          continue
        max_groups = self._cfg.num_slots // self._cfg.group_size
        requests = self._dispatcher.take(max_groups, self.version, timeout=0.05)
        if requests:
          self._run_wave(requests)
    except BaseException as e:  # surfaced to the learner thread by raise_if_failed
      self._error = e

  def _maybe_swap(self) -> bool:
    version, params = self._publisher.latest()
    if version is None or version == self.version:
      return False
    if self._params is not None:
      param_swap.check_swap_compatible(self._params, params)
      self.stats.swaps += 1
    self.version, self._params = version, params
    return True

  def _run_wave(self, requests: list[dispatcher_lib.GroupRequest]) -> None:
    cfg, settings = self._cfg, self._settings
    start = time.monotonic()
    b, p = cfg.num_slots, cfg.prompt_len
    tokens = np.full((b, p), settings.pad_id, np.int32)
    mask = np.zeros((b, p), bool)
    active = np.zeros((b,), bool)
    group_ids = np.zeros((b,), np.int64)
    sample_idx = np.zeros((b,), np.int64)
    row_group = []  # (request, sample index) per used row
    for req in requests:
      ids = np.asarray(req.prompt_ids, np.int32)
      if not 0 < len(ids) <= p:
        raise ValueError(f"group {req.group_id}: prompt has {len(ids)} tokens; the sampler "
                         f"takes 1 to sampler.prompt_len={p}")
      for s in range(req.group_size):
        r = len(row_group)
        tokens[r, p - len(ids):] = ids
        mask[r, p - len(ids):] = True
        active[r] = True
        group_ids[r], sample_idx[r] = req.group_id, s
        row_group.append((req, s))
    keys = sampling.row_keys(cfg.seed, group_ids, sample_idx)
    if self._prefill_fn is None:
      self._prefill_fn, self._decode_fn = make_sampler_fns(
          graphdef=self._graphdef, params_like=self._params, mesh=self._mesh,
          settings=settings, num_slots=b, prompt_len=p, max_new_tokens=cfg.max_new_tokens)
    state = self._prefill_fn(self._params, jnp.int32(self.version), self._rows(tokens),
                             self._rows(mask), self._rows(active), self._rows(keys))
    row_cancelled = np.zeros((b,), bool)
    # Most steps cancel nothing: reuse one device array instead of a transfer.
    no_stop = self._rows(row_cancelled)
    for _ in range(cfg.max_new_tokens - 1):
      if self._stop.is_set():
        return
      if cfg.weight_update == "in_flight":
        self._maybe_swap()
      newly = self._newly_cancelled(row_group, row_cancelled)
      # One small host sync per step: stop as soon as every slot is done.
      if bool(np.all(np.asarray(state.done) | newly)):
        row_cancelled |= newly
        break
      row_cancelled |= newly
      stop_rows = self._rows(newly) if newly.any() else no_stop
      state = self._decode_fn(self._params, jnp.int32(self.version), state, stop_rows)
    self._finish_wave(requests, row_group, state, row_cancelled, start)

  def _newly_cancelled(self, row_group, row_cancelled) -> np.ndarray:
    with self._lock:
      cancelled = set(self._cancelled)
    newly = np.zeros(row_cancelled.shape, bool)
    for r, (req, _) in enumerate(row_group):
      newly[r] = req.group_id in cancelled and not row_cancelled[r]
    return newly

  def _finish_wave(self, requests, row_group, state, row_cancelled, start) -> None:
    cfg = self._cfg
    host = jax.device_get({"tokens": state.tokens, "token_mask": state.token_mask,
                           "logprobs": state.logprobs, "versions": state.versions,
                           "stopped": state.stopped})
    gen_seconds = time.monotonic() - start
    self.stats.waves += 1
    self.stats.busy_seconds += gen_seconds
    by_group: dict[int, list[rollout_lib.Rollout]] = {}
    for r, (req, s) in enumerate(row_group):
      comp = slice(cfg.prompt_len, None)
      n = int(host["token_mask"][r, comp].sum())
      completion = host["tokens"][r, comp][:n]
      if row_cancelled[r]:
        self.stats.cancelled_rollouts += 1
        self.stats.cancelled_tokens += cfg.max_new_tokens - n
        continue
      self.stats.sampled_tokens += n
      by_group.setdefault(req.group_id, []).append(rollout_lib.Rollout(
          group_id=req.group_id, sample_index=s, prompt_ids=np.asarray(req.prompt_ids, np.int32),
          completion_ids=completion.astype(np.int32),
          loss_mask=np.ones((n,), np.float32),
          behaviour_logprobs=host["logprobs"][r, comp][:n].astype(np.float32),
          token_versions=host["versions"][r, comp][:n].astype(np.int32),
          dispatch_version=req.dispatch_version,
          finish_reason="stop" if host["stopped"][r] else "length",
          timings={"queued": start - req.dispatch_time, "generating": gen_seconds}))
    with self._lock:
      # Only groups of this wave can be generating, so nothing else can be
      # pending; a late cancel for a finished group is dropped here too.
      self._cancelled.clear()
    for req in requests:
      self._dispatcher.finished_generating(req.group_id)
      rollouts = by_group.get(req.group_id)
      if rollouts is not None and len(rollouts) == req.group_size:
        self._on_group_fn(req, rollouts)
