"""The OpenAI-compatible gateway: HTTP clients as a source of the sampler
engine's work, with every token exact.

It owns the engine's ports for served requests (`engine_port.py`), the chat
rendering that extends a session's exact tokens turn by turn
(`chat_render.py`), tool-call parsing (`tool_calls.py`), sessions
(`sessions.py`), the request schemas (`protocol.py`), what a request may
ask (`request_checks.py`), the request logic (`gateway.py`), and the ASGI
app and its server (`app.py`, `server.py`; FastAPI and uvicorn, the
`[serve]` extra). A run's rollouts
may come from OpenAI-client agents talking to it (`agent_config.py`, the
`agent` section; `agent_runner.py`, which calls them).

Layer 4 (beside `distributed`): it may import `core`, `envs`, `models`,
`sharding`, `metrics`, `sampler`, `orchestrator` and `learner`, never
`config` or `training`, which build it (`arl_jax/serve.py` is the command).
"""
