"""What a request may ask of this server, checked before anything is sampled.

Each refusal is a `GatewayError` (an OpenAI error object) naming the field
and the setting behind it. Sampling settings: the behaviour log-prob of
every token is what the learner trains against, so a request may not change
the distribution the engine samples from: `temperature`, `top_p`, `top_k`
and `min_p` are accepted only at the engine's own values.
"""

from __future__ import annotations

import math

from arl_jax.gateway import gateway_config, protocol


class RequestChecks:
  """The engine's and the gateway's limits, as checks of requests."""

  def __init__(self, *, engine_cfg, settings, config: gateway_config.GatewayConfig,
               vocab_size: int):
    """Args:
      engine_cfg: the engine's `EngineConfig` (its prompt width and budget).
      settings: the engine's `SamplingSettings`.
      config: the gateway's limits.
      vocab_size: the tokenizer's (token ids must fall in it).
    """
    self._engine_cfg, self._settings, self._config = engine_cfg, settings, config
    self._vocab_size = vocab_size

  @property
  def max_model_len(self) -> int:
    """The longest context an episode may reach (prompt and completion
    budget; a new conversation's prompt may use both: `Gateway._new_choices`)."""
    return self._engine_cfg.prompt_len + self._engine_cfg.max_new_tokens

  def model(self, model: str) -> None:
    if model != self._config.model_name:
      raise protocol.GatewayError(404, f"the model {model!r} does not exist; this server "
                                  f"serves {self._config.model_name!r}", param="model",
                                  code="model_not_found")

  def sampling(self, req) -> None:
    """The model, the sampling settings, `n`, stops and alternatives asked."""
    self.model(req.model)
    s = self._settings
    for name, value in (("temperature", s.temperature), ("top_p", s.top_p),
                        ("top_k", s.top_k), ("min_p", s.min_p)):
      asked = getattr(req, name)
      if asked is not None and not math.isclose(asked, value, rel_tol=1e-6, abs_tol=1e-9):
        raise protocol.GatewayError(
            400, f"{name}={asked!r}: this server samples at {name}={value!r} "
            f"(sampler.{name}); a request cannot change it, since every token's behaviour "
            "log-prob is what the learner trains on", param=name)
    for name, why in req.unsupported():
      raise protocol.GatewayError(400, f"{name}: {why}", param=name)
    if req.alternatives() > s.top_logprobs:
      param = "top_logprobs" if isinstance(req, protocol.ChatCompletionRequest) else "logprobs"
      raise protocol.GatewayError(
          400, f"{param}={req.alternatives()}: this server records {s.top_logprobs} "
          "alternatives per sampled token (sampler.top_logprobs; it is set when the engine is "
          "built, since each one costs a top-k over the vocabulary every step)", param=param)
    if req.n > self._config.max_n:
      raise protocol.GatewayError(400, f"n={req.n}: at most {self._config.max_n} "
                                  "(gateway.max_n)", param="n")
    if len(req.stops()) > self._config.max_stops:
      raise protocol.GatewayError(400, f"stop: at most {self._config.max_stops} strings",
                                  param="stop")

  def stop_ids(self, stop_token_ids) -> tuple[int, ...] | None:
    """`stop_token_ids` as the engine takes them (only its own stop tokens)."""
    if stop_token_ids is None:
      return None
    allowed = {self._settings.eos_id, *self._settings.stop_ids}
    unknown = sorted(set(stop_token_ids) - allowed)
    if unknown:
      raise protocol.GatewayError(
          400, f"stop_token_ids {unknown}: this server stops on {sorted(allowed)} only (its "
          "sampler's stop tokens); use stop strings for others", param="stop_token_ids")
    return tuple(stop_token_ids)

  def max_tokens(self, asked: int | None, episode) -> int:
    """The segment's token limit: what was asked, within what the episode's
    budget leaves."""
    left = episode.budget_left(self._engine_cfg.max_new_tokens)
    cap = self._config.max_tokens
    if asked is not None and cap and asked > cap:
      raise protocol.GatewayError(400, f"max_tokens={asked}: at most {cap} "
                                  "(gateway.max_tokens)", param="max_tokens")
    context = len(episode.context_ids())
    if left < 1 or (asked is not None and asked > left):
      raise protocol.GatewayError(
          400, f"this model's maximum context length is {self.max_model_len} tokens; the "
          f"request holds {context} tokens of context and asks for "
          f"{asked if asked is not None else 'at least 1'} more (the completion budget "
          f"leaves {max(left, 0)})", param="max_tokens", code="context_length_exceeded")
    return asked if asked is not None else (min(left, cap) if cap else left)

  def prompt(self, prompt_ids) -> None:
    """A new conversation's prompt: not empty, in the vocabulary, and
    leaving room for at least one token."""
    if not prompt_ids:
      raise protocol.GatewayError(400, "the prompt is empty", param="prompt")
    if len(prompt_ids) >= self.max_model_len:
      raise protocol.GatewayError(
          400, f"this model's maximum context length is {self.max_model_len} tokens; the "
          f"prompt holds {len(prompt_ids)}, which leaves no room for a completion",
          param="messages", code="context_length_exceeded")
    bad = [t for t in prompt_ids if not 0 <= t < self._vocab_size]
    if bad:
      raise protocol.GatewayError(400, f"token ids {bad[:8]} are outside the vocabulary "
                                  f"[0, {self._vocab_size})", param="prompt")
