"""The Hugging Face `tokenizers` adapter, on a small BPE tokenizer built here."""

import pytest

from arl_jax.envs import hf_tokenizer
from arl_jax.testing import chat_templates

pytest.importorskip("tokenizers")


def test_round_trip_and_special_ids(tokenizer_path):
  tok = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", bos_token="<s>",
                                 pad_token="<pad>")
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size >= 5 + 256  # the specials of conftest.py, then bytes
  text = "Ann has 12 apples. #### 19"
  ids = tok.encode(text, add_bos=True)
  assert ids[0] == tok.bos_id and tok.eos_id not in ids
  assert tok.decode(ids) == text  # bos skipped
  assert tok.decode([*tok.encode("12"), tok.eos_id, *tok.encode("junk")]) == "12"
  assert tok.stop_ids == (tok.eos_id,)


def test_chatml_template(tokenizer_path):
  tok = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", chat_template="chatml")
  assert tok.pad_id == tok.eos_id  # defaults to EOS
  end = tok.encode("<|im_end|>")
  assert len(end) == 1 and tok.stop_ids == (tok.eos_id, end[0])
  text = tok.template.format_chat([{"role": "user", "content": "How many apples now?"}])
  assert text == "<|im_start|>user\nHow many apples now?<|im_end|>\n<|im_start|>assistant\n"
  ids = tok.encode(text)
  assert ids.count(tok.encode("<|im_start|>")[0]) == 2  # specials parsed as one id each
  # Decoding skips the template's specials and stops only at EOS.
  assert tok.decode([*tok.encode("19"), end[0], *tok.encode("7"), tok.eos_id, 5]) == "197"
  # Environments wrap a prompt in a user turn when the tokenizer has a template.
  from arl_jax.envs import env_api
  assert env_api.encode_user_prompt(tok, "How many apples now?") == tok.encode(text)
  plain = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", bos_token="<s>")
  assert env_api.encode_user_prompt(plain, "12") == [plain.bos_id, *plain.encode("12")]
  # The policy's turn ended on <|im_end|>: the observation starts with the
  # rest of that turn's suffix.
  obs = tok.template.observation("tool", "=482;")
  assert obs == "\n<|im_start|>tool\n=482;<|im_end|>\n<|im_start|>assistant\n"


def test_bad_tokenizer_settings_name_the_problem(tokenizer_path, tmp_path):
  with pytest.raises(ValueError, match="eos_token '<eos>' is not in the vocabulary"):
    hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="<eos>")
  with pytest.raises(ValueError, match=r"chat_template 'llama3' '<\|start_header_id\|>' is not"):
    hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", chat_template="llama3")
  with pytest.raises(ValueError, match="chat_template must be one of"):
    hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", chat_template="jinja")
  with pytest.raises(ValueError, match="no tokenizer file"):
    hf_tokenizer.HfTokenizer(str(tmp_path / "missing.json"), eos_token="</s>")
  tok = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>")
  assert tok.encode("12", add_bos=True) == tok.encode("12")  # no BOS token: nothing added


def test_a_chat_agent_run_with_a_tokenizer_json(tokenizer_path, tmp_path):
  """tool_agent end to end with the BPE tokenizer and chatml turns: the
  sampler stops on <|im_end|>, the tool answers in a `tool` turn."""
  import numpy as np

  from arl_jax.config import run_spec
  from arl_jax.testing import tiny
  from arl_jax.training import run_lib
  config = tiny.load_config("tool_agent", "tiny")
  config.tokenizer.update(kind="hf", path=tokenizer_path, eos_token="</s>", pad_token="<pad>",
                          chat_template="chatml")
  # Chat turns cost tokens: room for the template around prompt and tool answer.
  config.sampler.update(prompt_len=16, prompt_buckets=(16,), max_new_tokens=32)
  config.model.max_seq_len = 64
  config.num_steps = 2
  config.eval_every = 2
  spec = run_spec.build(config)
  tok = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", pad_token="<pad>",
                                 chat_template="chatml")
  eot = tok.end_of_turn_id
  assert spec.model.vocab_size == tok.vocab_size
  assert spec.sampling.eos_id == tok.eos_id and spec.sampling.stop_ids == (eot,)
  result = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  assert result.final_version == 2
  tool_turn = tok.encode("\n<|im_start|>tool\n")
  observed = 0
  for b in result.trained_batches:
    assert b["tokens"].max() < tok.vocab_size
    prompt_len = config.sampler.prompt_len
    sampled = (b["loss_mask"] > 0)[:, prompt_len:]
    observation = b["token_mask"][:, prompt_len:] & ~sampled
    completion = b["tokens"][:, prompt_len:]
    for row in np.flatnonzero(observation.any(axis=1)):
      # Each observation is a tool turn right after the policy ended its turn.
      first = int(np.argmax(observation[row]))
      assert completion[row, first - 1] == eot and sampled[row, first - 1]
      assert completion[row, first:first + len(tool_turn)].tolist() == tool_turn
      observed += 1
  assert observed > 0, "no episode called the tool"
  config.tokenizer.eos_token = "<eos>"
  with pytest.raises(run_spec.ConfigError, match="config.tokenizer: .*'<eos>' is not in"):
    run_spec.build(config)


