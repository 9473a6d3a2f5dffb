r"""Learner step benchmark: step time, tokens/s, model FLOP utilisation against
a matmul peak measured in the same run, and memory per device, for the ~3M
and ~50M decoders on learner meshes of fsdp in {1, 2, 4} (part `mfu`); and
packed against padded rows on long-tailed completion lengths (part `packing`).

  python benchmarks/learner.py --out=/tmp/learner.jsonl     # ~18 min on 2 cores
  python benchmarks/learner.py --parts=packing              # one part
  python benchmarks/learner.py --parts=objectives           # each loss and correction
  python benchmarks/learner.py --quick                      # tiny model, seconds

Packing: groups of rollouts with 32-token prompts and lognormal completion
lengths (median 64 or 512, p99 at the cap, the cap enforced), trained as
today's padded rows (one rollout a row, as wide as the batch's longest
completion rounded up to a power of two) and as packed rows
(`learner.pack_len`), the same batch in the same run (attention in blocks of
256 queries in both: whole-row scores of the padded batches do not fit this
machine's memory at these lengths). Trained tokens/s counts
loss-masked tokens only (what the loss sees); fill is the share of the rows'
columns that hold a token.

Long rows (part `long_row`): the update of one row of L tokens for the 50M
trunk with a vocabulary of V, compiled (not run) on one device: XLA's memory
per device against the bound `params + AdamW moments + gradients + one
logprob chunk's float32 logits`, with the memory controls on
(`logprob_chunk`, `attention_chunk`, `remat`) and off, the layers unrolled
or as one scan (`scan_layers`), and `--dry_run`'s rough estimate of the same.

Objectives (part `objectives`): the ~3M decoder's update (one device, 16 rows
of 256 tokens, one optimizer step) under each loss and mismatch correction,
side by side: what a loss or a correction costs the learner. A correction
makes the objective decoupled; with one optimizer step its proximal policy is
the differentiated log-probs themselves (no second forward pass). Names:
`--objectives=clipped_ratio,tis_cap,...` (`OBJECTIVES`).

Model FLOPs per step (the PaLM convention, Chowdhery et al., 2022): forward +
backward = 3 x forward, with forward = 2 x (matmul parameters) per token plus
attention `4 * layers * T * heads * head_dim` per token, the output projection
included, the embedding lookup excluded. MFU = model FLOP/s / peak, where the
peak is the best of five float32 2048^3 matmuls on one device, measured first.
On a CPU host the fake devices of an fsdp mesh share the same cores, so MFU
is against the whole machine's peak, not per device. Memory per device is
XLA's compiled estimate (arguments + outputs + temporaries - aliased, per
device of the SPMD program).
"""

from __future__ import annotations

import os

# Fake CPU devices for the fsdp meshes; must be set before JAX initialises.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from arl_jax.config import base_config  # noqa: E402
from arl_jax.core import packing as packing_lib  # noqa: E402
from arl_jax.core import rollout as rollout_lib  # noqa: E402
from arl_jax.core import train_batch as train_batch_lib  # noqa: E402
from arl_jax.learner import loss_settings  # noqa: E402
from arl_jax.learner import optim as optim_lib  # noqa: E402
from arl_jax.learner import train_state as train_state_lib  # noqa: E402
from arl_jax.learner import update as update_lib  # noqa: E402
from arl_jax.models import init_lib, lora  # noqa: E402
from arl_jax.models import model_config as model_config_lib  # noqa: E402
from arl_jax.sharding import mesh_lib  # noqa: E402
from arl_jax.sharding import rules as rules_lib  # noqa: E402
from arl_jax.training import dry_run  # noqa: E402
from arl_jax.training import start as start_lib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

MODELS = {
    "tiny": base_config.TINY_MODEL,
    "3M": dict(d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=768),
    "50M": dict(d_model=640, num_layers=10, num_heads=10, num_kv_heads=5, head_dim=64,
                mlp_dim=1920),
}
VOCAB = 260  # the byte tokenizer's 259, rounded to split over small meshes


