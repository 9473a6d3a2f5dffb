r"""Hugging Face import: seconds and peak host memory, against the checkpoint's size.

For each size, a random Qwen2-family model is built with `transformers` (torch,
CPU), saved as float32 safetensors, and imported by a fresh Python process
onto the 4-device fsdp learner mesh of 8 fake CPU devices (as `run_lib` does:
`hf_params.load_params`). That process reports:

- `import s`: `load_params` wall time (reading, layout change, device_put);
- `peak RSS MB`: the process's resident-set high-water mark (VmHWM) after the
  import minus its resident set just before it (JAX already initialised), and
  `RSS growth MB`: the resident set after minus before. On CPU the "devices"
  live in host memory, so the params themselves (`params MB`) are part of
  both: the import's own overhead is peak minus growth;
- `logits max |diff|`: against `transformers` on 2 x 32 tokens (the parity
  the tests check at tiny sizes).

  python benchmarks/hf_import.py --out=/tmp/hf_import.jsonl   # ~2 min
  python benchmarks/hf_import.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py, run as a script)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> Qwen2Config fields.
SIZES = {
    "tiny": dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "60M": dict(vocab_size=32_000, hidden_size=512, intermediate_size=1408, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=2),
    "250M": dict(vocab_size=64_000, hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4),
}

_CHILD = r"""
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, numpy as np, torch, transformers
from flax import nnx
import jax.numpy as jnp
from arl_jax.models import decoder as decoder_lib, hf_config, hf_params
from arl_jax.sharding import mesh_lib, rules as rules_lib
folder = sys.argv[1]
meshes = mesh_lib.make_role_meshes(
    mesh_lib.MeshConfig(placement="disaggregated", learner_devices=4), jax.devices()[:8])
cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
def rss_mb():
  with open("/proc/self/status") as f:
    return {k: int(v.split()[0]) / 1024 for k, v in (l.split(":", 1) for l in f)
            if k in ("VmRSS", "VmHWM")}
jax.block_until_ready(jnp.zeros(4))
before = rss_mb()
start = time.perf_counter()
graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
jax.block_until_ready(params)
seconds = time.perf_counter() - start
after = rss_mb()
tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32))
mask = jnp.ones(tokens.shape, bool)
ours = nnx.merge(graphdef, params)(jnp.asarray(tokens), decoder_lib.positions_from_mask(mask),
                                   decoder_lib.causal_mask(mask))[0]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
with torch.no_grad():
  theirs = model(torch.tensor(tokens)).logits.numpy()
print(json.dumps({"seconds": seconds, "peak_rss_mb": after["VmHWM"] - before["VmRSS"],
                  "rss_growth_mb": after["VmRSS"] - before["VmRSS"],
                  "diff": float(np.abs(np.asarray(ours) - theirs).max())}))
"""


def _measure(name: str, fields: dict) -> dict:
  import torch  # noqa: PLC0415 - the benchmark's own dependency (the dev extra)
  import transformers  # noqa: PLC0415

  with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**fields, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, safe_serialization=True)
    del model
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
               if f.endswith(".safetensors"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, folder], cwd=REPO, capture_output=True,
                          text=True, timeout=1200, env=dict(os.environ, XLA_FLAGS=""))
    if proc.returncode:
      raise RuntimeError(proc.stderr[-3000:])
    child = json.loads(proc.stdout.strip().splitlines()[-1])
  return {"benchmark": "hf_import", "model": name, "params M": round(num_params / 1e6, 1),
          "safetensors MB": round(size / 2**20, 1), "params MB": round(num_params * 4 / 2**20, 1),
          "import s": round(child["seconds"], 2), "peak RSS MB": round(child["peak_rss_mb"], 1),
          "RSS growth MB": round(child["rss_growth_mb"], 1),
          "logits max |diff|": f"{child['diff']:.1e}"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="append JSON rows here")
  parser.add_argument("--quick", action="store_true", help="the tiny model only")
  args = parser.parse_args()
  sizes = ["tiny"] if args.quick else list(SIZES)
  rows = [_measure(name, SIZES[name]) for name in sizes]
  report.print_table(rows, "Hugging Face import (float32 safetensors -> fsdp=4 learner mesh)")
  report.append_jsonl(rows, args.out)


if __name__ == "__main__":
  main()
