"""A run's inputs: tokenizer, environment and prompts, loaded once (by
`run_spec.resolve`, which validates them) and used as they are by the run."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from arl_jax.envs import prompt_data, prompt_source, registry
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.orchestrator import work_record


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Attributes:
    tokenizer: the run's tokenizer.
    env: the training environment (with its simulated latencies, if any).
    eval_env: the same environment for evaluation (no simulated latency).
    train: the training prompts (and the lines skipped while loading them).
    heldout: the held-out prompts.
    eval_prompts: the `eval_size` held-out prompts evaluation uses.
  """

  tokenizer: tokenizer_lib.Tokenizer
  env: object
  eval_env: object
  train: prompt_source.Prompts
  heldout: prompt_source.Prompts
  eval_prompts: list


def warnings(spec, inputs: Inputs) -> list[str]:
  """What the user should know before the run starts (printed once)."""
  lines = []
  if spec.data.train_path and not spec.data.heldout_path:
    lines.append("warning: data.train_path is set but data.heldout_path is not: evaluation uses "
                 f"env {spec.env_name!r}'s own held-out prompts, which may overlap your "
                 "training file")
  for split, source in (("train", inputs.train), ("heldout", inputs.heldout)):
    if source.skipped:
      lines.append(f"warning: skipped {len(source.skipped)} malformed {split} line(s), first: "
                   f"{source.skipped[0]}")
  dispatch = spec.orchestrator
  if dispatch.max_async_level > dispatch.max_off_policy_steps:
    lines.append(f"warning: max_async_level={dispatch.max_async_level} > K="
                 f"{dispatch.max_off_policy_steps}: the sampler may run further ahead than "
                 "groups may lag, so expect many stale drops and cancellations")
  return lines


def skipped_records(inputs: Inputs) -> list[dict]:
  """`metrics.jsonl` records of the malformed lines skipped (`phase: data`)."""
  return [{"phase": "data", "split": split, "skipped_lines": len(source.skipped),
           "skipped": source.skipped[:100]}
          for split, source in (("train", inputs.train), ("heldout", inputs.heldout))
          if source.skipped]


def prompt_stream(spec, inputs: Inputs, work: work_record.WorkRecord | None):
  """The training prompts as the dispatcher draws them: the environment's
  own stream where it has one (a curriculum: `EnvEntry.make_stream_fn`),
  else one shuffled stream, or for a mixture a stream drawing from each
  environment by its weight; where a resumed run left it when `work` (a
  checkpoint's open work) is given.
  """
  env, prompts = inputs.env, inputs.train.prompts
  weights = spec.env.weights if spec.env_name == "mixture" else None
  # One stream for the whole run, not a shard per process: in a
  # multi-controller run only process 0's orchestrator draws prompts.
  whole = {"shard_index": 0, "shard_count": 1}
  make_stream = registry.ENVS[spec.env_name].make_stream_fn
  own = (make_stream(spec.env, spec.run.seed)
         if make_stream is not None and not spec.data.train_path else None)
  if own is not None:
    stream = own
  elif not weights:
    stream = prompt_data.prompt_iterator(prompts, spec.run.seed,
                                         num_epochs=spec.data.num_epochs or None, **whole)
  else:
    by_env = collections.defaultdict(list)
    for p in prompts:
      by_env[env.env_name_of(p)].append(p)
    stream = prompt_data.mixed_iterator(by_env, weights, spec.run.seed, **whole)
  if work is None:
    return stream
  if work.stream_state is not None:  # the stream's saved position
    stream.set_state(work.stream_state)
    return stream
  return itertools.islice(stream, work.prompts_drawn, None)


def warmup_subset(spec, inputs: Inputs) -> list:
  """The training prompts the supervised warm-up teaches (`warmup.fraction`)."""
  prompts = inputs.train.prompts
  count = max(1, int(spec.warmup.fraction * len(prompts)))
  chosen = np.random.default_rng((spec.run.seed, 0)).permutation(len(prompts))[:count]
  return [prompts[i] for i in chosen]


def eval_prompts(env, heldout, size: int) -> list:
  """`size` held-out prompts spread evenly over the list, split evenly between
  the environments of a mixture."""
  by_env = collections.defaultdict(list)
  for p in heldout:
    by_env[env.env_name_of(p)].append(p)
  chosen = []
  for i, prompts in enumerate(by_env.values()):
    n = size // len(by_env) + (i < size % len(by_env))
    chosen += prompts[:: max(1, len(prompts) // max(n, 1))][:n]
  return chosen