def matmul_peak(size: int = 2048) -> float:
  """Best float32 FLOP/s of a `size^3` matmul on one device."""
  a = jnp.ones((size, size), jnp.float32)
  mm = jax.jit(lambda x: x @ x)
  mm(a).block_until_ready()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    mm(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size ** 3 / best


def step_flops(cfg: model_config_lib.ModelConfig, rows: int, length: int) -> float:
  """Model FLOPs of one forward + backward over `[rows, length]` tokens."""
  matmul_params = cfg.num_params - cfg.vocab_size * cfg.d_model  # no embedding lookup
  matmul_params += cfg.vocab_size * cfg.d_model  # ... but the (tied) output projection
  per_token = 2 * matmul_params + 4 * cfg.num_layers * length * cfg.num_heads * cfg.head_dim
  return 3.0 * per_token * rows * length


def median_step_seconds(update_fn, state, batch, steps: int) -> float:
  """Median wall time of `steps` updates after a first (compiling) one."""
  state, metrics = update_fn(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = update_fn(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def compiled_bytes(update_fn, state, batch) -> int:
  """XLA's compiled memory per device of one update: arguments + outputs +
  temporaries - aliased (the donated state)."""
  memory = update_fn.lower(state, batch).compile().memory_analysis()
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes
          + memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def _batch(rows: int, length: int, prompt: int, seed: int = 0) -> train_batch_lib.TrainBatch:
  rng = np.random.default_rng(seed)
  loss_mask = np.zeros((rows, length), np.float32)
  loss_mask[:, prompt:] = 1.0
  return train_batch_lib.from_rows(
      tokens=rng.integers(0, 256, (rows, length)).astype(np.int32),
      token_mask=np.ones((rows, length), bool), loss_mask=loss_mask,
      behaviour_logprobs=(rng.normal(-5.5, 0.1, (rows, length)) * loss_mask).astype(np.float32),
      token_versions=np.zeros((rows, length), np.int32),
      advantages=rng.normal(size=rows).astype(np.float32), rewards=np.zeros(rows, np.float32))


def bench(model: str, fsdp: int, rows: int, length: int, steps: int, peak: float) -> dict:
  cfg = model_config_lib.ModelConfig(vocab_size=VOCAB, max_seq_len=length, **MODELS[model])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:fsdp]).reshape(fsdp, 1), ("fsdp", "tp"))
  graphdef, params, _ = init_lib.init_params(cfg, mesh, rules_lib.LEARNER_RULES, 0)
  optimizer = optax.adamw(1e-4)
  state, shardings = train_state_lib.create(params, optimizer, mesh)
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=loss_settings.LossSettings.of(),
                                        state_shardings=shardings, mesh=mesh)
  batch = _batch(rows, length, prompt=length // 4)
  per_device = compiled_bytes(update_fn, state, batch)
  step = median_step_seconds(update_fn, state, batch, steps)
  flops = step_flops(cfg, rows, length)
  return {
      "benchmark": "learner", "model": model, "params M": round(cfg.num_params / 1e6, 1),
      "fsdp": fsdp, "batch": f"{rows}x{length}", "step ms": round(1e3 * step, 1),
      "tokens/s": round(rows * length / step), "GFLOP/s": round(flops / step / 1e9, 1),
      "peak GFLOP/s": round(peak / 1e9, 1), "MFU": round(flops / step / peak, 3),
      "MiB/device": round(per_device / 2 ** 20, 1),
  }


# Part `objectives`: name -> `LossSettings.of` fields (the update's settings).
OBJECTIVES = {
    "clipped_ratio": {},
    "tis_cap": dict(tis_cap=2.0),
    "seq_mask": dict(mismatch_mask="sequence"),
    "vtrace": dict(loss="vtrace"),
    "m2po": dict(loss="m2po"),
    "cispo": dict(loss="cispo"),
    "gspo": dict(loss="gspo", aggregation="seq_mean_token_mean"),
    "gspo_token": dict(loss="gspo_token", aggregation="seq_mean_token_mean"),
}


def bench_objective(name: str, model: str, rows: int, length: int, steps: int) -> dict:
  """One update's median time under objective `name` (`OBJECTIVES`)."""
  cfg = model_config_lib.ModelConfig(vocab_size=VOCAB, max_seq_len=length, **MODELS[model])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  graphdef, params, _ = init_lib.init_params(cfg, mesh, rules_lib.LEARNER_RULES, 0)
  optimizer = optax.adamw(1e-4)
  state, shardings = train_state_lib.create(params, optimizer, mesh)
  settings = loss_settings.LossSettings.of(**OBJECTIVES[name])
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=settings, state_shardings=shardings, mesh=mesh)
  step = median_step_seconds(update_fn, state, _batch(rows, length, prompt=length // 4), steps)
  return {"benchmark": "learner", "part": "objectives", "model": model,
          "batch": f"{rows}x{length}", "objective": name,
          "decoupled": settings.is_decoupled, "step ms": round(1e3 * step, 1),
          "tokens/s": round(rows * length / step)}


def long_tail_groups(num_rollouts: int, median: int, cap: int, prompt: int = 32,
                     group_size: int = 4, seed: int = 0) -> list[rollout_lib.Group]:
  """Groups of rollouts whose completion lengths are lognormal with this
  median and their 99th percentile at `cap` (longer ones cut at the cap)."""
  rng = np.random.default_rng(seed)
  sigma = np.log(cap / median) / 2.326  # the normal's 99th percentile
  lengths = np.clip(rng.lognormal(np.log(median), sigma, num_rollouts).astype(int), 1, cap)
  groups = []
  for g in range(num_rollouts // group_size):
    prompt_ids = rng.integers(0, 256, prompt).astype(np.int32)
    rollouts = []
    for i in range(group_size):
      n = int(lengths[g * group_size + i])
      rollouts.append(rollout_lib.Rollout(
          group_id=g, sample_index=i, prompt_ids=prompt_ids,
          completion_ids=rng.integers(0, 256, n).astype(np.int32),
          loss_mask=np.ones(n, np.float32),
          behaviour_logprobs=rng.normal(-5.5, 0.1, n).astype(np.float32),
          token_versions=np.zeros(n, np.int32), dispatch_version=0, finish_reason="stop",
          reward=float(rng.integers(0, 2))))
    groups.append(rollout_lib.Group(group_id=g, prompt_id=g, dispatch_version=0,
                                    rollouts=rollouts))
  return groups


def run_update(resolved):
  """`(update_fn, state, batch, groups)` of a resolved run config
  (`run_spec.resolve`): the run's update function and a fresh TrainState
  from the run's model (its HF folder's weights, or initialised), on one
  batch of the config's shape: `batch_size` rollouts in groups of
  `group_size`, prompts as long as the first held-out prompt, completions
  lognormal around 3/4 of the budget (capped at it), assembled as the run
  does (packed rows, its pad id). What `real_size.py` times and
  `memory.py` compiles."""
  spec = resolved.spec
  meshes = mesh_lib.make_role_meshes(spec.mesh)
  # As a fresh run starts: the folder's weights or an init, with LoRA's
  # adapters on the frozen base.
  graphdef, params = start_lib.initial_params(spec, meshes.learner, resuming=False,
                                              print_fn=lambda *_: None)
  trainable, frozen = lora.split(params)
  optimizer = optim_lib.make_optimizer(spec.optim, spec.run.num_steps, spec.loss.optimizer_steps)
  state, shardings = train_state_lib.create(trainable, optimizer, meshes.learner)
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=spec.loss, state_shardings=shardings,
                                        mesh=meshes.learner, frozen=frozen)
  budget = spec.engine.max_new_tokens
  inputs = resolved.inputs
  prompt = len(inputs.eval_env.encode_prompt(inputs.eval_prompts[0])) if inputs.eval_prompts else 32
  num_rollouts = spec.orchestrator.groups_per_batch * spec.orchestrator.group_size
  groups = long_tail_groups(num_rollouts, median=max(1, 3 * budget // 4), cap=budget,
                            prompt=min(prompt, spec.engine.prompt_len),
                            group_size=spec.orchestrator.group_size)
  batch = train_batch_lib.assemble(
      groups, prompt_len=spec.engine.prompt_len,
      max_new_tokens=train_batch_lib.completion_budget(groups, budget, spec.packing),
      pad_id=inputs.tokenizer.pad_id, advantage_estimator=spec.loss.objective.advantage,
      packing=spec.packing)
  return update_fn, state, batch, groups


def bench_packing(model: str, median: int, cap: int, num_rollouts: int, pack_len: int,
                  steps: int) -> list[dict]:
  """Padded and packed rows of one long-tailed batch, side by side."""
  cfg = model_config_lib.ModelConfig(vocab_size=VOCAB, max_seq_len=32 + 2 * cap,
                                     **MODELS[model])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  groups = long_tail_groups(num_rollouts, median, cap)
  kw = dict(prompt_len=32, pad_id=VOCAB - 1, advantage_estimator="grpo")
  layouts = {
      "padded": train_batch_lib.assemble(
          groups, max_new_tokens=train_batch_lib.completion_width(groups, cap), **kw),
      "packed": train_batch_lib.assemble(groups, max_new_tokens=cap,
                                         packing=packing_lib.Packing(
          pack_len=pack_len, attention_width=packing_lib.attention_width(cfg)), **kw)}
  rows = []
  for name, batch in layouts.items():
    graphdef, params, _ = init_lib.init_params(cfg, mesh, rules_lib.LEARNER_RULES, 0)
    optimizer = optax.adamw(1e-4)
    state, shardings = train_state_lib.create(params, optimizer, mesh)
    # Attention a block of queries at a time in both layouts: a padded
    # batch's whole-row scores do not fit this machine at these lengths.
    update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                          settings=loss_settings.LossSettings.of(attention_chunk=256),
                                          state_shardings=shardings, mesh=mesh)
    step = median_step_seconds(update_fn, state, batch, steps)
    trained = float(np.sum(batch.loss_mask))
    rows.append({
        "benchmark": "learner", "part": "packing", "model": model,
        "completions": f"median {median}, cap {cap}", "rollouts": num_rollouts,
        "layout": name, "rows x width": "x".join(map(str, batch.tokens.shape)),
        "fill": round(float(np.mean(batch.token_mask)), 3), "step ms": round(1e3 * step, 1),
        "trained tokens/s": round(trained / step)})
  rows[-1]["speedup"] = round(rows[-1]["trained tokens/s"] / rows[0]["trained tokens/s"], 2)
  return rows


def bench_long_row(model: str, vocab: int, length: int, controls: bool, scan: bool) -> dict:
  """Compiled memory of one `length`-token row's update (nothing runs)."""
  cfg = model_config_lib.ModelConfig(vocab_size=vocab, max_seq_len=length, **MODELS[model])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
  settings = loss_settings.LossSettings.of(
      **(dict(logprob_chunk=1024, attention_chunk=512, remat="block") if controls else {}),
      scan_layers=scan)
  graphdef, params, _ = init_lib.init_params(cfg, mesh, rules_lib.LEARNER_RULES, 0)
  optimizer = optax.adamw(1e-4)
  state, shardings = train_state_lib.create(params, optimizer, mesh)
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=settings, state_shardings=shardings, mesh=mesh)
  batch = jax.eval_shape(lambda: _batch(1, length, prompt=length // 8))
  start = time.perf_counter()
  measured = compiled_bytes(update_fn, state, batch)
  compile_s = time.perf_counter() - start
  chunk = settings.scoring.logprob_chunk or length
  bound = 4 * cfg.num_params * 4 + chunk * vocab * 4  # params, 2 moments, grads; a chunk
  estimate = 4 * cfg.num_params * 4 + dry_run.learner_activations(cfg, settings.scoring, 1, length)
  mib = lambda x: round(x / 2**20)
  return {"benchmark": "learner", "part": "long_row", "model": model,
          "params M": round(cfg.num_params / 1e6, 1), "V": vocab, "L": length,
          "controls": "chunks + remat" if controls else "off",
          "layers": "scan" if scan else "unrolled",
          "MiB/device": mib(measured), "bound MiB": mib(bound),
          "measured / bound": round(measured / bound, 2), "dry_run MiB": mib(estimate),
          "compile s": round(compile_s, 1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, fsdp 2, short rows")
  parser.add_argument("--parts", default="mfu,packing,objectives,long_row",
                      help="comma-separated parts to run")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
  parser.add_argument("--objectives", default=",".join(OBJECTIVES),
                      help="part objectives: comma-separated names of OBJECTIVES")
  parser.add_argument("--out", default=None, help="append JSON rows here")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  steps = 2 if args.quick else args.steps
  if "mfu" in parts:
    peak = matmul_peak(512 if args.quick else 2048)
    if args.quick:
      grid = [("tiny", 2, 8, 32)]
    else:
      # (as many fsdp devices as there are: one on a single GPU)
      grid = [(model, fsdp, rows, 128) for model, rows in (("3M", 32), ("50M", 16))
              for fsdp in (1, 2, 4) if fsdp <= jax.device_count()]
    rows = [bench(model, fsdp, r, length, steps, peak) for model, fsdp, r, length in grid]
    report.print_table(rows, title="learner step (clipped_ratio, AdamW, float32)")
    report.append_jsonl(rows, args.out)
  if "packing" in parts:
    cases = ([("tiny", 16, 128, 16, 256)] if args.quick else
             [("3M", 64, 1024, 64, 2048), ("3M", 512, 2048, 16, 2048)])
    rows = [row for model, median, cap, n, pack_len in cases
            for row in bench_packing(model, median, cap, n, pack_len, steps)]
    report.print_table(rows, title="packed vs padded learner rows (clipped_ratio, AdamW)")
    report.append_jsonl(rows, args.out)
  if "objectives" in parts:
    model, num_rows, length = ("tiny", 4, 64) if args.quick else ("3M", 16, 256)
    names = [n for n in args.objectives.split(",") if n]
    if args.quick and args.objectives == ",".join(OBJECTIVES):
      # (the suite runs --quick: two rows, a correction and a sequence-level loss;
      # clipped_ratio, the default, is the update of parts mfu and packing)
      names = ["tis_cap", "gspo"]
    unknown = sorted(set(names) - set(OBJECTIVES))
    if unknown:
      parser.error(f"unknown objective(s) {unknown}; known: {list(OBJECTIVES)}")
    rows = [bench_objective(name, model, num_rows, length, steps) for name in names]
    report.print_table(rows, title="learner update per objective (AdamW, float32, one device)")
    report.append_jsonl(rows, args.out)
  if "long_row" in parts:
    cases = ([("tiny", 4096, 1024, True, True), ("tiny", 4096, 1024, False, False)] if args.quick
             else [("50M", 151_936, 16_384, True, True), ("50M", 151_936, 16_384, True, False),
                   ("50M", 151_936, 4096, True, True), ("50M", 32_768, 16_384, True, True),
                   ("50M", 151_936, 16_384, False, False)])
    rows = [bench_long_row(*case) for case in cases]
    report.print_table(rows, title="memory of one long row's update (compiled, AdamW, float32)")
    report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
