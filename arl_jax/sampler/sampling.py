"""Pure functions of the sampler's slot state (no threads, no host state).

`slot_fns.py` jits these with params passed as an argument, so that the
engine picks up a newly published version between two decode steps without
recompiling. Every sampled token records the log-probability it was sampled
with and the version of the params that produced its logits: a decode step
first runs the model under the params it is given, then samples from those
logits, so the recorded version is exactly the one behind the probability.

Slots are independent rows (continuous batching): each has its own prompt
bucket, write column, position and length limit, so a slot can be refilled
(`insert`) while the others keep decoding, and nothing a slot computes depends
on its neighbours.

Row layout: a row's context (n tokens) fills columns `[0, n)` and its
completion follows, so its keys and values are the first `index + 1`
columns (as paged attention kernels read them); inserts prefill contexts
left-padded to a bucket of Pb columns and move each to column 0. Shapes: B
slots, L = longest bucket + max new tokens = cache length, R rows inserted.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from arl_jax.core import rollout as rollout_lib
from arl_jax.core import settings as settings_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.models import kv_cache as kv_cache_lib
from arl_jax.models import paged_kv_cache
from arl_jax.sampler import segments, token_draw

NO_VERSION = rollout_lib.NO_VERSION  # positions that were not sampled (prompt, padding)
NO_ALTERNATIVE = segments.NO_ALTERNATIVE  # `SlotState.top_ids` where nothing was sampled


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSettings:
  """Static sampling settings (hashable: a jit static argument); their keys
  are in the config's `sampler` section beside `EngineConfig`'s.

  Attributes:
    temperature: softmax temperature; the behaviour log-prob is that of the
      tempered distribution, and the learner scores at the same temperature.
    top_k: keep only the k most likely tokens (0: off).
    top_p: keep the smallest set of tokens whose probability reaches p (1: off).
    min_p: keep the tokens whose probability is at least `min_p` times the
      most likely token's (0: off), after the temperature, as vLLM's min_p.
    top_logprobs: the most likely alternatives recorded with every sampled
      token, from the distribution it was drawn from (0: none). A served
      request's `top_logprobs` (chat) or `logprobs` (completions) asks for at
      most this many; a run that serves nobody leaves it 0 (a top-k over the
      vocabulary each step, and `[B, L, K]` more slot state).
    greedy: argmax decoding (evaluation); log-probs are then untempered.
    eos_id: token that ends a completion (kept, and trained on).
    pad_id: filler for positions after the end.
    stop_ids: further tokens that may end a segment (kept and trained on),
      e.g. the end of a turn, or of a tool call after which a multi-turn
      environment answers. Each row says which of them apply to it
      (`SlotState.stop_mask`), so one batch can mix environments whose stop
      tokens differ.

  With top-k or top-p the recorded behaviour log-prob is that of the truncated
  distribution actually sampled from, so the importance ratio stays honest.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  top_logprobs: int = 0
  greedy: bool = settings_lib.derived(False, "evaluation")
  eos_id: int = settings_lib.derived(dataclasses.MISSING, "the tokenizer")
  pad_id: int = settings_lib.derived(dataclasses.MISSING, "the tokenizer")
  stop_ids: tuple[int, ...] = settings_lib.derived((), "the tokenizer and the environment")

  def __post_init__(self):
    settings_lib.check(isinstance(self.temperature, (int, float)) and self.temperature > 0,
                       "temperature", f"must be > 0, got {self.temperature!r}")
    settings_lib.check(settings_lib.is_int(self.top_k) and self.top_k >= 0, "top_k",
                       f"must be an int >= 0 (0: off), got {self.top_k!r}")
    settings_lib.check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
                       "top_p", f"must be in (0, 1], got {self.top_p!r}")
    settings_lib.check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p < 1.0,
                       "min_p", f"must be in [0, 1) (0: off), got {self.min_p!r}")
    settings_lib.check(settings_lib.is_int(self.top_logprobs) and 0 <= self.top_logprobs <= 20,
                       "top_logprobs", "must be an int in [0, 20] (0: none; OpenAI's largest is "
                       f"20), got {self.top_logprobs!r}")


