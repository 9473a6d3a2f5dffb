r"""LoRA against full fine-tuning: what trains, what the optimizer holds, what
a publish moves, the learner's step, the publish and the sampler's decode.

  python benchmarks/lora.py --out=/tmp/lora.jsonl     # ~8 min on 2 cores
  python benchmarks/lora.py --parts=sizes             # the planned sizes only (seconds)
  python benchmarks/lora.py --quick                   # tiny model, seconds

Parts (every number measured or planned in this run):

- `sizes`: trainable parameters, optimizer-state bytes (AdamW's two float32
  moments) and publish bytes per version (the sampler's dtype), full
  fine-tuning against LoRA at ranks 8, 16 and 64 on every projection
  ("all") or on attention only (q, k, v, o), for SmolLM2-135M's shape
  (Llama: 30 layers, d 576, 9 heads of 64, 3 KV heads, MLP 1,536, vocabulary
  49,152, tied; a float32 sampler, as `configs/smollm2.py` runs it) and for
  `configs/math_tpu.py`'s (Qwen2.5-0.5B: 494M parameters, a bfloat16
  sampler; `--dry_run` prints the same publish bytes, `Plan.publish_bytes`).
  `x` columns are full over LoRA.
- `step`: the learner's update (one device, 8 rows of 256 tokens), median of
  5 after a compiling one, and XLA's compiled memory for it, for the "3M"
  and "50M" decoders of `benchmarks/learner.py`: full against LoRA rank 16
  on every projection.
- `publish`: `WeightPublisher.publish` from a learner device to a sampler
  device (median of 10), full against LoRA rank 16, and what each moves;
  with LoRA, the base's one move when the publisher is built.
- `decode`: the sampler engine (32 slots, 16-token prompts, 64 one-rollout
  requests of 128 new tokens, one device) decoding with the adapters
  unmerged (two low-rank matmuls beside each adapted projection: what
  arl_jax runs) against the same weights merged into the base (a decoder
  without adapters: what merging at publish would decode with, and what a
  full fine-tuning run decodes), and the seconds a merge takes
  (`peft_adapters.merged`, jitted).
- `smollm2` (not in the default parts: ~17 min on 2 cores): the real model's shape
  (random weights) as `configs/smollm2.py` runs it: the learner's update
  (8 rows of 512 tokens, 2 microbatches, logits scored 1,024 at a time, the
  decoupled objective), full fine-tuning against rank 16 on every
  projection, and `decode` with 48 new tokens: the sampler's tokens/s with
  adapters (unmerged) against without (full fine-tuning's).

  python benchmarks/lora.py --parts=smollm2 --out=/tmp/lora.jsonl
- `smollm2_publish` (not in the default parts: ~1 min): `publish` for
  SmolLM2-135M's shape: full fine-tuning against rank 16 on every
  projection and on attention only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np
import optax

from arl_jax.learner import loss_settings
from arl_jax.learner import publish as publish_lib
from arl_jax.learner import train_state as train_state_lib
from arl_jax.learner import update as update_lib
from arl_jax.models import init_lib, lora, peft_adapters
from arl_jax.models import model_config as model_config_lib
from arl_jax.sampler import engine_config
from arl_jax.sharding import mesh_lib
from arl_jax.sharding import rules as rules_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_harness  # noqa: E402  (benchmarks/engine_harness.py)
import learner as learner_bench  # noqa: E402  (benchmarks/learner.py: models, batches)
import report  # noqa: E402  (benchmarks/report.py, run as a script)

SMOLLM2 = model_config_lib.ModelConfig(
    vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
    mlp_dim=1536, max_seq_len=2048)
# `configs/math_tpu.py`'s model (Qwen2.5-0.5B's config.json; its sampler runs in bfloat16).
QWEN25_05B = model_config_lib.ModelConfig(
    vocab_size=151_936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
    mlp_dim=4864, max_seq_len=768, qkv_bias=True, rope_theta=1e6)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _lora(rank: int, targets=tuple(lora.TARGETS)) -> lora.LoraConfig:
  return lora.LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets) if rank else lora.OFF


def _size_row(name, cfg, trainable, publish_bytes, full) -> dict:
  row = {"model": name, "rank": cfg.lora.rank,
         "targets": "-" if not cfg.lora.rank else
         "all" if len(cfg.lora.targets) == 7 else "attention",
         "trainable": trainable, "trainable %": round(100 * trainable / cfg.num_params, 3),
         "optimizer MiB": round(8 * trainable / 2**20, 2),
         "publish MiB": round(publish_bytes / 2**20, 2)}
  if full is not None:
    row.update({"trainable x": round(full["trainable"] / trainable, 1),
                "optimizer x": round(full["optimizer MiB"] / row["optimizer MiB"], 1),
                "publish x": round(full["publish MiB"] / row["publish MiB"], 1)})
  return row


def sizes(quick: bool) -> list[dict]:
  rows = []
  variants = [(0, ()), (8, lora.TARGETS), (16, lora.TARGETS), (64, lora.TARGETS),
              (16, ATTENTION)]
  for name, shape, sampler_bytes in (("SmolLM2-135M", SMOLLM2, 4), ("math_tpu", QWEN25_05B, 2)):
    for rank, targets in variants[:3] if quick else variants:
      cfg = dataclasses.replace(shape, lora=_lora(rank, tuple(targets)))
      trainable = cfg.adapter_params or cfg.num_params
      full = None if not rank else next(r for r in rows if r["model"] == name)
      rows.append(_size_row(name, cfg, trainable, sampler_bytes * trainable, full))
  return rows


def _mesh(devices):
  return jax.sharding.Mesh(np.array(devices).reshape(len(devices), 1), ("fsdp", "tp"))


def step(model: str, rank: int, rows: int, length: int, steps: int) -> dict:
  cfg = model_config_lib.ModelConfig(vocab_size=learner_bench.VOCAB, max_seq_len=length,
                                     lora=_lora(rank), **learner_bench.MODELS[model])
  mesh = _mesh(jax.devices()[:1])
  graphdef, params, _ = init_lib.init_params(cfg, mesh, rules_lib.LEARNER_RULES, 0)
  trainable, frozen = lora.split(params)
  optimizer = optax.adamw(1e-4)
  state, shardings = train_state_lib.create(trainable, optimizer, mesh)
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=loss_settings.LossSettings.of(),
                                        state_shardings=shardings, mesh=mesh, frozen=frozen)
  batch = learner_bench._batch(rows, length, prompt=length // 4)  # noqa: SLF001
  memory = learner_bench.compiled_bytes(update_fn, state, batch)
  seconds = learner_bench.median_step_seconds(update_fn, state, batch, steps)
  return {"model": model, "rank": rank, "trainable": cfg.adapter_params or cfg.num_params,
          "batch": f"{rows}x{length}", "step ms": round(1e3 * seconds, 1),
          "tokens/s": round(rows * length / seconds), "MiB/device": round(memory / 2**20, 1)}


def real_step(rank: int, steps: int, quick: bool) -> dict:
  """SmolLM2-135M's update as `configs/smollm2.py` runs it (random weights:
  the time does not depend on them): 8 packed rows of 512 tokens, logits
  scored 1,024 tokens at a time, 2 microbatches, the decoupled objective
  (tis_cap), one device; full fine-tuning against LoRA."""
  shape = dataclasses.replace(SMOLLM2, vocab_size=512, d_model=64, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=16, mlp_dim=128) if quick else SMOLLM2
  rows, length = (4, 64) if quick else (8, 512)
  cfg = dataclasses.replace(shape, max_seq_len=length, lora=_lora(rank))
  mesh = _mesh(jax.devices()[:1])
  graphdef, params, _ = init_lib.init_params(cfg, mesh, rules_lib.LEARNER_RULES, 0)
  trainable, frozen = lora.split(params)
  optimizer = optax.adamw(1e-4)
  state, shardings = train_state_lib.create(trainable, optimizer, mesh)
  settings = loss_settings.LossSettings.of(num_microbatches=2, logprob_chunk=1024, tis_cap=2.0,
                                           eps_high=0.28)
  update_fn = update_lib.make_update_fn(graphdef=graphdef, optimizer=optimizer,
                                        settings=settings, state_shardings=shardings, mesh=mesh,
                                        frozen=frozen)
  batch = learner_bench._batch(rows, length, prompt=length // 2)  # noqa: SLF001
  memory = learner_bench.compiled_bytes(update_fn, state, batch)
  seconds = learner_bench.median_step_seconds(update_fn, state, batch, steps)
  return {"model": "SmolLM2-135M" + (" (tiny)" if quick else ""), "rank": rank,
          "trainable": cfg.adapter_params or cfg.num_params, "batch": f"{rows}x{length}",
          "step s": round(seconds, 2), "tokens/s": round(rows * length / seconds),
          "MiB/device": round(memory / 2**20, 1)}


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def publish(model: str, rank: int, repeats: int, targets=tuple(lora.TARGETS)) -> dict:
  if model == "SmolLM2-135M":  # (its shape, random weights)
    cfg = dataclasses.replace(SMOLLM2, max_seq_len=256, lora=_lora(rank, targets))
  else:
    cfg = model_config_lib.ModelConfig(vocab_size=learner_bench.VOCAB, max_seq_len=256,
                                       lora=_lora(rank, targets), **learner_bench.MODELS[model])
  # (a learner device and a sampler device; one device holds both where there is one)
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(), devices=jax.devices()[:2])
  _, params, _ = init_lib.init_params(cfg, meshes.learner, rules_lib.LEARNER_RULES, 0)
  _, abstract = init_lib.abstract_model(cfg)
  shardings = rules_lib.state_shardings(abstract, meshes.sampler, rules_lib.SAMPLER_RULES)
  trainable, frozen = lora.split(params)
  start = time.perf_counter()
  publisher = publish_lib.WeightPublisher(meshes.learner, shardings,
                                          frozen=frozen if rank else None)
  jax.block_until_ready(publisher.frozen_base)  # (the base's one move)
  base_s = time.perf_counter() - start
  times = []
  for version in range(repeats + 1):
    start = time.perf_counter()
    publisher.publish(trainable, version)
    jax.block_until_ready(publisher.latest()[1])
    times.append(time.perf_counter() - start)
  return {"model": model, "rank": rank,
          "targets": "-" if not rank else "attention" if targets == ATTENTION else "all",
          "publish MiB": round(publisher.published_bytes / 2**20, 2),
          "publish ms": round(1e3 * statistics.median(times[1:]), 2),
          "base once ms": round(1e3 * base_s, 1) if rank else None}


def decode(model: str, rank: int, new_tokens: int, quick: bool = False) -> list[dict]:
  if model == "SmolLM2-135M":  # (its shape and vocabulary, random weights)
    cfg = dataclasses.replace(SMOLLM2, max_seq_len=16 + new_tokens + 16, lora=_lora(rank))
  else:
    cfg = model_config_lib.ModelConfig(vocab_size=259, max_seq_len=16 + new_tokens + 16,
                                       lora=_lora(rank), **learner_bench.MODELS[model])
  meshes = mesh_lib.make_role_meshes(mesh_lib.MeshConfig(), devices=jax.devices()[:1])
  graphdef, params, _ = init_lib.init_params(cfg, meshes.sampler, rules_lib.SAMPLER_RULES, 0)
  adapters, base = lora.split(params)
  params = lora.merge(jax.tree.map(lambda x: x + 0.01, adapters), base)  # (B off zero)
  merge = jax.jit(lambda p: peft_adapters.merged(p, cfg))
  jax.block_until_ready(merge(params))
  start = time.perf_counter()
  merged = jax.block_until_ready(merge(params))
  merge_s = time.perf_counter() - start
  base_graphdef, _ = init_lib.abstract_model(cfg.base)
  # --quick: 4 slots, nothing precompiled: the engines compile the few shapes they
  # use (precompiling every row bucket of 32 slots is most of a quick run).
  slots = 4 if quick else 32
  ecfg = engine_config.EngineConfig(prompt_len=16, num_slots=slots, group_size=1,
                                    max_new_tokens=new_tokens, precompile=not quick,
                                    kv_cache="dense", decode_burst=1)
  budgets = np.full((2 * slots,), new_tokens, np.int32)
  rows = []
  for how, c, g, p in (("unmerged", cfg, graphdef, params),
                       ("merged", cfg.base, base_graphdef, merged)):
    stats, _ = engine_harness.run_engine(c, meshes, g, p, ecfg, budgets, prompt_len=16,
                                         pad_id=256)
    rows.append({"model": model, "rank": rank, "decode": how,
                 "busy tok/s": round(stats.sampled_tokens / stats.busy_seconds, 1),
                 "decode ms/step": round(1e3 * stats.decode_seconds / max(stats.steps, 1), 3),
                 "merge ms": round(1e3 * merge_s, 2) if how == "merged" else None})
  rows[1]["vs unmerged"] = round(rows[1]["busy tok/s"] / rows[0]["busy tok/s"], 2)
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  parser.add_argument("--parts", default="sizes,step,publish,decode", help="comma-separated")
  args = parser.parse_args()
  parts = set(args.parts.split(","))
  models = ["tiny"] if args.quick else ["3M", "50M"]

  def done(part, table):  # each table printed and written as it is measured
    report.print_table(table, title=part)
    report.append_jsonl([{"benchmark": "lora", "part": part, **row} for row in table], args.out)

  if "sizes" in parts:
    done("sizes", sizes(args.quick))
  if "step" in parts:
    done("step", [step(m, r, 8, 64 if args.quick else 256, 2 if args.quick else 5)
                  for m in models for r in (0, 16)])
  if "publish" in parts:
    done("publish", [publish(m, r, 3 if args.quick else 10) for m in models for r in (0, 16)])
  if "decode" in parts:
    done("decode", [row for m in models[:1]
                    for row in decode(m, 16, 16 if args.quick else 128, args.quick)])
  if "smollm2" in parts:
    done("smollm2 step", [real_step(r, 2 if args.quick else 3, args.quick) for r in (0, 16)])
    if not args.quick:
      done("smollm2 decode", decode("SmolLM2-135M", 16, 48))
  if "smollm2_publish" in parts:
    done("smollm2 publish", [publish("SmolLM2-135M", r, 10, t)
                             for r, t in ((0, ()), (16, tuple(lora.TARGETS)), (16, ATTENTION))])


if __name__ == "__main__":
  main()
