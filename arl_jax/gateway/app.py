"""The gateway's HTTP face: a FastAPI app over a `Gateway`.

Endpoints (each also under `/sessions/{id}`, a base URL per session):
`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`
(with vLLM's `max_model_len`), vLLM's token-in `POST /inference/v1/generate`,
`GET /health`, `GET /metrics`, and the sessions'
`GET|DELETE /v1/sessions/{id}` and `POST /v1/sessions/{id}/reward`.

Requests are hostile input: the body is read up to `max_request_bytes`
(413 beyond), parsed and validated here so that every fault (malformed
JSON, an unknown field, a wrong type, an unknown model, a prompt too long)
is an OpenAI error object with its status and the field it names; an
unexpected fault is a 500 that leaves the server and the other sessions
serving. With `api_key` set, every endpoint but `/health` wants
`Authorization: Bearer KEY`. A client that disconnects mid-generation has
its segments cancelled at once (`Gateway._sample`).

Streaming (`stream: true`) answers in server-sent events of OpenAI's chunk
shape as the tokens are sampled (`streaming.py`: never more than the final
answer holds; a chat answer parsed for tool calls arrives when its segment
ends). A request refused is an error object as without `stream`; a fault
after the stream began is an `error` event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

import fastapi
import pydantic
from fastapi import responses
from starlette import requests

from arl_jax.gateway import answers as answers_lib
from arl_jax.gateway import engine_port, protocol, streaming
from arl_jax.gateway import gateway as gateway_lib

SESSION_HEADER = "x-session-id"


def _validation_error(e: pydantic.ValidationError) -> protocol.GatewayError:
  errors = e.errors()
  first = errors[0]
  param = ".".join(str(x) for x in first["loc"])
  unknown = [".".join(str(x) for x in err["loc"]) for err in errors
             if err["type"] == "extra_forbidden"]
  if unknown:
    return protocol.GatewayError(400, f"unknown field(s): {', '.join(unknown)}",
                                 param=unknown[0])
  return protocol.GatewayError(400, f"{param}: {first['msg']}" + (
      f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""), param=param)


async def _parse(request: fastapi.Request, model, limit: int):
  body = b""
  try:
    async for chunk in request.stream():
      body += chunk
      if len(body) > limit:
        raise protocol.GatewayError(413, f"the request body exceeds {limit} bytes "
                                    "(gateway.max_request_bytes)")
  except requests.ClientDisconnect as e:  # (nobody reads the answer; no traceback in the log)
    raise protocol.GatewayError(400, "the client disconnected while sending its "
                                "request") from e
  try:
    obj = json.loads(body)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise protocol.GatewayError(400, f"the body is not valid JSON: {e}") from e
  if not isinstance(obj, dict):
    raise protocol.GatewayError(400, "the body must be a JSON object")
  try:
    return model.model_validate(obj)
  except pydantic.ValidationError as e:
    raise _validation_error(e) from e


def _usage(outcome: gateway_lib.Outcome) -> dict:
  prompt = outcome.answers[0].context_len if outcome.answers else 0
  completion = sum(len(a.token_ids) for a in outcome.answers)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


def _chat_message(answer: answers_lib.Answer) -> dict:
  message = {"role": "assistant", "content": answer.content, "refusal": None}
  if answer.tool_calls:
    message["tool_calls"] = [c.to_openai() for c in answer.tool_calls]
  return message


def _chat_json(gateway, req, outcome, rid: str, created: int) -> dict:
  choices = []
  for i, answer in enumerate(outcome.answers):
    choice = {"index": i, "message": _chat_message(answer), "finish_reason": answer.finish_reason,
              "logprobs": (answers_lib.chat_logprobs(answer, gateway.tokenizer,
                                                     req.return_tokens_as_token_ids,
                                                     req.alternatives())
                           if req.logprobs else None)}
    if req.return_token_ids:
      choice["token_ids"] = answer.token_ids
    choices.append(choice)
  out = {"id": rid, "object": "chat.completion", "created": created,
         "model": gateway.config.model_name, "choices": choices, "usage": _usage(outcome)}
  if req.return_token_ids:
    out["prompt_token_ids"] = outcome.prompt_ids
  return out


def _completion_json(gateway, req, outcome, rid: str, created: int) -> dict:
  choices = []
  for i, answer in enumerate(outcome.answers):
    choice = {"index": i, "text": answer.text, "finish_reason": answer.finish_reason,
              "logprobs": (answers_lib.completion_logprobs(answer, gateway.tokenizer,
                                                           req.return_tokens_as_token_ids,
                                                           req.alternatives())
                           if req.logprobs is not None else None)}
    if req.return_token_ids:
      choice["token_ids"] = answer.token_ids
      choice["prompt_token_ids"] = answer.context_len and outcome.prompt_ids
    choices.append(choice)
  return {"id": rid, "object": "text_completion", "created": created,
          "model": gateway.config.model_name, "choices": choices, "usage": _usage(outcome)}


def _chat_end_chunks(whole: dict, streams):
  """The end of each choice of the chat completion `whole` after what its
  stream sent: the rest of its content (with the choice's log-probs), its
  tool calls, its finish reason."""
  base = {k: whole[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
  for choice, stream in zip(whole["choices"], streams):
    i, message = choice["index"], choice["message"]
    rest = stream.rest(message["content"] or "")
    if rest or choice["logprobs"]:
      yield base | {"choices": [{"index": i, "delta": {"content": rest},
                                 "logprobs": choice["logprobs"], "finish_reason": None}]}
    if message.get("tool_calls"):
      calls = [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]
      yield base | {"choices": [{"index": i, "delta": {"tool_calls": calls}, "logprobs": None,
                                 "finish_reason": None}]}
    last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
    if "token_ids" in choice:
      last["token_ids"] = choice["token_ids"]
    yield base | {"choices": [last]}


def _completion_end_chunks(whole: dict, streams):
  base = {k: whole[k] for k in ("id", "created", "model", "object")}
  for choice, stream in zip(whole["choices"], streams):
    yield base | {"choices": [choice | {"text": stream.rest(choice["text"])}]}


async def _stream(gateway, req, call, *, chat: bool, rid: str, created: int, to_json):
  """A streamed request: `call(progress=, started=)` runs it; text deltas go
  out as sampled, then each choice's end (`to_json` of the outcome). Refused
  before sampling: raises, as without `stream`."""
  n = req.n * (1 if chat else len(req.prompts()))
  live = not (chat and req.tools and req.tool_choice != "none")
  detokenize = lambda ids: gateway.tokenizer.detokenize(  # noqa: E731
      ids, skip_special_tokens=req.skip_special_tokens)
  streams = [streaming.TextStream(detokenize, stops=req.stops(),
                                  stop_ids=gateway.stop_token_ids, live=live) for _ in range(n)]
  loop = asyncio.get_running_loop()
  queue: asyncio.Queue = asyncio.Queue()
  started = asyncio.Event()

  def progress(index, tokens):  # (the engine thread)
    loop.call_soon_threadsafe(queue.put_nowait, (index, tokens))

  task = asyncio.ensure_future(call(progress=progress, started=started.set))
  waiter = asyncio.ensure_future(started.wait())
  await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
  waiter.cancel()
  if task.done() and task.exception() is not None:
    raise task.exception()  # (refused: an error object with its status)
  kind = "chat.completion.chunk" if chat else "text_completion"
  base = {"id": rid, "object": kind, "created": created, "model": gateway.config.model_name}
  usage = bool(req.stream_options and req.stream_options.include_usage)

  def delta_chunk(index: int, text: str) -> dict:
    if chat:
      return base | {"choices": [{"index": index, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": None}]}
    return base | {"choices": [{"index": index, "text": text, "logprobs": None,
                                "finish_reason": None}]}

  async def events():
    try:
      if chat:
        for i in range(n):
          yield _event(base | {"choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
      while not task.done() or not queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done():
          getter.cancel()
          continue
        index, tokens = getter.result()
        text = streams[index].update(tokens)
        if text:
          yield _event(delta_chunk(index, text))
      try:
        whole = to_json(task.result())
      except (protocol.GatewayError, engine_port.Cancelled) as e:
        error = e if isinstance(e, protocol.GatewayError) else protocol.GatewayError(
            409, f"cancelled: {e}", kind="cancelled")
        yield _event(error.to_json())
        return
      for chunk in (_chat_end_chunks if chat else _completion_end_chunks)(whole, streams):
        yield _event(chunk)
      if usage:
        yield _event(base | {"choices": [], "usage": whole["usage"]})
      yield "data: [DONE]\n\n"
    finally:
      if not task.done():  # (the client left mid-stream: its segments are cancelled)
        task.cancel()

  return responses.StreamingResponse(events(), media_type="text/event-stream")


def _left(request: fastapi.Request):
  """An async () that returns when the client of `request` (whose body was
  read) disconnects: the server's next ASGI message for it is then
  `http.disconnect` (uvicorn answers a waiting `receive` at once)."""
  async def wait() -> None:
    while (await request.receive())["type"] != "http.disconnect":
      pass
  return wait


def _route(app: fastapi.FastAPI, path: str, handler, method: str) -> None:
  """Serves `handler(request, **path_params)` at `path` as a plain Starlette
  route: no dependency solving or response encoding by FastAPI (its dicts
  are JSON already), which cost ~0.3 ms of CPU per request, a third of the
  HTTP thread's (`benchmarks/gateway.py`, `http_thread_cpu_ms`)."""

  async def endpoint(request: fastapi.Request):
    out = await handler(request, **request.path_params)
    return out if isinstance(out, responses.Response) else responses.JSONResponse(out)

  app.add_route(path, endpoint, methods=[method])


def _event(chunk: dict) -> str:
  return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def make_app(gateway: gateway_lib.Gateway, *, engine_failed=lambda: False) -> fastapi.FastAPI:
  """The app serving `gateway`; `engine_failed`: () -> whether its engine died
  (then `/health` says so with a 503 and requests get a 503)."""
  config = gateway.config
  app = fastapi.FastAPI(title="arl_jax gateway", docs_url=None, redoc_url=None,
                        openapi_url=None)

  _add_error_handlers(app, gateway)

  def authorize(request: fastapi.Request) -> None:
    if config.api_key:
      header = request.headers.get("authorization", "")
      given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
      if not hmac.compare_digest(given.encode(), config.api_key.encode()):
        raise protocol.GatewayError(401, "a valid API key is required (Authorization: Bearer "
                                    "KEY)", kind="authentication_error",
                                    code="invalid_api_key")
    if engine_failed():
      raise protocol.GatewayError(503, "the sampler engine failed; see the server's log",
                                  kind="server_error")

  def session_of(request: fastapi.Request, path_id: str | None) -> str | None:
    return path_id or request.headers.get(SESSION_HEADER) or None

  async def chat(request: fastapi.Request, session_id: str | None = None):
    authorize(request)
    req = await _parse(request, protocol.ChatCompletionRequest, config.max_request_bytes)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def call(**stream):
      return gateway.chat(req, session_id=session_of(request, session_id),
                          disconnected=_left(request), **stream)

    if req.stream:
      return await _stream(gateway, req, call, chat=True, rid=rid, created=created,
                           to_json=lambda o: _chat_json(gateway, req, o, rid, created))
    return _chat_json(gateway, req, await call(), rid, created)

  async def completions(request: fastapi.Request, session_id: str | None = None):
    authorize(request)
    req = await _parse(request, protocol.CompletionRequest, config.max_request_bytes)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def call(**stream):
      return gateway.complete(req, session_id=session_of(request, session_id),
                              disconnected=_left(request), **stream)

    if req.stream:
      return await _stream(gateway, req, call, chat=False, rid=rid, created=created,
                           to_json=lambda o: _completion_json(gateway, req, o, rid, created))
    return _completion_json(gateway, req, await call(), rid, created)

  async def generate(request: fastapi.Request, session_id: str | None = None):
    authorize(request)
    req = await _parse(request, protocol.GenerateRequest, config.max_request_bytes)
    outcome = await gateway.generate(req, session_id=session_of(request, session_id),
                                     disconnected=_left(request))
    choices = [{"index": i, "text": a.text, "token_ids": a.token_ids,
                "finish_reason": a.finish_reason,
                "logprobs": answers_lib.chat_logprobs(a, gateway.tokenizer, as_ids=True)}
               for i, a in enumerate(outcome.answers)]
    return {"request_id": req.request_id or f"gen-{uuid.uuid4().hex}",
            "prompt_token_ids": outcome.prompt_ids, "choices": choices,
            "usage": _usage(outcome)}

  async def models(request: fastapi.Request, session_id: str | None = None):
    authorize(request)
    return {"object": "list", "data": [{
        "id": config.model_name, "object": "model", "created": 0, "owned_by": "arl_jax",
        "root": config.model_name, "max_model_len": gateway.max_model_len}]}

  for prefix in ("", "/sessions/{session_id}"):
    _route(app, prefix + "/v1/chat/completions", chat, "POST")
    _route(app, prefix + "/v1/completions", completions, "POST")
    _route(app, prefix + "/inference/v1/generate", generate, "POST")
    _route(app, prefix + "/v1/models", models, "GET")

  async def health(request: fastapi.Request):
    if engine_failed():
      return responses.JSONResponse({"status": "failed"}, status_code=503)
    return {"status": "ok"}

  async def metrics(request: fastapi.Request):
    authorize(request)
    return gateway.metrics()

  _route(app, "/health", health, "GET")
  _route(app, "/metrics", metrics, "GET")
  _add_session_routes(app, gateway, authorize)
  return app


def _add_error_handlers(app: fastapi.FastAPI, gateway: gateway_lib.Gateway) -> None:
  """Every fault as OpenAI's error object (and counted)."""

  @app.exception_handler(protocol.GatewayError)
  async def _gateway_error(request, e: protocol.GatewayError):
    gateway.counters[f"errors_{e.status}"] += 1
    return responses.JSONResponse(e.to_json(), status_code=e.status)

  @app.exception_handler(fastapi.exceptions.StarletteHTTPException)
  async def _http_error(request, e):
    return responses.JSONResponse(protocol.GatewayError(e.status_code, str(e.detail)).to_json(),
                                  status_code=e.status_code)

  @app.exception_handler(engine_port.Cancelled)
  async def _cancelled(request, e: engine_port.Cancelled):
    # (a client that left reads nothing; one whose session was cancelled reads why)
    gateway.counters["cancelled"] += 1
    return responses.JSONResponse(protocol.GatewayError(409, f"cancelled: {e}",
                                                        kind="cancelled").to_json(),
                                  status_code=409)

  @app.exception_handler(Exception)
  async def _internal_error(request, e: Exception):
    gateway.counters["errors_500"] += 1
    return responses.JSONResponse(protocol.GatewayError(
        500, f"internal error: {type(e).__name__}: {e}", kind="server_error").to_json(),
        status_code=500)


def _add_session_routes(app: fastapi.FastAPI, gateway: gateway_lib.Gateway, authorize) -> None:
  """`GET|DELETE /v1/sessions/{id}`, `POST /v1/sessions/{id}/reward`."""
  config = gateway.config

  def session_or_404(session_id: str):
    session = gateway.sessions.get(session_id, create=False)
    if session is None:
      raise protocol.GatewayError(404, f"no session {session_id!r} (never used, deleted, or "
                                  "idle longer than gateway.session_ttl_s)",
                                  param="session_id")
    return session

  async def get_session(request: fastapi.Request, session_id: str):
    authorize(request)
    return session_or_404(session_id).to_json()

  async def delete_session(request: fastapi.Request, session_id: str):
    authorize(request)
    session_or_404(session_id)
    gateway.sessions.delete(session_id)
    return {"id": session_id, "deleted": True}

  async def set_reward(request: fastapi.Request, session_id: str):
    authorize(request)
    req = await _parse(request, protocol.RewardRequest, config.max_request_bytes)
    session = session_or_404(session_id)
    session.reward = req.reward
    return {"id": session_id, "reward": session.reward}

  _route(app, "/v1/sessions/{session_id}", get_session, "GET")
  _route(app, "/v1/sessions/{session_id}", delete_session, "DELETE")
  _route(app, "/v1/sessions/{session_id}/reward", set_reward, "POST")
