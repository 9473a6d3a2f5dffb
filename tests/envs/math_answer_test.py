"""The math-word-answer environment: answer extraction, numeric comparison, splits."""

import fractions
import time

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


# Answers the number rule gets wrong (not numbers), each right under the symbolic checker.
SYMBOLIC_CASES = [
    ("\\sqrt{2}/2", "\\boxed{\\frac{1}{\\sqrt{2}}}"),
    ("x^2+2x+1", "So the answer is (x+1)^2."),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}"),
    ("\\frac{\\pi}{3}", "\\boxed{60^\\circ \\cdot \\frac{\\pi}{180}}"),
]


@pytest.fixture(scope="module")
def symbolic_env():
  pytest.importorskip("math_verify")
  env = math_answer.MathAnswerEnv(
      math_answer.MathAnswerConfig(checker="symbolic", checker_timeout_s=3.0), TOK)
  yield env
  env.symbolic_checker().close()


@pytest.mark.parametrize("gold, completion", SYMBOLIC_CASES)
def test_the_symbolic_checker_takes_what_the_number_rule_refuses(symbolic_env, gold, completion):
  prompt = env_api.TextPrompt(prompt_id=0, text="q", answer=gold)
  ids = [*TOK.encode(completion), TOK.eos_id]
  assert symbolic_env.score(prompt, ids) == 1.0
  number_rule = _env()
  if math_answer.parse_number(gold) is None:  # (a data error there, counted as an env error)
    with pytest.raises(ValueError, match="not a number"):
      number_rule.score(prompt, ids)


def test_the_symbolic_checker_refuses_wrong_and_hostile_answers_in_time(symbolic_env):
  prompt = env_api.TextPrompt(prompt_id=0, text="q", answer="x^2+2x+1")
  score = lambda text: symbolic_env.score(prompt, [*TOK.encode(text), TOK.eos_id])  # noqa: E731
  assert score("\\boxed{(x+1)^3}") == 0.0
  assert score("#### 15") == 0.0
  checker = symbolic_env.symbolic_checker()
  start = time.monotonic()
  assert score("\\boxed{2^{2^{2^{20}}}}") == 0.0  # (sympy would compute it for ever)
  assert time.monotonic() - start < 3.0 + 10.0 and checker.counts["timeouts"] >= 1
  assert score("\\boxed{(x+1)^2}") == 1.0  # (a new child took the killed one's place)
  # Numbers still compare exactly, without a child.
  calls = checker.counts["calls"]
  number = env_api.TextPrompt(prompt_id=1, text="q", answer="3/4")
  assert symbolic_env.score(number, [*TOK.encode("#### 0.75"), TOK.eos_id]) == 1.0
  assert checker.counts["calls"] == calls


def test_the_checker_setting_is_checked():
  with pytest.raises(ValueError, match="env.checker must be one of"):
    math_answer.MathAnswerConfig(checker="sympy")