def test_auto_settings_come_from_the_folder_s_tokenizer_config(tokenizer_path, tmp_path):
  """A Hugging Face folder names its special tokens and chat template in
  tokenizer_config.json: `auto` reads them (the Jinja template is recognised)."""
  import json
  import shutil

  from arl_jax.envs import hf_tokenizer

  folder = tmp_path / "model"
  folder.mkdir()
  shutil.copy(tokenizer_path, folder / "tokenizer.json")
  qwen_jinja = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}, "bos_token": None,
      "chat_template": qwen_jinja}))
  tok = hf_tokenizer.HfTokenizer(str(folder), eos_token="auto", bos_token="auto",
                                 pad_token="auto", chat_template="auto")
  assert tok.template.end_of_turn == "<|im_end|>"
  assert (tok.eos_id, tok.pad_id, tok.bos_id) == (
      tok._token_id("<|im_end|>", ""), tok._token_id("<pad>", ""), None)
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "</s>", "chat_template": "{{ bos_token }}[INST] {{ message }} [/INST]"}))
  with pytest.raises(ValueError, match="chat template is not one arl_jax implements"):
    hf_tokenizer.HfTokenizer(str(folder), eos_token="auto", chat_template="auto")
  assert hf_tokenizer.HfTokenizer(str(folder), eos_token="auto").eos_id == tok._token_id("</s>", "")


SMOLLM2_JINJA = chat_templates.SMOLLM2_JINJA


def test_a_folder_s_own_jinja_template_renders_prompts_as_transformers_does(
    tokenizer_path, tmp_path):
  """What the model's template adds (SmolLM2's default system turn) is in the
  prompt, exactly as transformers' apply_chat_template writes it; a template
  that cannot end a prompt with the assistant's turn is refused by name."""
  import json
  import shutil

  transformers = pytest.importorskip("transformers")
  from arl_jax.envs import chat_template, hf_tokenizer

  folder = tmp_path / "model"
  folder.mkdir()
  shutil.copy(tokenizer_path, folder / "tokenizer.json")
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": SMOLLM2_JINJA,
      "tokenizer_class": "PreTrainedTokenizerFast"}))
  ours = hf_tokenizer.HfTokenizer(str(folder), eos_token="auto", bos_token="auto",
                                  pad_token="auto", chat_template="auto")
  theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
  for messages in ([{"role": "user", "content": "Ann has 12 apples?"}],
                   [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "How many?"}]):
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.template.format_chat(messages) == want
  assert "named SmolLM" in ours.template.format_chat([{"role": "user", "content": "x"}])
  assert ours.template.end_of_turn == "<|im_end|>"  # (the named structure stays)
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|im_end|>", "chat_template": SMOLLM2_JINJA.split("{% if add_gen")[0]}))
  with pytest.raises(ValueError, match="does not end with the assistant's turn prefix"):
    hf_tokenizer.HfTokenizer(str(folder), eos_token="auto", chat_template="auto")
  assert chat_template.from_jinja(None).jinja is None


def test_a_corrupt_tokenizer_file_is_named(tokenizer_path, tmp_path):
  """A cut download: the `tokenizers` library's own error names no file."""
  import re

  path = tmp_path / "tokenizer.json"
  with open(tokenizer_path, encoding="utf-8") as f:
    path.write_text(f.read()[:200])
  with pytest.raises(ValueError, match=re.escape(f"{path}: not a tokenizer.json the tokenizers "
                                                 "library can load (corrupt or truncated?): ")):
    hf_tokenizer.HfTokenizer(str(tmp_path), eos_token="</s>")
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": ')
  with pytest.raises(ValueError,
                     match=re.escape(f"{tmp_path / 'tokenizer_config.json'}: not JSON")):
    hf_tokenizer.HfTokenizer(str(tmp_path), eos_token="auto")


def test_both_tokenizers_implement_the_tokenizer_protocol(tokenizer_path):
  """Every member `tokenizer.Tokenizer` declares, with the types it says."""
  import inspect

  from arl_jax.envs import tokenizer as tokenizer_lib
  chat = hf_tokenizer.HfTokenizer(tokenizer_path, eos_token="</s>", bos_token="<s>",
                                  chat_template="chatml")
  for tok in (tokenizer_lib.ByteTokenizer(), chat):
    assert isinstance(tok, tokenizer_lib.Tokenizer)
    assert all(isinstance(getattr(tok, name), int) for name in
               ("pad_id", "bos_id", "eos_id", "vocab_size", "end_of_turn_id"))
    assert isinstance(tok.add_bos, bool) and isinstance(tok.template.is_chat, bool)
    assert tok.eos_id in tok.stop_ids and tok.end_of_turn_id in tok.stop_ids
    for method in ("encode", "decode"):
      assert (list(inspect.signature(getattr(tok, method)).parameters)
              == list(inspect.signature(getattr(tokenizer_lib.Tokenizer, method)).parameters)[1:])
    ids = tok.encode("12", add_bos=True)
    assert ids[0] == tok.bos_id and tok.decode(ids) == "12"
