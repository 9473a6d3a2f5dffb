"""Symbolic answer equivalence with math-verify (the `[math]` extra), for a
`child_calls.ChildPool`: it runs in a child process, since a hostile answer
(`2^{2^{2^{20}}}`) can keep sympy busy for ever and math-verify's own
timeouts use SIGALRM, which only the main thread may set."""

from __future__ import annotations


def equivalent(gold: str, answer: str) -> bool:
  """Whether `answer` equals `gold` as mathematics (fractions, decimals,
  expressions, sets, LaTeX), math-verify's `verify` on both parsed as LaTeX
  or plain expressions. No timeouts here: the pool's child is killed instead."""
  import math_verify  # noqa: PLC0415 - the [math] extra, in the child only

  def parse(text: str):
    return math_verify.parse(f"${text}$", parsing_timeout=None)

  gold_parsed, answer_parsed = parse(gold), parse(answer)
  if not gold_parsed or not answer_parsed:
    return False
  return bool(math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=None))
