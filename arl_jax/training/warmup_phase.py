"""The supervised warm-up before RL, as a run wires it (fresh starts only)."""

from __future__ import annotations

from arl_jax.config import inputs as inputs_lib
from arl_jax.learner import optim as optim_lib
from arl_jax.learner import warmup as warmup_lib
from arl_jax.training import run_context


def warm_up(run: run_context.RunContext, params):
  """Evaluates the starting params, then runs `warmup.steps` supervised steps
  on a `warmup.fraction` subset of the training prompts.

  A stop request ends it between two steps: nothing of a warm-up is saved (no
  checkpoint exists before RL starts), so the stop is recorded and a rerun
  starts over (setting this run's records aside, `records.py`).

  Returns:
    `(params, finished)`: the warmed-up params, and False if it was stopped.
  """
  spec, stop = run.spec, run.stop
  w = spec.warmup
  run.eval_log(params, 0, "warmup")
  chosen = inputs_lib.warmup_subset(spec, run.inputs)
  env = run.inputs.env

  optim = spec.warmup_optim
  rate = optim_lib.learning_rate(optim, w.steps)

  def log(step, metrics):
    run.writer.write({"phase": "warmup", "step": step, **metrics, "lr": float(rate(step))})
    run.print_fn(f"warmup {step:>4d} | loss {float(metrics['loss']):.4f}")

  stop.phase = "warm-up"
  params, done = warmup_lib.run_warmup(
      params=params, graphdef=run.graphdef, mesh=run.meshes.learner,
      optimizer=optim_lib.make_optimizer(optim, w.steps), steps=w.steps,
      batch_size=w.batch_size, prompt_ids=[env.encode_prompt(p) for p in chosen],
      demonstrations=[env.demonstration(p) for p in chosen], prompt_len=spec.engine.prompt_len,
      max_new_tokens=spec.engine.max_new_tokens, pad_id=run.pad_id, seed=spec.run.seed,
      log_fn=log, should_stop=lambda: bool(stop))
  if done == w.steps:
    return params, True
  run.writer.write({"phase": "stopped", "during": "warmup", "step": done, "steps": w.steps,
                    "reason": stop.reason})
  run.print_fn(f"stopping during the warm-up after {done} of {w.steps} steps: {stop.reason}; "
               "nothing is saved before RL starts, so a rerun starts over")
  return params, False