@flax.struct.dataclass
class SlotState:
  """Everything the slots carry between decode steps.

  Attributes:
    tokens: `[B, L]` int32, left-padded prompt then completion then pad.
    token_mask: `[B, L]` bool, real tokens (prompt and sampled, EOS included).
    logprobs: `[B, L]` float32 behaviour log-prob of sampled tokens, else 0.
    versions: `[B, L]` int32 policy version of sampled tokens, else -1.
    cache: the KV cache, length L (dense, or paged: see `init_slots`).
    prompt_end: `[B]` int32 first completion column (the slot's prompt bucket).
    index: `[B]` int32 column of the last sampled token (of the last prompt
      token in a slot that `fork` started, until its first decode step).
    limit: `[B]` int32 last column the slot may sample (max new tokens or L).
    positions: `[B]` int32 RoPE position of the last sampled token.
    done: `[B]` bool, slot finished (EOS, limit, cancelled or never used).
    stopped: `[B]` bool, slot finished by sampling EOS or another stop token.
    stop_mask: `[B, S]` bool, which of `settings.stop_ids` end the slot's segment.
    keys: `[B, 2]` uint32 per-slot PRNG keys (fold_in with the column index).
    top_ids: `[B, L, K]` int32 the K most likely alternatives of each sampled
      token (`settings.top_logprobs`; K may be 0), NO_ALTERNATIVE elsewhere.
    top_logprobs: `[B, L, K]` float32 their log-probs.
  """

  tokens: jax.Array
  token_mask: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  cache: kv_cache_lib.KVCache | paged_kv_cache.PagedKVCache
  prompt_end: jax.Array
  index: jax.Array
  limit: jax.Array
  positions: jax.Array
  done: jax.Array
  stopped: jax.Array
  stop_mask: jax.Array
  keys: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array

  def logical_axes(self) -> SlotState:
    """This state's structure with each array's logical axis names in its
    place, for `rules.array_shardings`: slots are the `batch` axis."""
    row, column = ("batch",), ("batch", "length")
    alternatives = ("batch", "length", "alternatives")
    return SlotState(
        tokens=column, token_mask=column, logprobs=column, versions=column,
        cache=self.cache.logical_axes(), prompt_end=row, index=row, limit=row, positions=row,
        done=row, stopped=row, stop_mask=("batch", "stop_ids"), keys=("batch", "prng_key"),
        top_ids=alternatives, top_logprobs=alternatives)


def slot_state_bytes(cfg, *, num_slots: int, length: int, num_stop_ids: int = 0,
                     top_logprobs: int = 0) -> int:
  """Bytes of what `init_slots` allocates besides the cache's keys and values
  (the tokens, log-probs, versions, alternatives, the cache's valid columns
  and every per-slot field), from the state's own shapes (nothing
  allocated): what `--dry_run` plans."""
  state = jax.eval_shape(lambda: init_slots(cfg, num_slots=num_slots, length=length, pad_id=0,
                                            num_stop_ids=num_stop_ids,
                                            top_logprobs=top_logprobs))
  size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
  return size(state) - size((state.cache.keys, state.cache.values))


