r"""What fits where: Qwen2.5-0.5B/1.5B/7B, full and LoRA, on TPU v5e and H100 chips.

  python benchmarks/scaling.py                  # the docs/scaling.md table, ~30 s
  python benchmarks/scaling.py --devices=16 --kinds=tpu-v5e,tpu-v5p
  python benchmarks/scaling.py --quick          # 0.5B on v5e only (the test's)

Plans `configs/math_tpu.py` (asynchronous GRPO, 256 rollouts of up to 256 +
512 tokens an update, a disaggregated split: half the chips train with fsdp,
half sample with a bfloat16 copy, float32 learner params and AdamW) with
each model's published shapes (its `config.json`'s numbers, below: no
download) through the planner `--dry_run` uses (`training/dry_run.py`,
`training/fit.py`): the busiest learner and sampler chip, whether it fits
(`dry_run.USABLE` of the chip), and the largest batch and completion budget
that would. LoRA rows: rank 16 on every projection, the frozen base in
bfloat16. Each with the sampler's copy whole on a chip (tp 1) and split over
the widest tensor-parallel axis its KV heads allow, up to `--max_tp` (a 7B
sampler copy does not fit a 16 GiB chip whole).

The plan is exact for the arrays and rough for the learner's activations
(`dry_run.learner_activations`); `benchmarks/memory.py` checks it against
runs on CPU (`benchmarks/README.md`). No TPU or GPU ran these configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)

from arl_jax.config import base_config, builtin, run_spec  # noqa: E402
from arl_jax.models import hf_config, lora  # noqa: E402
from arl_jax.training import dry_run, fit  # noqa: E402

_GIB = 1024**3

# The shape keys of each model's published config.json (Hugging Face,
# Qwen/Qwen2.5-*-Instruct).
QWEN25 = {
    "Qwen2.5-0.5B": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True),
    "Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False),
}
LORA = lora.LoraConfig(rank=16, base_dtype="bfloat16")


def base_spec(num_devices: int, memory: int, sampler_tp: int) -> run_spec.RunSpec:
  """`configs/math_tpu.py`'s run on `num_devices` chips of `memory` bytes,
  with a stand-in model (replaced by `with_model`): the config reads its
  shapes and tokenizer from a folder this script does not need."""
  config = builtin.load("math_tpu", "/unused")
  defaults = base_config.make("math_answer")
  config.model.update(hf_path="", d_model=64, num_layers=1, num_heads=4, num_kv_heads=4,
                      head_dim=16, mlp_dim=128, rope_theta=1e6, tie_embeddings=True)
  config.tokenizer.update(defaults.tokenizer.to_dict())
  config.mesh.sampler = (("data", -1), ("tp", sampler_tp))
  return run_spec.build(config, list(range(num_devices)), device_memory=memory)


def with_model(spec: run_spec.RunSpec, name: str, adapters: bool) -> run_spec.RunSpec:
  hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "rope_theta": 1e6, "rms_norm_eps": 1e-6, **QWEN25[name]}
  model = hf_config.model_config_from_hf(hf, param_dtype=spec.model.param_dtype,
                                         max_seq_len=spec.model.max_seq_len)
  if adapters:
    model = dataclasses.replace(model, lora=LORA)
  sampler = dataclasses.replace(model, param_dtype=spec.sampler_model.param_dtype)
  return dataclasses.replace(spec, model=model, sampler_model=sampler)


def sampler_widths(name: str, max_tp: int) -> list[int]:
  """1 and the widest tp up to `max_tp` that divides the model's KV heads."""
  heads = QWEN25[name]["num_key_value_heads"]
  return sorted({1, max(t for t in range(1, max_tp + 1) if heads % t == 0)})


def row(name: str, adapters: bool, kind: str, num_devices: int, sampler_tp: int) -> dict:
  memory = fit.device_memory(kind)
  spec = with_model(base_spec(num_devices, memory, sampler_tp), name, adapters)
  plan = dry_run.plan(spec, num_devices)
  answers = fit.fit(spec, num_devices, memory)
  return {"benchmark": "scaling", "model": name, "training": "LoRA r16" if adapters else "full",
          "chips": f"{num_devices} x {kind}", "sampler tp": sampler_tp,
          "learner GiB/chip": round(plan.learner.peak / _GIB, 2),
          "sampler GiB/chip": round(plan.sampler.peak / _GIB, 2),
          "fits (256 x 768)": "yes" if answers.fits else "no",
          "largest batch": answers.largest_batch,
          "largest max_new_tokens": answers.largest_new_tokens}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="chips of each kind")
  parser.add_argument("--kinds", default="tpu-v5e,h100",
                      help=f"comma-separated, of {sorted(fit.DEVICE_KINDS)}")
  parser.add_argument("--max_tp", type=int, default=4, help="the sampler's widest tp")
  parser.add_argument("--quick", action="store_true", help="0.5B on tpu-v5e, tp 1")
  parser.add_argument("--out", default=None, help="JSON lines file to append rows to")
  args = parser.parse_args()
  models, kinds = list(QWEN25), args.kinds.split(",")
  if args.quick:
    models, kinds, args.max_tp = models[:1], ["tpu-v5e"], 1
  rows = [row(name, adapters, kind, args.devices, tp) for name in models
          for adapters in (False, True) for kind in kinds
          for tp in sampler_widths(name, args.max_tp)]
  report.print_table(rows, title=f"scaling: configs/math_tpu.py's run, {args.devices} chips, "
                     "planned (no accelerator ran it)")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
