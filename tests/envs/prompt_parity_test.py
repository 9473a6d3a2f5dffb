"""Prompt ids equal what the model's own tokenizer makes in transformers, for
every kind of tokenizer folder the tests use: a chat model's prompt is
`apply_chat_template(..., tokenize=True)`'s ids (the template writes the BOS,
if any, and nothing is added: SmolLM2 has `<|im_start|>` as its BOS token and
must not get it twice), plain text is `tokenizer(text)`'s (BOS where the folder
adds it)."""

import json
import shutil

import pytest

from arl_jax.envs import env_api, hf_tokenizer, math_answer
from arl_jax.testing import chat_templates

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["Which number is larger, 26 or 50? Reply with only the larger number.",
         "Ann has 12 apples.", "  spaced\tand\nnew lines  "]


def _folder(tmp_path, tokenizer_path, name, config, bos_post_processor=False):
  """A model folder: the test BPE tokenizer (with a post-processor that adds
  `<s>` when asked) and a tokenizer_config.json."""
  folder = tmp_path / name
  folder.mkdir()
  if bos_post_processor:
    tok = tokenizers.Tokenizer.from_file(tokenizer_path)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
  else:
    shutil.copy(tokenizer_path, folder / "tokenizer.json")
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", **config}))
  return str(folder)


FOLDERS = {
    # SmolLM2-135M-Instruct's: BOS <|im_start|>, never added; its template opens with it.
    "smollm2": (dict(add_bos_token=False, bos_token="<|im_start|>", eos_token="<|im_end|>",
                     chat_template=chat_templates.SMOLLM2_JINJA), False),
    # The same without the add_bos_token key: the post-processor (none) decides.
    "smollm2_no_key": (dict(bos_token="<|im_start|>", eos_token="<|im_end|>",
                            chat_template=chat_templates.SMOLLM2_JINJA), False),
    # A template that writes the BOS, which the tokenizer also adds to plain text.
    "bos_in_template": (dict(bos_token="<s>", eos_token="<|im_end|>",
                             chat_template=chat_templates.BOS_CHATML), True),
    # Base models: plain text, with and without a BOS.
    "plain_with_bos": (dict(add_bos_token=True, bos_token="<s>", eos_token="</s>"), True),
    "plain_without_bos": (dict(add_bos_token=False, bos_token="<s>", eos_token="</s>"), False),
}


def _theirs_prompt(theirs, text, chat):
  if not chat:
    return theirs(text).input_ids
  ids = theirs.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                   add_generation_prompt=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_prompt_ids_equal_transformers_for_every_test_folder(tokenizer_path, tmp_path, name):
  config, post_processor = FOLDERS[name]
  folder = _folder(tmp_path, tokenizer_path, name, config, post_processor)
  ours = hf_tokenizer.HfTokenizer(folder, eos_token="auto", bos_token="auto", pad_token="auto",
                                  chat_template="auto")
  theirs = transformers.AutoTokenizer.from_pretrained(folder)
  chat = "chat_template" in config
  for text in TEXTS:
    want = _theirs_prompt(theirs, text, chat)
    assert env_api.encode_user_prompt(ours, text) == want, (name, text)
  assert want[:2] != [ours.bos_id] * 2  # (never two BOS)
  # The environments encode through it.
  env = math_answer.MathAnswerEnv(math_answer.MathAnswerConfig(), ours)
  prompt = math_answer.make_prompts(math_answer.MathAnswerConfig(), "heldout")[0]
  assert env.encode_prompt(prompt) == _theirs_prompt(theirs, prompt.text, chat)


def test_a_converted_gguf_folder_s_prompts_equal_transformers(tmp_path):
  """The GGUF converter's folders, with the file's add_bos_token off (SmolLM2,
  Qwen2) and on (Llama 3): transformers reads the BOS from the folder's
  post-processor, llama.cpp from the flag; the folder says it both ways."""
  pytest.importorskip("gguf")
  from arl_jax.models import gguf_convert
  from arl_jax.testing import gguf_files
  for add_bos in (False, True):
    path = str(tmp_path / f"m_{add_bos}.gguf")
    gguf_files.write_llama(path, "F32", num_layers=1, add_bos_token=add_bos)
    folder = str(tmp_path / f"hf_{add_bos}")
    gguf_convert.convert(path, folder)
    ours = hf_tokenizer.HfTokenizer(folder, eos_token="auto", bos_token="auto",
                                    pad_token="auto", chat_template="auto")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.add_bos is add_bos
    for text in TEXTS:
      assert env_api.encode_user_prompt(ours, text) == _theirs_prompt(theirs, text, True)
      assert ours.encode(text, add_bos=ours.add_bos) == theirs(text).input_ids
    assert (theirs("12").input_ids[0] == ours.bos_id) is add_bos
