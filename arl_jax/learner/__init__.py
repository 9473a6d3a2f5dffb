"""The learner: log-probs, losses and their corrections, V-trace, the jitted
update step, the optimizer and its schedules, the supervised warm-up,
weight publishing to the sampler mesh, and checkpoints of its state.

Layer 3: may import `core`, `sharding` and `models`; never `sampler` or
`orchestrator`, its peers.
"""
