"""A scripted stand-in for the sampler engine: each segment is the tokens of
the text a function of the context gives, handed back from another thread as
the real engine does; the gateway and its HTTP face run unchanged over it."""

import threading

from arl_jax.gateway import app as app_lib
from arl_jax.gateway import engine_port, gateway_config, server
from arl_jax.gateway import gateway as gateway_lib
from arl_jax.sampler import engine_config, sampling

LOGPROB = -0.25


class ScriptedEngine:
  """`script_fn(context_text) -> answer text` (None: the segment never ends
  until cancelled)."""

  def __init__(self, port, tokenizer, script_fn, max_new_tokens):
    self.port, self.tokenizer, self.script_fn = port, tokenizer, script_fn
    self.max_new_tokens = max_new_tokens
    self.cancelled: list[int] = []
    self.held: dict[int, object] = {}  # segments that never end, by group id
    self.failed = False
    self.fail_next = False

  def resume(self, episode):
    if self.fail_next:
      self.fail_next = False
      raise RuntimeError("scripted fault")
    text = self.script_fn(self.tokenizer.detokenize(episode.context_ids(),
                                                    skip_special_tokens=False))
    if text is None:
      self.held[episode.group_id] = episode
      return
    tokens = self.tokenizer.encode(text)
    left = episode.budget_left(self.max_new_tokens)
    stopped = len(tokens) <= left and tokens[-1] in self.tokenizer.stop_ids
    tokens = tokens[:left]
    episode.add_segment(tokens, [LOGPROB] * len(tokens), [0] * len(tokens), stopped=stopped)
    threading.Thread(target=self.port.segment_ended, args=(episode,)).start()

  def cancel(self, group_ids):
    self.cancelled += sorted(group_ids)
    for g in group_ids:
      self.held.pop(g, None)


def start(tokenizer, script_fn, *, prompt_len=384, max_new_tokens=256, **config):
  """`(HttpServer, Gateway, ScriptedEngine)`, serving on a free localhost port."""
  port = engine_port.EnginePort()
  engine = ScriptedEngine(port, tokenizer, script_fn, max_new_tokens)
  port.attach(engine)
  settings = sampling.SamplingSettings(
      eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
      stop_ids=tuple(i for i in tokenizer.stop_ids if i != tokenizer.eos_id))
  cfg = engine_config.EngineConfig(num_slots=8, prompt_len=prompt_len,
                                   max_new_tokens=max_new_tokens, kv_cache="dense",
                                   decode_burst=1, multi_turn=True)
  gateway = gateway_lib.Gateway(port=port, tokenizer=tokenizer, engine_cfg=cfg,
                                settings=settings,
                                config=gateway_config.GatewayConfig(port=0, **config))
  http = server.HttpServer(app_lib.make_app(gateway, engine_failed=lambda: engine.failed),
                           host="127.0.0.1", port=0)
  http.start()
  return http, gateway, engine