def init_slots(cfg, *, num_slots: int, length: int, pad_id: int, num_stop_ids: int = 0,
               num_pages: int = 0, page_size: int = 0, attention: str = "xla",
               layout: str | None = None, mesh=None, top_logprobs: int = 0) -> SlotState:
  """All slots empty (done), with a zeroed cache of `length` columns: dense
  (`[num_slots, KVH, length, Dh]` per layer), or paged (`PagedKVCache.zeros`) if `num_pages`."""
  b = num_slots
  geometry = dict(batch=b, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                  length=length, head_dim=cfg.head_dim, dtype=jnp.dtype(cfg.param_dtype))
  if num_pages:
    cache = paged_kv_cache.PagedKVCache.zeros(
        num_pages=num_pages, page_size=page_size, attention=attention, layout=layout, mesh=mesh,
        **geometry)
  else:
    cache = kv_cache_lib.KVCache.zeros(**geometry)
  zeros = jnp.zeros((b,), jnp.int32)
  return SlotState(
      tokens=jnp.full((b, length), pad_id, jnp.int32),
      token_mask=jnp.zeros((b, length), jnp.bool_),
      logprobs=jnp.zeros((b, length), jnp.float32),
      versions=jnp.full((b, length), NO_VERSION, jnp.int32),
      cache=cache, prompt_end=zeros, index=zeros, limit=zeros, positions=zeros,
      done=jnp.ones((b,), jnp.bool_), stopped=jnp.zeros((b,), jnp.bool_),
      stop_mask=jnp.zeros((b, num_stop_ids), jnp.bool_), keys=jnp.zeros((b, 2), jnp.uint32),
      **no_alternatives(b, length, top_logprobs))


def no_alternatives(rows: int, length: int, k: int) -> dict:
  """`top_ids` and `top_logprobs` of `rows` rows where nothing was sampled."""
  return dict(top_ids=jnp.full((rows, length, k), NO_ALTERNATIVE, jnp.int32),
              top_logprobs=jnp.full((rows, length, k), -jnp.inf, jnp.float32))


def clear_alternatives(state: SlotState, slots) -> dict:
  """`top_ids` and `top_logprobs` of `state` with `slots`' rows cleared (a
  new segment's: an open segment's alternatives stay on the host)."""
  _, length, k = state.top_ids.shape
  fresh = no_alternatives(slots.shape[0], length, k)
  return {name: set_rows(getattr(state, name), slots, fresh[name]) for name in fresh}


def set_rows(arr, rows, values):
  return arr.at[rows].set(values)


def record_tokens(state: SlotState, live, columns, draw: token_draw.Draw, version, settings,
                  rows=None):
  """Writes freshly drawn tokens at per-row `columns` for `live` rows; the
  arguments are per slot `[B]`, or per slot of `rows` `[R]` when given."""
  full = rows is None
  rows = jnp.arange(state.tokens.shape[0]) if full else rows
  tokens, logp = draw.tokens, draw.logprobs
  put = lambda arr, val: arr.at[rows, columns].set(jnp.where(live, val, arr[rows, columns]))
  put_top = lambda arr, val: arr.at[rows, columns].set(
      jnp.where(live[:, None], val, arr[rows, columns]))
  # Per-slot fields: elementwise over all slots, or scattered to `rows`.
  put_row = (lambda arr, val: val) if full else (lambda arr, val: arr.at[rows].set(val))
  tokens = jnp.where(live, tokens, settings.pad_id)
  is_stop = tokens == settings.eos_id
  if settings.stop_ids:
    row_stop = ((tokens[:, None] == jnp.asarray(settings.stop_ids)[None, :])
                & state.stop_mask[rows])
    is_stop |= jnp.any(row_stop, axis=-1)
  is_stop &= live
  return state.replace(
      tokens=put(state.tokens, tokens),
      token_mask=put(state.token_mask, live),
      logprobs=put(state.logprobs, logp),
      versions=put(state.versions, jnp.full_like(columns, version)),
      top_ids=put_top(state.top_ids, draw.top_ids),
      top_logprobs=put_top(state.top_logprobs, draw.top_logprobs),
      index=put_row(state.index, jnp.where(live, columns, state.index[rows])),
      done=put_row(state.done, state.done[rows] | is_stop
                   | (live & (columns >= state.limit[rows]))),
      stopped=put_row(state.stopped, state.stopped[rows] | is_stop),
  )


