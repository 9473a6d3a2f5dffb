r"""Synchronous GRPO in one file: the readable definition of the algorithm.

No threads, no buffer, no meshes, no KV cache. After the same supervised
warm-up as the package's (`learner/warmup.py`), each step samples a batch of
groups with the current params, scores them, computes group-normalised
advantages and applies one clipped-ratio update against the recorded
behaviour log-probs (which at zero lag equal the current ones up to float
rounding). The asynchronous system run with `max_async_level = 0`, `K = 0`,
`weight_update = "drain"` must reproduce this loss curve
(`tests/examples/minimal_grpo_test.py`).

It shares with the package only what defines the problem: the model, the
tokenizer and task, the prompt order (grain, seeded), and the per-rollout
random draws (`token_draw.row_keys`, `token_draw.sample_from_logits`), so that both
sample the same tokens.

  python examples/minimal_grpo.py --config=configs/arith.py:tiny
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from arl_jax.config import run_spec
from arl_jax.envs import arith, prompt_data
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.learner.objectives import clipped_ratio as clipped_ratio_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.sampler import token_draw


def logprobs_of(model, tokens, mask, temperature):
  """`[B, L]` log-prob of each token given its prefix (column 0 is 0)."""
  logits, _ = model(tokens, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)  # float32 logits
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 4, 7))
def _next_token(graphdef, params, tokens, mask, settings, keys, column, prompt_len):
  """Samples column `column` by a full forward over the whole (masked) sequence."""
  model = nnx.merge(graphdef, params)
  logits, _ = model(tokens, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  last = jnp.take_along_axis(logits, (column - 1)[None, None, None].repeat(tokens.shape[0], 0),
                             axis=1)[:, 0]
  # Draws are keyed by the offset within the completion, as in the sampler.
  draw = token_draw.sample_from_logits(last, keys, column - prompt_len, settings)
  return draw.tokens, draw.logprobs


def sample(graphdef, params, prompt_ids, keys, *, prompt_len, max_new_tokens, settings):
  """Left-padded prompts -> (tokens, mask, behaviour logprobs), all `[B, L]`."""
  b, length = len(prompt_ids), prompt_len + max_new_tokens
  tokens = np.full((b, length), settings.pad_id, np.int32)
  mask = np.zeros((b, length), bool)
  for i, ids in enumerate(prompt_ids):
    tokens[i, prompt_len - len(ids):prompt_len] = ids
    mask[i, prompt_len - len(ids):prompt_len] = True
  behaviour = np.zeros((b, length), np.float32)
  done = np.zeros((b,), bool)
  for col in range(prompt_len, length):
    tok, logp = jax.device_get(_next_token(graphdef, params, tokens, mask, settings, keys,
                                           jnp.int32(col), prompt_len))
    live = ~done
    tokens[live, col] = tok[live]
    mask[live, col] = True
    behaviour[live, col] = logp[live]
    done |= live & (tok == settings.eos_id)
  return tokens, mask, behaviour


def grpo_loss(params, graphdef, tokens, mask, behaviour, loss_mask, advantages, *, eps_low,
              eps_high, temperature):
  """Token-mean of -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A)."""
  logp = logprobs_of(nnx.merge(graphdef, params), tokens, mask, temperature)
  ratio = jnp.exp((logp - behaviour) * loss_mask)
  adv = advantages[:, None]
  per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
  return jnp.sum(per_token * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)


def warm_up(graphdef, params, spec, env, train_prompts, log):
  """Supervised steps on the correct answers of a fixed subset of the prompts."""
  w = spec.warmup
  num_chosen = max(1, int(w.fraction * len(train_prompts)))
  subset = np.random.default_rng((spec.run.seed, 0)).permutation(len(train_prompts))[:num_chosen]
  chosen = [train_prompts[i] for i in subset]
  optimizer = optim_lib.make_optimizer(spec.warmup_optim, w.steps)
  opt_state = optimizer.init(params)
  p_len, n_new = spec.engine.prompt_len, spec.engine.max_new_tokens
  rng = np.random.default_rng((spec.run.seed, 1))

  @jax.jit
  def step(params, opt_state, tokens, mask, target_mask):
    def nll(params):
      logp = logprobs_of(nnx.merge(graphdef, params), tokens, mask, 1.0)
      return -jnp.sum(logp * target_mask) / jnp.sum(target_mask)
    loss, grads = jax.value_and_grad(nll)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for i in range(w.steps):
    rows = [chosen[j] for j in rng.integers(0, len(chosen), w.batch_size)]
    tokens = np.full((len(rows), p_len + n_new), spec.sampling.pad_id, np.int32)
    mask = np.zeros(tokens.shape, bool)
    target_mask = np.zeros(tokens.shape, np.float32)
    for r, prompt in enumerate(rows):
      ids, target = env.encode_prompt(prompt), env.encode_target(prompt)
      tokens[r, p_len - len(ids):p_len + len(target)] = ids + target
      mask[r, p_len - len(ids):p_len + len(target)] = True
      target_mask[r, p_len:p_len + len(target)] = 1.0
    params, opt_state, loss = step(params, opt_state, tokens, mask, target_mask)
    if i % 50 == 0 or i == w.steps - 1:
      log(f"warmup {i:>4d} | loss {float(loss):.4f}")
  return params


def train(config, num_steps: int | None = None, log=print) -> list[dict]:
  """Runs warm-up then synchronous GRPO as configured; returns per-step records."""
  spec = run_spec.build(config)
  tokenizer = tokenizer_lib.ByteTokenizer()
  env = arith.ArithEnv(tokenizer)
  train_prompts = arith.make_prompts(spec.env, "train")
  prompts = prompt_data.prompt_iterator(train_prompts, spec.run.seed)
  model = decoder_lib.Decoder(spec.model, rngs=nnx.Rngs(spec.run.seed))
  graphdef, params = nnx.split(model)
  params = warm_up(graphdef, params, spec, env, train_prompts, log)
  optimizer = optim_lib.make_optimizer(spec.optim)
  opt_state = optimizer.init(params)
  clip = spec.loss.knob(clipped_ratio_lib.ClippedRatio)  # (the default loss's knobs)
  loss_kwargs = dict(eps_low=clip.eps_low, eps_high=clip.eps_high,
                     temperature=spec.loss.objective.temperature)
  grad_fn = jax.jit(jax.value_and_grad(grpo_loss), static_argnums=1,
                    static_argnames=tuple(loss_kwargs))
  g, groups = spec.orchestrator.group_size, spec.orchestrator.groups_per_batch
  group_ids = itertools.count()
  records = []
  for step in range(spec.run.num_steps if num_steps is None else num_steps):
    batch_prompts = [next(prompts) for _ in range(groups)]
    ids = [next(group_ids) for _ in range(groups)]
    rows = [(gid, s) for gid in ids for s in range(g)]
    keys = token_draw.row_keys(spec.run.seed, [r[0] for r in rows], [r[1] for r in rows])
    tokens, mask, behaviour = sample(
        graphdef, params, [env.encode_prompt(p) for p in batch_prompts for _ in range(g)], keys,
        prompt_len=spec.engine.prompt_len, max_new_tokens=spec.engine.max_new_tokens,
        settings=spec.sampling)
    completions = tokens[:, spec.engine.prompt_len:]
    rewards = np.array([env.score(p, completions[i * g + s])
                        for i, p in enumerate(batch_prompts) for s in range(g)], np.float32)
    grouped = rewards.reshape(groups, g)
    advantages = ((grouped - grouped.mean(1, keepdims=True))
                  / (grouped.std(1, keepdims=True) + 1e-6)).reshape(-1)
    loss_mask = mask.astype(np.float32)
    loss_mask[:, :spec.engine.prompt_len] = 0.0
    loss, grads = grad_fn(params, graphdef, tokens, mask, behaviour, loss_mask, advantages,
                          **loss_kwargs)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    records.append({"step": step, "loss": float(loss), "reward_mean": float(rewards.mean()),
                    "tokens": tokens, "behaviour_logprobs": behaviour})
    log(f"step {step:>4d} | reward {rewards.mean():.3f} | loss {float(loss):+.6f}")
  return records


if __name__ == "__main__":
  from absl import app
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", "configs/arith.py:tiny", "Config file.")

  def _main(argv):
    del argv
    train(_CONFIG.value)

  app.run(_main)
