"""Supervised warm-up: a few steps of next-token cross-entropy on correct answers.

Small models trained from scratch rarely sample a correct answer, so RL has no
signal to start from. The warm-up teaches the answer on a fraction of the
training prompts (docs/jax_notes.md: warming up on the format alone made RL collapse
onto one answer). It reuses the TrainBatch layout and the learner's sharding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from arl_jax.core import rows as rows_lib
from arl_jax.core import train_batch as train_batch_lib
from arl_jax.learner import logprobs as logprobs_lib
from arl_jax.learner import losses as losses_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.models import lora as lora_lib


def sft_step(state: train_state_lib.TrainState, batch: train_batch_lib.TrainBatch, *,
             frozen=None, graphdef, optimizer: optax.GradientTransformation, settings):
  """Cross-entropy on `loss_mask` tokens; same signature as `update.train_step`."""
  del settings

  def objective(params):
    whole = update_lib.whole(params, frozen)
    logp, _ = logprobs_lib.token_logprobs_and_entropy(graphdef, whole, batch.tokens,
                                                      batch.segment_ids, batch.positions, 1.0)
    return -losses_lib.masked_mean(logp, batch.loss_mask)

  loss, grads = jax.value_and_grad(objective)(state.params)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, {"loss": loss.astype(jnp.float32), "grad_norm": optax.global_norm(grads)}


def supervised_batch(prompt_ids: list[list[int]], demonstrations: list, *,
                     prompt_len: int, max_new_tokens: int,
                     pad_id: int) -> train_batch_lib.TrainBatch:
  """A TrainBatch whose completions are the given `env_api.Demonstration`s
  (loss on their policy tokens only, never on prompts or observations)."""
  b, length = len(prompt_ids), prompt_len + max_new_tokens
  # The TrainBatch layout: prompts end at column `prompt_len`, completions follow.
  prompts, prompt_mask = rows_lib.left_pad(prompt_ids, prompt_len, pad_id)
  completions, completion_mask = rows_lib.right_pad(
      [demo.completion_ids for demo in demonstrations], max_new_tokens, pad_id)
  loss_mask, _ = rows_lib.right_pad([demo.loss_mask for demo in demonstrations], max_new_tokens,
                                    0.0, np.float32)
  zeros_f = np.zeros((b,), np.float32)
  return train_batch_lib.from_rows(
      tokens=np.concatenate([prompts, completions], axis=1),
      token_mask=np.concatenate([prompt_mask, completion_mask], axis=1),
      loss_mask=np.concatenate([np.zeros((b, prompt_len), np.float32), loss_mask], axis=1),
      behaviour_logprobs=np.zeros((b, length), np.float32),
      token_versions=np.full((b, length), -1, np.int32), advantages=zeros_f, rewards=zeros_f)


def run_warmup(*, params, graphdef, mesh, optimizer, steps: int, batch_size: int, prompt_ids,
               demonstrations, prompt_len: int, max_new_tokens: int, pad_id: int, seed: int,
               log_fn=None, should_stop=None):
  """Runs `steps` supervised updates on random minibatches of (prompt, demonstration) pairs.

  Args (besides the data and its geometry):
    log_fn: `(step, metrics)`, called every 50 steps and at the last.
    should_stop: `() -> bool`, asked before every step; True ends the
      warm-up early (a stop was requested).

  Returns:
    `(params, steps_done)`: the updated params (same shardings as given) and
    how many steps ran (`steps` unless stopped). A model with LoRA adapters
    trains them only (and a critic's head, which gets no gradient here), as
    RL does.
  """
  trainable, frozen = lora_lib.split(params)
  state, state_shardings = train_state_lib.create(trainable, optimizer, mesh)
  step_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer, settings=None,
                                      state_shardings=state_shardings, mesh=mesh,
                                      step_fn=sft_step, frozen=frozen)
  # Stream 1 of the seed; stream 0 chose the warm-up subset (run_lib).
  rng = np.random.default_rng((seed, 1))
  for step in range(steps):
    if should_stop is not None and should_stop():
      return lora_lib.merge(state.params, frozen), step
    idx = rng.integers(0, len(prompt_ids), batch_size)
    batch = supervised_batch([prompt_ids[i] for i in idx], [demonstrations[i] for i in idx],
                             prompt_len=prompt_len, max_new_tokens=max_new_tokens, pad_id=pad_id)
    state, metrics = step_fn(state, batch)
    if log_fn is not None and (step % 50 == 0 or step == steps - 1):
      log_fn(step, jax.device_get(metrics))
  return lora_lib.merge(state.params, frozen), steps
