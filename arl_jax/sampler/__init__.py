"""The sampler: an engine thread (`engine`) between a JAX-free scheduler
(`scheduler`, the one writer of the slot table) and a runner that executes
its plans on the devices (`runner`), with continuous batching, paged KV,
chunked prefill, shared prompts and in-flight / pinned / drain weight
updates; synchronous generation (`generate`) for evaluation.

Layer 3: may import `core`, `sharding` and `models`; never `orchestrator` or
`learner`, its peers: it reads requests and weights through the ports in
`sources`.
"""
