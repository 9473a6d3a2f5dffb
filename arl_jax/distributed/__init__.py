"""Roles across processes: the learner's ZeroMQ server for sampler processes
(`fleet`) and the sampler process itself (`sampler_worker`, `learner_link`),
the wire format and its typed messages, cross-process weight pulls, and the
multi-controller lockstep of process 0's decisions.

Layer 4: may import every component below (`core`, `sharding`, `envs`,
`metrics`, `models`, `sampler`, `orchestrator`, `learner`); never `config`
(a sampler process receives the resolved settings, `core.spec_codec`).
"""