def insert(graphdef, params, version, state: SlotState, slots, prompt_tokens, prompt_mask, keys,
           max_new_tokens, stop_mask=None, open_len=None, open_logprobs=None,
           open_versions=None, *, settings: SamplingSettings) -> SlotState:
  """Prefills R prompts into the given slots and samples their first tokens.

  The other slots are untouched. Duplicate entries in `slots` must carry
  identical rows (the engine pads R up to a bucket by repeating a row).

  A row may end with an open segment: `open_len` tokens already sampled for
  the segment this insert continues (a resumed checkpoint's partial work).
  They become the segment's first tokens, with their recorded log-probs and
  versions, and the draws go on at the offset after them, so the segment
  samples what it would have sampled uninterrupted (up to the prefill's
  rounding).

  Args:
    graphdef: nnx graph definition of the decoder (static).
    params: nnx.State of the decoder params (an argument, never closed over).
    version: `[]` int32 policy version of `params`.
    state: the slot state.
    slots: `[R]` int32 slot indices to fill.
    prompt_tokens: `[R, Pb]` int32, left-padded to the prompt bucket Pb.
    prompt_mask: `[R, Pb]` bool, True on real prompt tokens.
    keys: `[R, 2]` uint32 per-rollout keys.
    max_new_tokens: `[R]` int32 completion budget of each row.
    stop_mask: `[R, S]` bool, which of `settings.stop_ids` end each row's
      segment; None: all of them.
    open_len: `[R]` int32 open-segment tokens at the end of each row (None: 0).
    open_logprobs: `[R, Pb]` float32 their behaviour log-probs (in the last
      `open_len` columns; None: no open segments).
    open_versions: `[R, Pb]` int32 their versions (likewise).
    settings: static sampling settings.

  Returns:
    The SlotState with the R slots live (or done, if their first token ended them).
  """
  model = nnx.merge(graphdef, params)
  r, pb = prompt_tokens.shape
  length = state.tokens.shape[1]
  cfg = model.cfg
  if open_len is None:
    open_len = jnp.zeros((r,), jnp.int32)
  if open_logprobs is None:
    open_logprobs = jnp.zeros((r, pb), jnp.float32)
  if open_versions is None:
    open_versions = jnp.full((r, pb), NO_VERSION, jnp.int32)
  small = kv_cache_lib.KVCache.zeros(
      batch=r, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, length=pb,
      head_dim=cfg.head_dim, dtype=state.cache.keys[0].dtype).replace(valid=prompt_mask)
  positions = decoder_lib.positions_from_mask(prompt_mask)
  attn = prompt_mask[:, None, :] & (jnp.arange(pb)[None, None, :] <= jnp.arange(pb)[None, :, None])
  logits, small = model(prompt_tokens, positions, attn, small, jnp.zeros((r,), jnp.int32),
                        last_only=True)
  # Each row moves to column 0 (its left padding rolls round to the end).
  n = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
  columns = (jnp.arange(pb)[None, :] + (pb - n)[:, None]) % pb  # [R, Pb]
  shift = lambda a, axis=1: jnp.take_along_axis(a, jnp.expand_dims(
      columns, tuple(range(2, a.ndim))).swapaxes(1, axis), axis=axis)
  prompt_tokens, prompt_mask, open_logprobs, open_versions = map(
      shift, (prompt_tokens, prompt_mask, open_logprobs, open_versions))
  small = small.replace(valid=prompt_mask, keys=tuple(shift(k, 2) for k in small.keys),
                        values=tuple(shift(v, 2) for v in small.values))

  tail = lambda fill, dtype: jnp.full((r, length - pb), fill, dtype)
  cache = state.cache.write_prefill(slots, small)
  cache = cache.replace(valid=set_rows(
      cache.valid, slots, jnp.concatenate([prompt_mask, tail(False, jnp.bool_)], axis=1)))
  state = state.replace(
      cache=cache,
      tokens=set_rows(state.tokens, slots, jnp.concatenate(
          [prompt_tokens, tail(settings.pad_id, jnp.int32)], axis=1)),
      token_mask=set_rows(state.token_mask, slots, jnp.concatenate(
          [prompt_mask, tail(False, jnp.bool_)], axis=1)),
      logprobs=set_rows(state.logprobs, slots, jnp.concatenate(
          [open_logprobs, tail(0.0, jnp.float32)], axis=1)),
      versions=set_rows(state.versions, slots, jnp.concatenate(
          [open_versions, tail(NO_VERSION, jnp.int32)], axis=1)),
      # The segment (harvested from here) starts with the open tokens.
      prompt_end=set_rows(state.prompt_end, slots, n - open_len),
      limit=set_rows(state.limit, slots, jnp.minimum(n + max_new_tokens - 1, length - 1)),
      positions=set_rows(state.positions, slots, n),
      done=set_rows(state.done, slots, False),
      stopped=set_rows(state.stopped, slots, False),
      stop_mask=set_rows(state.stop_mask, slots, True if stop_mask is None else stop_mask),
      keys=set_rows(state.keys, slots, keys), **clear_alternatives(state, slots))
  # Sample the first completion token of the inserted rows only, at column n.
  draw = token_draw.sample_from_logits(logits[:, -1], keys, open_len, settings)
  b = state.tokens.shape[0]
  live = jnp.zeros((b,), jnp.bool_).at[slots].set(True)
  full = lambda x, fill: jnp.full((b, *x.shape[1:]), fill, x.dtype).at[slots].set(x)
  draw = token_draw.Draw(full(draw.tokens, settings.pad_id), full(draw.logprobs, 0.0),
                         full(draw.top_ids, NO_ALTERNATIVE), full(draw.top_logprobs, -jnp.inf))
  return record_tokens(state, live, full(n, 0), draw, version, settings)


