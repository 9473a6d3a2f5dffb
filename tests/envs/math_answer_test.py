"""The math-word-answer environment: answer extraction, numeric comparison, splits."""

import fractions

import pytest

from arl_jax.envs import env_api, math_answer
from arl_jax.envs import tokenizer as tokenizer_lib

TOK = tokenizer_lib.ByteTokenizer()


@pytest.mark.parametrize("text, expected", [
    ("She has 3 + 4 = 7 pens.\n#### 7", "7"),
    ("#### 5 wait, no\n#### 1,200", "1,200"),  # the last marker wins
    ("so the total is \\boxed{3/4}.", "3/4"),
    ("\\boxed{\\frac{1}{2}} nested braces", "\\frac{1}{2}"),
    ("The answer is $12.50.", "$12.50"),
    ("Answer: -3", "-3"),
    ("I think 4, then 9", "9"),  # lenient: the last number
    ("so 1,2", "2"),  # a comma outside groups of three separates numbers
    ("#### -3.5", "-3.5"),
    ("#### 1,234,567", "1,234,567"),
    ("#### seventy", None),  # a marker without a number: nothing else to read
    ("no number at all", None),
    ("", None),
])
def test_extract_answer(text, expected):
  assert math_answer.extract_answer(text) == expected


def test_strict_extraction_accepts_only_marked_answers():
  assert math_answer.extract_answer("The answer is 5", strict=True) is None
  assert math_answer.extract_answer("#### 5", strict=True) == "5"
  assert math_answer.extract_answer("x \\boxed{5}", strict=True) == "5"


@pytest.mark.parametrize("text, value", [
    ("1,000", 1000), ("1000.0", 1000), ("$1000", 1000), ("3/4", fractions.Fraction(3, 4)),
    ("0.75", fractions.Fraction(3, 4)), ("40%", 40), ("7.", 7), ("-2", -2),
    ("\\frac{3}{4}", fractions.Fraction(3, 4)), ("\\dfrac{1}{2}", fractions.Fraction(1, 2)),
    ("50\\%", 50), ("-1,234.5", fractions.Fraction(-2469, 2)),
])
def test_parse_number(text, value):
  assert math_answer.parse_number(text) == value


@pytest.mark.parametrize("text", ["abc", "", "1/0", "1,2", "\\frac{x}{2}"])
def test_unparsable_numbers_are_none(text):
  assert math_answer.parse_number(text) is None


def _env(strict=False):
  return math_answer.MathAnswerEnv(math_answer.MathAnswerConfig(strict=strict), TOK)


@pytest.mark.parametrize("completion, reward", [
    ("#### 15", 1.0),
    ("11 + 4 = 15. #### 15.0", 1.0),
    ("#### 16", 0.0),
    ("I do not know", 0.0),  # malformed: nothing to extract
    ("", 0.0),  # empty
])
def test_score(completion, reward):
  prompt = env_api.TextPrompt(prompt_id=0, text="Ivo has 11 stamps and gets 4 more.",
                              answer="15")
  ids = [*TOK.encode(completion), TOK.eos_id]
  assert _env().score(prompt, ids) == reward


def test_truncated_completion_scores_zero_even_if_correct():
  prompt = env_api.TextPrompt(prompt_id=0, text="q", answer="15")
  assert _env().score(prompt, TOK.encode("#### 15")) == 0.0  # no EOS


def test_sample_splits_are_disjoint_and_demonstrations_are_rewarded():
  cfg = math_answer.MathAnswerConfig()
  train, heldout = (math_answer.make_prompts(cfg, s) for s in ("train", "heldout"))
  ids = [p.prompt_id for p in train] + [p.prompt_id for p in heldout]
  assert len(ids) == len(set(ids)) == 400
  assert 20 < len(heldout) < 80
  env = _env(strict=True)
  for p in train[:50]:
    assert env.score(p, env.demonstration(p).completion_ids) == 1.0


def test_a_reference_answer_that_is_not_a_number_is_an_error_not_a_zero(tmp_path):
  path = tmp_path / "gsm8k_raw.jsonl"
  path.write_text('{"prompt": "q", "answer": "She has 3 + 4 = 7 pens.\\n#### 7"}\n')
  with pytest.raises(ValueError, match=r"record id 0: answer .* is not a number"):
    math_answer.make_prompts(math_answer.MathAnswerConfig(path=str(path)), "train")
  # Scoring such a record is an environment fault (counted), never a silent 0.
  prompt = env_api.TextPrompt(prompt_id=5, text="q", answer="seven")
  with pytest.raises(ValueError, match="reference answer 'seven' is not a number"):
    _env().score(prompt, [*TOK.encode("#### 7"), TOK.eos_id])


def test_config_rejects_a_missing_file():
  with pytest.raises(ValueError, match="no such file"):
    math_answer.MathAnswerConfig(path="/nonexistent.jsonl")
