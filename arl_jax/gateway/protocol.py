"""The requests the gateway accepts, as pydantic models, and its errors.

Fields are OpenAI's (chat and legacy completions), plus the vLLM extensions
clients rely on (`return_token_ids`, `skip_special_tokens`, `stop_token_ids`,
`top_k`, `min_p`, `chat_template_kwargs`, ...). An unknown field is an error
that names it, not silently ignored: a client that sets `frequency_penalty`
or a misspelt key must know it had no effect. Fields whose only supported
value is the default (penalties, `logit_bias`, `response_format`) are
accepted at that value and refused otherwise (`unsupported`).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic


class GatewayError(Exception):
  """An error a client gets as OpenAI's error object, with its HTTP status."""

  def __init__(self, status: int, message: str, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = (
        status, message, param, kind, code)

  def to_json(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


class _Model(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(extra="forbid")


class FunctionSpec(_Model):
  name: str = pydantic.Field(min_length=1, max_length=256)
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None


class Tool(_Model):
  type: Literal["function"] = "function"
  function: FunctionSpec


class FunctionCall(_Model):
  name: str = pydantic.Field(min_length=1, max_length=256)
  arguments: str = "{}"


class ToolCallIn(_Model):
  id: str = ""
  type: Literal["function"] = "function"
  function: FunctionCall
  index: int | None = None  # (a streamed call's position, sent back by some clients)


class Message(_Model):
  role: str
  content: str | list[dict[str, Any]] | None = None
  name: str | None = None
  tool_calls: list[ToolCallIn] | None = None
  tool_call_id: str | None = None
  # What the openai client sends back of an answer it received.
  refusal: str | None = None
  annotations: list | None = None
  audio: Any = None
  function_call: Any = None
  reasoning_content: str | None = None


class StreamOptions(_Model):
  include_usage: bool = False
  continuous_usage_stats: bool = False


class _Penalties(_Model):
  """vLLM's knobs that change the distribution sampled from: declared (at
  their neutral values) so that any other value is refused by name, never
  dropped (`_Sampling.unsupported`)."""

  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  logit_bias: dict[str, float] | None = None
  min_tokens: int = 0
  ignore_eos: bool = False


class _Sampling(_Penalties):
  """What chat and completions requests share."""

  model: str
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  min_p: float | None = None
  n: int = pydantic.Field(1, ge=1)
  max_tokens: int | None = pydantic.Field(None, ge=1)
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  seed: int | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = pydantic.Field(None, max_length=256)
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  return_token_ids: bool = False
  return_tokens_as_token_ids: bool = False

  def stops(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

  def unsupported(self) -> list[tuple[str, str]]:
    """`(field, why)` of every field set to a value the sampler cannot honour."""
    found = []
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_tokens", 0), ("ignore_eos", False)):
      if getattr(self, name) != default:
        found.append((name, f"only {default!r} is supported: the sampler draws from the "
                            "policy's own distribution, whose log-probs the learner trains on"))
    if self.logit_bias:
      found.append(("logit_bias", "not supported: it would change the behaviour distribution"))
    return found


class ChatCompletionRequest(_Sampling):
  messages: list[Message] = pydantic.Field(min_length=1)
  tools: list[Tool] | None = None
  tool_choice: str | dict[str, Any] | None = None
  parallel_tool_calls: bool | None = None
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)
  response_format: dict[str, Any] | None = None
  chat_template_kwargs: dict[str, Any] | None = None
  metadata: dict[str, str] | None = None
  store: bool | None = None

  def unsupported(self) -> list[tuple[str, str]]:
    found = super().unsupported()
    if self.response_format and self.response_format.get("type") not in (None, "text"):
      found.append(("response_format", "only {'type': 'text'}: the sampler does no "
                                       "constrained decoding"))
    if isinstance(self.tool_choice, dict) or self.tool_choice == "required":
      found.append(("tool_choice", "only 'auto' and 'none': forcing a call needs constrained "
                                   "decoding, and the behaviour policy must be the model's own"))
    elif self.tool_choice not in (None, "auto", "none"):
      found.append(("tool_choice", f"unknown value {self.tool_choice!r}"))
    if self.top_logprobs and not self.logprobs:
      found.append(("top_logprobs", "needs logprobs=true"))
    return found

  def alternatives(self) -> int:
    """The most likely alternatives asked for beside each sampled token."""
    return (self.top_logprobs or 0) if self.logprobs else 0


class CompletionRequest(_Sampling):
  prompt: str | list[int] | list[str] | list[list[int]]
  logprobs: int | None = pydantic.Field(None, ge=0, le=5)
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None

  def unsupported(self) -> list[tuple[str, str]]:
    found = super().unsupported()
    if self.echo:
      found.append(("echo", "not supported"))
    if self.suffix:
      found.append(("suffix", "not supported"))
    if self.best_of not in (None, 1, self.n):
      found.append(("best_of", "only equal to n"))
    return found

  def alternatives(self) -> int:
    """The most likely alternatives asked for beside each sampled token."""
    return self.logprobs or 0

  def prompts(self) -> list[str | list[int]]:
    """The prompts (a batch, or one)."""
    p = self.prompt
    if isinstance(p, str):
      return [p]
    if p and all(isinstance(x, int) for x in p):
      return [list(p)]
    return list(p)


class GenerateSampling(_Penalties):
  """vLLM's `sampling_params` on its token-in `/inference/v1/generate`."""

  model_config = pydantic.ConfigDict(extra="ignore")  # (engine knobs this sampler has not)
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  min_p: float | None = None
  max_tokens: int | None = pydantic.Field(None, ge=1)
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  seed: int | None = None
  n: int = pydantic.Field(1, ge=1)
  logprobs: int | None = None
  skip_special_tokens: bool = True
  include_stop_str_in_output: bool = False
  # (the penalties: refused as on the other endpoints, `checked`, rather than
  # dropped with the unknown keys; clients pass their sampling config through
  # verbatim, as verifiers' train client does)

  def checked(self, model: str) -> CompletionRequest:
    """These settings as the request the gateway's sampling checks read."""
    return CompletionRequest(model=model, prompt=[0], **self.model_dump(include={
        "temperature", "top_p", "top_k", "min_p", "n", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos"}))


class GenerateRequest(_Model):
  """The token-in generate request (what `renderers.client.generate` sends)."""

  model: str
  token_ids: list[int] = pydantic.Field(min_length=1)
  sampling_params: GenerateSampling = GenerateSampling()
  cache_salt: str | None = None
  priority: int | None = None
  request_id: str | None = None


class RewardRequest(_Model):
  reward: float
