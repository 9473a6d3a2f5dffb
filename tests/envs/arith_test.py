"""The arithmetic task, the byte tokenizer and the prompt stream."""

import itertools

import pytest

from arl_jax.envs import arith, prompt_data
from arl_jax.envs import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


def test_splits_are_disjoint_and_cover_all_pairs():
  cfg = arith.ArithConfig(max_operand=20)
  train = {p.prompt_id for p in arith.make_prompts(cfg, "train")}
  heldout = {p.prompt_id for p in arith.make_prompts(cfg, "heldout")}
  assert not train & heldout
  assert len(train | heldout) == 21 * 21
  assert 0.03 < len(heldout) / 441 < 0.2


def test_exact_answer_reward_requires_eos():
  env = arith.ArithEnv(TOK)
  prompt = arith.Prompt(prompt_id=0, text="12+30=", answer="42")
  assert env.score(prompt, TOK.encode("42") + [TOK.eos_id]) == 1.0
  assert env.score(prompt, TOK.encode("42") + [TOK.eos_id, 55]) == 1.0
  assert env.score(prompt, TOK.encode("43") + [TOK.eos_id]) == 0.0
  assert env.score(prompt, TOK.encode("42")) == 0.0  # cut off by the length limit
  assert env.score(prompt, [TOK.eos_id]) == 0.0  # empty answer
  assert env.score(prompt, TOK.encode("4two") + [TOK.eos_id]) == 0.0  # malformed
  assert env.score(prompt, [TOK.pad_id, TOK.bos_id, TOK.eos_id]) == 0.0  # specials only
  assert env.encode_target(prompt) == [52, 50, TOK.eos_id]


def test_tokenizer_round_trip_and_specials():
  ids = TOK.encode("3+4=", add_bos=True)
  assert ids[0] == TOK.bos_id and TOK.decode(ids) == "3+4="
  assert TOK.decode([*TOK.encode("héllo"), TOK.eos_id, 65]) == "héllo"
  assert TOK.vocab_size == 259


def test_prompt_stream_is_seeded_and_endless():
  prompts = arith.make_prompts(arith.ArithConfig(max_operand=3), "train")
  a = [p.prompt_id for p in itertools.islice(prompt_data.prompt_iterator(prompts, 1), 40)]
  b = [p.prompt_id for p in itertools.islice(prompt_data.prompt_iterator(prompts, 1), 40)]
  c = [p.prompt_id for p in itertools.islice(prompt_data.prompt_iterator(prompts, 2), 40)]
  assert a == b and a != c
  assert sorted(a[:len(prompts)]) == sorted(p.prompt_id for p in prompts)  # an epoch is a permutation


def test_bad_env_config():
  with pytest.raises(ValueError, match="operator"):
    arith.ArithConfig(operator="/")
  with pytest.raises(ValueError, match="heldout_fraction"):
    arith.ArithConfig(heldout_fraction=1.5)


@pytest.mark.parametrize("answer, ok", [
    ("19", True), ("-3", True), ("0", True),
    ("abc", False), ("1.5", False), (" 19", False), ("19\n", False), ("", False)])
def test_a_record_answer_must_be_an_integer(answer, ok):
  prompt = arith.Prompt(prompt_id=0, text="1+1=", answer=answer)
  if ok:
    arith.check_record(prompt)
  else:
    with pytest.raises(ValueError, match="field 'answer' must be an integer for env 'arith'"):
      arith.check_record(prompt)
