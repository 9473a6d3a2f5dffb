r"""Synchronous GRPO in one file: the readable definition of the algorithm.

No threads, no buffer, no meshes, no KV cache. Each step samples a batch of
groups with the current params, scores them, computes group-normalised
advantages and applies one clipped-ratio update against the recorded
behaviour log-probs (which at zero lag equal the current ones up to float
rounding). The asynchronous system run with `max_async_level = 0`, `K = 0`,
`weight_update = "drain"` must reproduce this loss curve
(`tests/examples/minimal_grpo_test.py`).

It shares with the package only what defines the problem: the model, the
tokenizer and task, the prompt order (grain, seeded), and the per-rollout
random draws (`sampling.row_keys`, `sampling.sample_from_logits`), so that both
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

from arl_jax import config_lib
from arl_jax.envs import arith
from arl_jax.envs import prompt_data
from arl_jax.envs import tokenizer as tokenizer_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.models import decoder as decoder_lib
from arl_jax.sampler import sampling


def logprobs_of(model, tokens, mask, temperature):
  """`[B, L]` log-prob of each token given its prefix (column 0 is 0)."""
  logits, _ = model(tokens, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  logp = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)  # float32 logits
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _next_token(graphdef, params, tokens, mask, settings, keys, column):
  """Samples column `column` by a full forward over the whole (masked) sequence."""
  model = nnx.merge(graphdef, params)
  logits, _ = model(tokens, decoder_lib.positions_from_mask(mask), decoder_lib.causal_mask(mask))
  last = jnp.take_along_axis(logits, (column - 1)[None, None, None].repeat(tokens.shape[0], 0),
                             axis=1)[:, 0]
  return sampling.sample_from_logits(last, keys, column, settings)


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
                                           jnp.int32(col)))
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


def train(config, num_steps: int | None = None, log=print) -> list[float]:
  """Runs synchronous GRPO as configured; returns the loss of every step."""
  spec = config_lib.build(config)
  if spec.warmup.steps:
    raise ValueError("minimal_grpo has no warm-up phase: set warmup.steps=0")
  tokenizer = tokenizer_lib.ByteTokenizer()
  env = arith.ArithEnv(tokenizer)
  prompts = prompt_data.prompt_iterator(arith.make_prompts(spec.env, "train"), spec.seed)
  model = decoder_lib.Decoder(spec.model, rngs=nnx.Rngs(spec.seed))
  graphdef, params = nnx.split(model)
  optimizer = optim_lib.make_optimizer(spec.optim)
  opt_state = optimizer.init(params)
  loss_kwargs = dict(eps_low=spec.loss.eps_low, eps_high=spec.loss.eps_high,
                     temperature=spec.loss.temperature)
  grad_fn = jax.jit(jax.value_and_grad(grpo_loss), static_argnums=1,
                    static_argnames=tuple(loss_kwargs))
  g, groups = spec.dispatch.group_size, spec.dispatch.groups_per_batch
  group_ids = itertools.count()
  losses = []
  for step in range(spec.num_steps if num_steps is None else num_steps):
    batch_prompts = [next(prompts) for _ in range(groups)]
    ids = [next(group_ids) for _ in range(groups)]
    rows = [(gid, s) for gid in ids for s in range(g)]
    keys = sampling.row_keys(spec.seed, [r[0] for r in rows], [r[1] for r in rows])
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
    losses.append(float(loss))
    log(f"step {step:>4d} | reward {rewards.mean():.3f} | loss {float(loss):+.6f}")
  return losses


if __name__ == "__main__":
  from absl import app
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file("config", "configs/arith.py:tiny", "Config file.")

  def _main(argv):
    del argv
    config = _CONFIG.value
    with config.unlocked():
      config.warmup.steps = 0
    train(config)

  app.run(_main)