def insert_from_ids(graphdef, params, version, state: SlotState, base_key, slots, prompt_tokens,
                    prompt_mask, key_ids, max_new_tokens, stop_mask, open_len, open_logprobs,
                    open_versions, *, settings: SamplingSettings) -> SlotState:
  """`insert`, each row's PRNG key derived from its ids inside the program.

  The engine's admissions: deriving keys on the host (`token_draw.row_keys`) runs one
  more program per row count, which the engine would have to compile too.

  Args:
    graphdef, params, version, state: as `insert`.
    base_key: `[2]` uint32, `jax.random.PRNGKey(seed)`.
    slots, prompt_tokens, prompt_mask: as `insert`.
    key_ids: `[R, 3]` uint32 (group id, sample index, turn) of each row;
      the row's key is `token_draw.segment_keys(base_key, key_ids)`.
    max_new_tokens, stop_mask, open_len, open_logprobs, open_versions: as `insert`.
    settings: static sampling settings.
  """
  return insert(graphdef, params, version, state, slots, prompt_tokens, prompt_mask,
                token_draw.segment_keys(base_key, key_ids), max_new_tokens, stop_mask,
                open_len, open_logprobs, open_versions, settings=settings)


def fork(state: SlotState, base_key, src, dst, key_ids, max_new_tokens, stop_mask, *,
         settings: SamplingSettings) -> SlotState:
  """Starts slots `dst` on the prompt that slots `src` were just given by
  `insert`: the G samples of a group share one prefill (`share_prompts`).

  A forked row takes its source's prompt columns and their keys and values
  (a paged cache shares the source's pages and copies only the page it
  writes next: `PagedKVCache.fork_rows`), with its last prompt token as the
  token to feed: its first decode step writes that token's keys and values
  again and samples the first completion token from the logits the prefill
  would have given, with the draw the row would have made had it been
  inserted (same key, offset 0).

  Args:
    state: the slot state; each `src` slot holds a freshly inserted prompt
      (no open segment) and has taken no decode step since.
    base_key: `[2]` uint32, `jax.random.PRNGKey(seed)`.
    src: `[R]` int32 slots to copy from.
    dst: `[R]` int32 slots to start (a repeated pair rewrites the same slot).
    key_ids: `[R, 3]` uint32 (group id, sample index, turn) of each `dst` row.
    max_new_tokens: `[R]` int32 completion budget of each row.
    stop_mask: `[R, S]` bool, which of `settings.stop_ids` end each row's segment.
    settings: static sampling settings.
  """
  length = state.tokens.shape[1]
  shared = state.prompt_end[src]  # the first completion column
  prompt = jnp.arange(length)[None, :] < shared[:, None]
  copy = lambda arr, fill: jnp.where(prompt, arr[src], fill)
  token_mask = copy(state.token_mask, False)
  return state.replace(
      cache=state.cache.fork_rows(src, dst, shared),
      tokens=set_rows(state.tokens, dst, copy(state.tokens, settings.pad_id)),
      token_mask=set_rows(state.token_mask, dst, token_mask),
      logprobs=set_rows(state.logprobs, dst, jnp.zeros((dst.shape[0], length), jnp.float32)),
      versions=set_rows(state.versions, dst,
                         jnp.full((dst.shape[0], length), NO_VERSION, jnp.int32)),
      prompt_end=set_rows(state.prompt_end, dst, shared),
      # The last prompt token stands as the "last sampled" one, fed next.
      index=set_rows(state.index, dst, shared - 1),
      positions=set_rows(state.positions, dst,
                          jnp.sum(token_mask, axis=1, dtype=jnp.int32) - 1),
      limit=set_rows(state.limit, dst, jnp.minimum(shared + max_new_tokens - 1, length - 1)),
      done=set_rows(state.done, dst, False),
      stopped=set_rows(state.stopped, dst, False),
      stop_mask=set_rows(state.stop_mask, dst, stop_mask),
      keys=set_rows(state.keys, dst, token_draw.segment_keys(base_key, key_ids)),
      **clear_alternatives(state, dst))


