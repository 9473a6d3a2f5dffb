"""`configs/smollm2.py` (a pretrained chat model from a converted GGUF file),
run end to end on a small GGUF file the test writes: the folder's weights,
its byte-level tokenizer and its own Jinja chat template, the shipped
`larger.jsonl` prompts scored by `math_answer`, one asynchronous update."""

import pytest

from arl_jax.config import run_spec
from arl_jax.envs import env_api
from arl_jax.models import gguf_convert
from arl_jax.testing import gguf_files, tiny
from arl_jax.training import run_lib

pytest.importorskip("gguf")


def test_the_smollm2_config_runs_on_a_converted_gguf_folder(tmp_path):
  gguf_files.write_llama(str(tmp_path / "m.gguf"), "Q8_0", d_model=64, num_heads=2,
                         num_kv_heads=1, mlp_dim=64, num_layers=1)
  folder = str(tmp_path / "hf")
  gguf_convert.convert(str(tmp_path / "m.gguf"), folder)
  config = tiny.load_config("smollm2", folder)
  assert config.model.hf_path == folder and config.tokenizer.chat_template == "auto"
  # The test model's vocabulary has few merges: a prompt is ~one token a character.
  config.sampler.update(prompt_len=160, max_new_tokens=8, num_slots=16, precompile=False)
  config.model.max_seq_len = 192
  config.orchestrator.batch_size = 16
  config.learner.pack_len = 0
  config.update(num_steps=1, eval_every=1, eval_size=4)
  config.checkpoint.update(every_steps=0, save_final=False)
  resolved = run_spec.resolve(config)
  prompt = resolved.inputs.eval_prompts[0]
  text = resolved.inputs.tokenizer.decode(env_api.encode_user_prompt(
      resolved.inputs.tokenizer, prompt.text))
  assert prompt.text in text and "Reply with only the larger number." in text
  lines = []
  result = run_lib.run(config, str(tmp_path / "run"), print_fn=lines.append)
  assert result.complete and result.final_version == 1
  assert any(line.startswith(f"imported {folder}") for line in lines)
  assert [r["step"] for r in result.eval_history] == [0, 1]


def test_the_smollm2_config_names_its_missing_argument():
  with pytest.raises(ValueError, match="needs the converted SmolLM2 folder as its argument"):
    tiny.load_config("smollm2", None)
