"""A judge behind any OpenAI-compatible server (vLLM, SGLang, `python -m
arl_jax.serve`, a hosted API).

Each question is one `/chat/completions` request for a single token at
temperature 0 with `top_logprobs=20`; the verdict weighs the value of each
returned candidate whose text, stripped, is an answer the verdict counts
(`JudgeConfig.answer_values`: a yes or a no word, or a score's digit) by its
probability: P(yes) / (P(yes) + P(no)), or the expected score. A server
that returns none of them among its top candidates gives no verdict, which
is a counted fault (as are HTTP errors, timeouts and answers that are not a
chat completion). The answer is read size-capped, as
untrusted input. Calls come from the environment's worker threads, which
bound how many are in flight.
"""

from __future__ import annotations

import json
import math
import os
import urllib.error
import urllib.request

from arl_jax.judges import judge_config

_MAX_ANSWER_BYTES = 1 << 20


class JudgeError(Exception):
  """The judge gave no verdict (not the completion's fault)."""


class OpenAIJudge:
  def __init__(self, cfg: judge_config.JudgeConfig):
    self.cfg = cfg
    self._url = cfg.url.rstrip("/") + "/chat/completions"
    self._headers = {"Content-Type": "application/json"}
    if cfg.api_key_env:
      key = os.environ.get(cfg.api_key_env)
      if not key:
        raise ValueError(f"judge.api_key_env: ${cfg.api_key_env} is not set")
      self._headers["Authorization"] = f"Bearer {key}"
    self._values = {w.strip(): v for w, v in cfg.answer_values().items()}

  def request(self, prompt_text: str, completion_text: str) -> dict:
    question = self.cfg.question(prompt_text, completion_text)
    return {"model": self.cfg.model, "messages": [{"role": "user", "content": question}],
            "max_tokens": 1, "temperature": 0.0, "logprobs": True, "top_logprobs": 20}

  def verdict(self, prompt_text: str, completion_text: str) -> float:
    body = json.dumps(self.request(prompt_text, completion_text)).encode("utf-8")
    request = urllib.request.Request(self._url, data=body, headers=self._headers,
                                     method="POST")
    try:
      with urllib.request.urlopen(request, timeout=self.cfg.timeout_s) as response:
        raw = response.read(_MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as e:
      raise JudgeError(f"{self._url} answered HTTP {e.code}: "
                       f"{e.read(300).decode('utf-8', 'replace')}") from e
    except (urllib.error.URLError, OSError) as e:
      raise JudgeError(f"{self._url}: {getattr(e, 'reason', e)}") from e
    if len(raw) > _MAX_ANSWER_BYTES:
      raise JudgeError(f"{self._url} answered more than 1 MiB")
    return self.verdict_of(raw)

  def verdict_of(self, raw: bytes) -> float:
    """The verdict a chat completion answer (its first token's candidates) gives."""
    try:
      candidates = json.loads(raw)["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
      pairs = [(str(c["token"]).strip(), float(c["logprob"])) for c in candidates]
    except (ValueError, KeyError, IndexError, TypeError) as e:
      raise JudgeError(f"{self._url} answered no chat completion with top_logprobs: "
                       f"{e!r}") from e
    counted = [(math.exp(lp), self._values[token]) for token, lp in pairs
               if token in self._values]
    total = sum(p for p, _ in counted)
    if total == 0.0:
      raise JudgeError(f"none of the judge's top answers is one it counts "
                       f"({sorted(self._values)}): {[token for token, _ in pairs][:8]}")
    return sum(p * v for p, v in counted) / total

  def close(self) -> None:
    pass