def decode_step(graphdef, params, version, state: SlotState, stop_rows, rows, *,
                settings: SamplingSettings, steps: int = 1) -> SlotState:
  """Feeds each live slot's last sampled token and samples its next one.

  Args:
    graphdef: nnx graph definition (static).
    params: decoder params now live for `rows`.
    version: `[]` int32 version of `params`; recorded on the new tokens.
    state: the slot state.
    stop_rows: `[B]` bool, slots to end before this step (cancelled groups).
    rows: `[B]` bool, slots this call decodes (all of them, except when the
      engine serves several pinned versions and calls once per version).
    settings: static sampling settings.
    steps: static, decode steps this call takes (a loop on the device: the
      engine's `decode_burst`, one host round trip for several tokens); a
      slot that finishes on the way samples nothing more.

  Returns:
    The SlotState with `steps` more columns sampled in every live slot of `rows`.
  """
  model = nnx.merge(graphdef, params)
  step = lambda _, s: _decode_all(model, version, s, rows, settings)
  return repeat_steps(step, state.replace(done=state.done | stop_rows), steps)


def repeat_steps(step, state: SlotState, steps: int) -> SlotState:
  """`step(i, state)` `steps` times (a device loop when more than once)."""
  return step(0, state) if steps == 1 else jax.lax.fori_loop(0, steps, step, state)


def _decode_all(model, version, state: SlotState, rows, settings) -> SlotState:
  """One decode step of every live slot of `rows` (`decode_step`)."""
  b, length = state.tokens.shape
  live = ~state.done & rows
  batch_rows = jnp.arange(b)
  last = state.index
  last_tokens = state.tokens[batch_rows, last][:, None]  # [B, 1]
  valid = state.cache.valid.at[batch_rows, last].set(state.cache.valid[batch_rows, last] | live)
  attn = valid[:, None, :] & (jnp.arange(length)[None, None, :] <= last[:, None, None])
  logits, cache = model(last_tokens, state.positions[:, None], attn,
                        state.cache.replace(valid=valid), last, write_mask=live)
  state = state.replace(cache=cache, positions=state.positions + live.astype(jnp.int32))
  columns = jnp.minimum(last + 1, length - 1)
  draw = token_draw.sample_from_logits(logits[:, 0], state.keys, columns - state.prompt_end,
                                      settings)
  return record_tokens(state, live, columns, draw, version, settings)

