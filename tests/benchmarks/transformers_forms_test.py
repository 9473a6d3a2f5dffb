"""`transformers_eval.py --forms`: completions grouped by where their numbers
come from in the prompt, so that a reward earned by a false statement shows."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
import transformers_eval  # noqa: E402


def test_numbers_become_what_they_are():
  prompt = "Which number is larger, 26 or 50? Reply with only the larger number."
  form = transformers_eval.completion_form
  assert form(prompt, " 26 is larger than 50.", "50") == "{1} is larger than {answer}."
  assert form(prompt, "The larger number is 50.", "50") == "The larger number is {answer}."
  assert form(prompt, "It is 7, then 26", "50") == "It is {#}, then {1}"
  assert form("Is 3 or 5 or 4 odd?", "5 and 4", "3") == "{1} and {2}"
  assert form(prompt, "26 or 50", "") == "{1} or {2}"  # (no answer: places only)


def test_forms_rank_by_count_with_their_mean_reward():
  forms = [("{1} is larger than {answer}.", "26 is larger than 50.", 1.0),
           ("{1} is larger than {answer}.", "31 is larger than 45", 0.0),
           ("{1} is larger than {answer}.", "12 is larger than 40.", 1.0),
           ("The larger number is {answer}.", "The larger number is 50.", 1.0)]
  rows = transformers_eval.form_rows(forms, top=1)
  assert [(r["form"], r["count"], r["mean_reward"], r["example"]) for r in rows] == [
      ("{1} is larger than {answer}.", 3, 0.667, "26 is larger than 50.")]


def test_a_hostile_completion_is_read_as_text_and_its_row_stays_short():
  """Model-written text: an answer or completion with regex characters is
  matched literally, and a 200k-character completion gives an 80-character row."""
  form = transformers_eval.completion_form
  assert form("Is (.*) 3?", r"(.*) 3 [\d+]", "(.*)") == r"(.*) {1} [\d+]"
  huge = "9." * 100_000
  rows = transformers_eval.form_rows([(form("1 or 2", huge, "2"), huge, 0.0)], top=5)
  assert len(rows) == 1 and len(rows[0]["form"]) == 80 and len(rows[0]["example"]) == 80
