"""`Gateway`: OpenAI requests turned into engine segments and back, without HTTP.

A request is checked whole before anything is sampled (`request_checks.py`:
sampling settings, limits, lengths); each of its `n` choices is one episode
handed to the engine (`engine_port.py`): a new one, or, in a session, a copy
of the branch it continues with the new messages appended as observation
tokens (`chat_render.continuation`). When every choice's segment has ended, the
answers are read (`answers.py`), the session keeps a branch per choice, and
the caller (`app.py`) writes the response.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
import zlib

from arl_jax.gateway import answers as answers_lib
from arl_jax.gateway import (
    chat_render,
    engine_port,
    gateway_config,
    protocol,
    request_checks,
    sessions,
)
from arl_jax.gateway import tool_calls as tool_calls_lib


@dataclasses.dataclass
class Outcome:
  """What a request produced: one answer per choice, and the session it went to."""

  answers: list[answers_lib.Answer]
  prompt_ids: list[int]
  session: sessions.Session | None = None


@dataclasses.dataclass
class _Choice:
  """A choice before it is sampled: its episode and where it continues from."""

  episode: object
  start: int  # completion index where its segment begins
  prompt_text: str = ""


def _parser_name(setting: str, template) -> str:
  name = {"<|im_end|>": "chatml", "<|eot_id|>": "llama3"}.get(template.end_of_turn, "none")
  return tool_calls_lib.parser_name(setting, name)


class Gateway:
  """See the module docstring. Its coroutines run on one event loop."""

  def __init__(self, *, port: engine_port.EnginePort, tokenizer, engine_cfg, settings,
               config: gateway_config.GatewayConfig):
    """Args:
      port: the engine's port (attached to a started engine).
      tokenizer: the model's tokenizer (`envs.tokenizer.Tokenizer`).
      engine_cfg: the engine's `EngineConfig` (multi-turn, groups of one).
      settings: the engine's `SamplingSettings`.
      config: limits and sessions.
    """
    self.port, self.tokenizer, self.config = port, tokenizer, config
    self._engine_cfg, self._settings = engine_cfg, settings
    self.checks = request_checks.RequestChecks(engine_cfg=engine_cfg, settings=settings,
                                               config=config,
                                               vocab_size=tokenizer.vocab_size)
    self.renderer = (chat_render.ChatRenderer(tokenizer) if tokenizer.template.is_chat
                     else None)
    self.tool_parser = _parser_name(config.tool_parser, tokenizer.template)
    self.sessions = sessions.SessionStore(max_sessions=config.max_sessions,
                                          max_branches=config.max_branches,
                                          ttl_s=config.session_ttl_s)
    self.counters = collections.Counter()
    self._lock = threading.Lock()  # sessions' `open_groups` and `cancelled`
    specials = {tokenizer.eos_id, tokenizer.pad_id, tokenizer.end_of_turn_id,
                *([tokenizer.bos_id] if tokenizer.bos_id is not None else [])}
    self._special_texts = sorted(
        {tokenizer.detokenize([i], skip_special_tokens=False) for i in specials}
        | set(tokenizer.template.specials), key=len, reverse=True)

  @property
  def stop_token_ids(self) -> frozenset:
    """Every token a segment may end on (the sampler's stop tokens)."""
    return frozenset((self._settings.eos_id, *self._settings.stop_ids))

  @property
  def max_model_len(self) -> int:
    return self.checks.max_model_len

  # -- choices -----------------------------------------------------------------------

  def _draw_id(self, seed: int | None, index: int) -> int | None:
    """The draws' key of choice `index` of a seeded request (None: unseeded)."""
    return None if seed is None else zlib.crc32(f"{seed}/{index}".encode())

  def _new_choices(self, prompt_ids, n: int, prompt, seed) -> list[_Choice]:
    """Episodes of a new conversation. A prompt longer than the engine's
    prompt width (`sampler.prompt_len`) keeps its first `prompt_len` tokens
    as the episode's prompt and the rest as an observation (never trained
    on) in the completion budget, as a later turn's would be: so every
    prompt below `max_model_len` is served, as `/v1/models` says."""
    self.checks.prompt(prompt_ids)
    width = self._engine_cfg.prompt_len
    head, rest = list(prompt_ids[:width]), list(prompt_ids[width:])
    choices = []
    for i in range(n):
      episode = self.port.new_episode(head, prompt=prompt, draw_id=self._draw_id(seed, i))
      episode.add_observation(rest)
      choices.append(_Choice(episode, start=len(rest)))
    return choices

  def _continued_choices(self, branch: sessions.Branch, observation, n: int, prompt,
                         seed) -> list[_Choice]:
    bad = [t for t in observation if not 0 <= t < self.tokenizer.vocab_size]
    if bad:
      raise protocol.GatewayError(400, f"token ids {bad[:8]} are outside the vocabulary",
                                  param="token_ids")
    choices = []
    for i in range(n):
      episode = self.port.fork(branch.episode, prompt=prompt, draw_id=self._draw_id(seed, i))
      episode.add_observation(observation)
      choices.append(_Choice(episode, start=len(episode.completion_ids)))
    return choices

  async def _sample(self, choices: list[_Choice], max_tokens: int | None, disconnected,
                    session: sessions.Session | None = None, progress=None,
                    started=None) -> None:
    """Hands every choice to the engine and waits for all; cancels them all
    when the client leaves, the time runs out, its session is cancelled, or
    the caller is cancelled. `progress(choice_index, tokens)`: told each
    choice's tokens as sampled (on the engine thread; a stream); `started()`:
    called once every choice is in the engine (the request was accepted)."""
    limits = [self.checks.max_tokens(max_tokens, c.episode) for c in choices]  # (all checked first)
    group_ids = [c.episode.group_id for c in choices]
    if session is not None:
      with self._lock:  # (before submitting: a cancellation from now on finds them)
        self._raise_if_cancelled(session)
        session.open_groups.update(group_ids)
    futures = []
    # (Waited on beside the answers, not polled: a poll of each open request
    # every 0.1 s cost a third of the server's time per request at 128 clients.)
    left = None if disconnected is None else asyncio.ensure_future(disconnected())
    try:
      for i, (c, m) in enumerate(zip(choices, limits)):
        on_tokens = None if progress is None else (lambda tokens, i=i: progress(i, tokens))
        futures.append(asyncio.wrap_future(self.port.submit(c.episode, max_tokens=m,
                                                            on_tokens=on_tokens)))
      if started is not None:
        started()
      deadline = time.monotonic() + self.config.request_timeout_s
      waiting = set(futures)
      while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          self.counters["timed_out"] += 1
          raise protocol.GatewayError(504, "the answer took longer than "
                                      f"{self.config.request_timeout_s} s (gateway."
                                      "request_timeout_s)", kind="timeout")
        done, _ = await asyncio.wait(waiting | ({left} if left is not None else set()),
                                     timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if left is not None and left in done:
          self.counters["disconnected"] += 1
          raise engine_port.Cancelled("the client disconnected")
        waiting -= done
      for future, choice in zip(futures, choices):
        choice.episode = future.result()  # (raises Cancelled if the port cancelled it)
    finally:
      if left is not None:
        left.cancel()
      if len(futures) < len(choices) or not all(
          f.done() and not f.cancelled() and f.exception() is None for f in futures):
        for future in futures:  # (nobody reads them now)
          future.cancel()
        self.port.cancel(group_ids)  # (frees their slots at once)
      if session is not None:
        with self._lock:
          session.open_groups.difference_update(group_ids)
          self._raise_if_cancelled(session)  # (its answer is not part of the rollout)

  def _answers(self, choices: list[_Choice], req) -> list[answers_lib.Answer]:
    return [answers_lib.finish(c.episode, c.start, tokenizer=self.tokenizer, stops=req.stops(),
                               include_stop_str=req.include_stop_str_in_output,
                               skip_special_tokens=req.skip_special_tokens) for c in choices]

  def _session(self, session_id: str | None) -> sessions.Session | None:
    if not session_id:
      return None
    session = self.sessions.get(session_id)
    with self._lock:
      self._raise_if_cancelled(session)
    session.turns += 1
    return session

  @staticmethod
  def _raise_if_cancelled(session: sessions.Session) -> None:
    if session.cancelled:
      raise protocol.GatewayError(
          409, f"session {session.id!r} was cancelled: {session.cancelled}; its rollout will "
          "not be trained on, so this agent should stop", kind="cancelled",
          code="session_cancelled")

  def _served_prompt(self, stop_token_ids, session) -> engine_port.ServedPrompt:
    return engine_port.ServedPrompt(
        stop_ids=self.checks.stop_ids(stop_token_ids), session_id=session.id if session else "",
        owner_group=session.owner[0] if session is not None and session.owner else None)

  def cancel_session(self, session_id: str, why: str) -> None:
    """Stops a session: its open segments are cancelled in the engine now,
    and every later request of it gets a 409 naming `why` (a training run's
    stale rollout)."""
    session = self.sessions.get(session_id, create=False)
    if session is None:
      return
    with self._lock:
      session.cancelled = why
      open_groups, session.open_groups = set(session.open_groups), set()
    self.port.cancel(open_groups)

  # -- requests ----------------------------------------------------------------------

  async def chat(self, req: protocol.ChatCompletionRequest, *, session_id: str | None = None,
                 disconnected=None, progress=None, started=None) -> Outcome:
    """A chat completion; `disconnected`: an async () that returns when the
    client leaves; `progress`, `started`: a stream's (`_sample`)."""
    self.checks.sampling(req)
    if self.renderer is None:
      raise protocol.GatewayError(400, "this model's tokenizer has no chat template; use "
                                  "/v1/completions", param="messages")
    if len(req.messages) > self.config.max_messages:
      raise protocol.GatewayError(400, f"messages: at most {self.config.max_messages} "
                                  "(gateway.max_messages)", param="messages")
    try:
      messages = chat_render.canonical([m.model_dump(exclude_none=True) for m in req.messages])
      kwargs = chat_render.check_template_kwargs(req.chat_template_kwargs)
    except chat_render.RenderError as e:
      raise protocol.GatewayError(400, str(e), param=e.param) from e
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    session = self._session(session_id or req.user)
    prompt = self._served_prompt(req.stop_token_ids, session)
    choices = self._chat_choices(session, messages, tools, kwargs, req, prompt)
    await self._sample(choices, req.max_completion_tokens or req.max_tokens, disconnected,
                       session, progress, started)
    answers = self._answers(choices, req)
    for answer in answers:
      if tools and req.tool_choice != "none":
        answers_lib.parse_tools(answer, self.tool_parser, self.tokenizer, self._special_texts)
        self.counters["tool_calls"] += len(answer.tool_calls)
        self.counters["tool_call_parse_failures"] += answer.parse_failures
    if session is not None:
      for i, (choice, answer) in enumerate(zip(choices, answers)):
        reply = {"role": "assistant", "content": answer.content or ""}
        if answer.tool_calls:
          reply["tool_calls"] = [c.to_openai() for c in answer.tool_calls]
        self.sessions.add_branch(session, sessions.Branch(
            messages=messages + chat_render.canonical([reply]), tools=tools,
            template_kwargs=kwargs, prompt_text=choice.prompt_text, episode=choice.episode),
            latest=i == 0)
    self.counters["chat_completions"] += 1
    return Outcome(answers=answers, prompt_ids=choices[0].episode.context_ids()[
        :answers[0].context_len], session=session)

  def _chat_choices(self, session, messages, tools, kwargs, req, prompt) -> list[_Choice]:
    """New episodes, or copies of the session's branch this request continues."""
    branch = session.branch_for(messages, tools, kwargs) if session else None
    try:
      if branch is not None:
        found = self.renderer.continuation(
            prompt_text=branch.prompt_text, history=branch.messages,
            new=messages[len(branch.messages):], tools=tools, template_kwargs=kwargs,
            ended_on_stop=branch.episode.last_stopped)
        if isinstance(found, chat_render.Break):
          session.breaks += 1
          self.counters["session_breaks"] += 1
        else:
          text, prompt_text = found
          observation = self.tokenizer.encode(text, add_bos=False)
          choices = self._continued_choices(branch, observation, req.n, prompt, req.seed)
          for choice in choices:
            choice.prompt_text = prompt_text
          self.counters["session_turns_extended"] += 1
          return choices
      prompt_text = self.renderer.render(messages, tools=tools, template_kwargs=kwargs,
                                         add_generation_prompt=True)
    except chat_render.RenderError as e:
      raise protocol.GatewayError(400, str(e), param=e.param) from e
    choices = self._new_choices(self.renderer.prompt_ids(prompt_text), req.n, prompt, req.seed)
    for choice in choices:
      choice.prompt_text = prompt_text
    return choices

  async def complete(self, req: protocol.CompletionRequest, *, session_id: str | None = None,
                     disconnected=None, progress=None, started=None) -> Outcome:
    """A legacy completion of one prompt or a batch (text or token ids); the
    choices of prompt i are `i * n ... i * n + n - 1`. In a session (one
    prompt), a prompt whose ids begin with a branch's whole context
    continues its episode, as `generate`; a text prompt is encoded whole,
    so one whose encoding does not extend its branch is a counted break."""
    self.checks.sampling(req)
    prompts = req.prompts()
    if not prompts or len(prompts) * req.n > self.config.max_n:
      raise protocol.GatewayError(400, f"{len(prompts)} prompts x n={req.n}: at most "
                                  f"{self.config.max_n} completions a request (gateway.max_n)",
                                  param="prompt")
    session = self._session(session_id or req.user)
    if session is not None and len(prompts) > 1:
      raise protocol.GatewayError(400, f"a session's completion request holds one prompt, got "
                                  f"{len(prompts)}", param="prompt")
    served = self._served_prompt(req.stop_token_ids, session)
    choices, first_ids = [], None
    for p in prompts:
      branch = session.branch_for_text(p) if session and isinstance(p, str) else None
      if branch is not None:  # the branch's exact tokens, then the new text's
        ids = [*branch.episode.context_ids(),
               *self.tokenizer.encode(p[len(branch.text):], add_bos=False)]
      else:
        ids = (self.tokenizer.encode(p, add_bos=self.tokenizer.add_bos) if isinstance(p, str)
               else [int(t) for t in p])
      first_ids = ids if first_ids is None else first_ids
      if session is not None:
        choices += self._session_choices(session, ids, req.n, served, req.seed)
      else:
        choices += self._new_choices(ids, req.n, served, req.seed)
    await self._sample(choices, req.max_tokens, disconnected, session, progress, started)
    answers = self._answers(choices, req)
    prompt_text = prompts[0] if isinstance(prompts[0], str) else ""
    self._keep_token_branches(session, choices, [
        prompt_text + a.text if prompt_text else "" for a in answers])
    self.counters["completions"] += 1
    return Outcome(answers=answers, prompt_ids=first_ids, session=session)

  def _session_choices(self, session: sessions.Session, ids: list[int], n: int, prompt,
                       seed) -> list[_Choice]:
    """Token-in choices in a session: continuing the branch whose whole
    context `ids` extends, else new (a break, once the session has answers)."""
    branch = session.branch_for_ids(ids)
    if branch is not None:
      context = len(branch.episode.context_ids())
      self.counters["session_turns_extended"] += 1
      return self._continued_choices(branch, ids[context:], n, prompt, seed)
    if session.branches:
      session.breaks += 1
      self.counters["session_breaks"] += 1
    return self._new_choices(ids, n, prompt, seed)

  def _keep_token_branches(self, session: sessions.Session | None, choices,
                           texts=None) -> None:
    """A branch per choice of a completion or generate request (`texts`:
    each one's prompt and answer text, for a text prompt)."""
    if session is not None:
      for i, choice in enumerate(choices):
        self.sessions.add_branch(session, sessions.Branch(
            messages=[], tools=None, template_kwargs={}, prompt_text="", episode=choice.episode,
            text=texts[i] if texts else ""), latest=i == 0)

  async def generate(self, req: protocol.GenerateRequest, *, session_id: str | None = None,
                     disconnected=None) -> Outcome:
    """vLLM's token-in generation. In a session, ids that begin with a
    branch's whole context continue its episode (the rest is appended as
    observation tokens)."""
    self.checks.model(req.model)
    sp = req.sampling_params
    self.checks.sampling(sp.checked(req.model))
    session = self._session(session_id)
    prompt = self._served_prompt(sp.stop_token_ids, session)
    if session is not None:
      choices = self._session_choices(session, list(req.token_ids), sp.n, prompt, sp.seed)
    else:
      choices = self._new_choices(req.token_ids, sp.n, prompt, sp.seed)
    await self._sample(choices, sp.max_tokens, disconnected, session)
    answers = [answers_lib.finish(c.episode, c.start, tokenizer=self.tokenizer,
                                  stops=[sp.stop] if isinstance(sp.stop, str) else sp.stop or [],
                                  include_stop_str=sp.include_stop_str_in_output,
                                  skip_special_tokens=sp.skip_special_tokens) for c in choices]
    self._keep_token_branches(session, choices)
    self.counters["generates"] += 1
    return Outcome(answers=answers, prompt_ids=list(req.token_ids), session=session)

  def metrics(self) -> dict:
    return {**self.counters, "sessions": len(self.sessions),
            "sessions_evicted": self.sessions.evicted, "open_segments": self.port.open_segments}
