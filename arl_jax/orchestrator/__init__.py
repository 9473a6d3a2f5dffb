"""The learner's side of asynchronous control: admission and dispatch
(`dispatcher`), the rollout buffer with its staleness sweep and assembly
policies (`buffer`), the staleness bound set from measured off-policyness
(`adaptive_staleness`), the drop ledger, the env runner (multi-turn turns,
timeouts, faults) and the open work a checkpoint saves.

Layer 3: may import `core` and `envs`; never `sampler` or `learner`, its
peers (the learner thread drives it; the sampler reads its requests through
`sampler.sources`).
"""
