"""A sampler engine fed by a fixed list of one-rollout requests, for benchmarks
that time the engine itself (`long_context.py`, `sampler.py`)."""

from __future__ import annotations

import threading
import time

import numpy as np

from arl_jax.core import group_request as group_request_lib
from arl_jax.sampler import engine as engine_lib
from arl_jax.sampler import sampling

# How decode steps attend, the engine settings of each: dense, every column;
# paged, a block of pages at a time, as many blocks as the slots need (the
# default, `models/paged_blocks.py`), or one program per power-of-two width,
# gathered at once (`attention_block=0`: the comparison row).
ATTENTION = {"dense": dict(kv_cache="dense"), "blocks": dict(kv_cache="paged"),
             "widths": dict(kv_cache="paged", attention_block=0)}


class Requests:
  """Groups with the given completion budgets, as fast as the engine asks: of
  `group_size` rollouts (one by default), of the given prompts (token ids,
  one a group) or random ones of `prompt_len` tokens."""

  def __init__(self, budgets, prompt_len: int, *, group_size: int = 1, prompts=None):
    self._budgets = budgets
    self._group_size = group_size
    self._prompts = (np.random.default_rng(3).integers(0, 256, (len(budgets), prompt_len))
                     if prompts is None else prompts)
    self._next = 0
    self._lock = threading.Lock()

  def take(self, max_groups, live_version, timeout):
    with self._lock:
      n = min(max_groups, len(self._budgets) - self._next)
      ids = range(self._next, self._next + n)
      self._next += n
    if n == 0:
      time.sleep(timeout)
    return [group_request_lib.GroupRequest(
        group_id=i, prompt=i, prompt_ids=tuple(int(t) for t in self._prompts[i]),
        dispatch_version=live_version, group_size=self._group_size,
        dispatch_time=time.monotonic(),
        max_new_tokens=int(self._budgets[i])) for i in ids]

  def note_sampling(self, group_id, version):
    pass


class Params:
  """One version of params, published before the engine starts."""

  def __init__(self, params):
    self._params = params

  def latest(self):
    return 0, self._params


def run_engine(cfg, meshes, graphdef, params, ecfg, budgets, *, prompt_len: int, pad_id: int,
               top_logprobs: int = 0):
  """Runs an engine configured by `ecfg` until every request is done (no EOS:
  every completion runs to its budget), recording `top_logprobs`
  alternatives per token; its stats and wall seconds."""
  done = []
  # A token id outside the model's vocabulary: never sampled.
  settings = sampling.SamplingSettings(eos_id=10 ** 6, pad_id=pad_id, top_logprobs=top_logprobs)
  engine = engine_lib.SamplerEngine(
      cfg=ecfg, settings=settings, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler,
      publisher=Params(params), dispatcher=Requests(budgets, prompt_len),
      on_segment_fn=done.append)
  start = time.perf_counter()
  engine.start()
  while len(done) < len(budgets):
    engine.raise_if_failed()
    time.sleep(0.02)
  seconds = time.perf_counter() - start
  engine.stop()
  return engine.stats, seconds
