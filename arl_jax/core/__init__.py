"""The data contracts every role shares, and the few pieces of plumbing all of
them use: a rollout and its group (`rollout`), an episode being produced
(`episode`), what the orchestrator asks the sampler for (`group_request`),
rows of left/right-padded tokens (`rows`), the learner's batch and its
assembly (`train_batch`, `packing`, `advantages`), how a setting is declared
and checked (`settings`) and how settings travel to another process
(`spec_codec`), the process's compilation cache (`compile_cache`), and a
run's schedule for replay (`schedule`).

Layer 0: imports nothing of arl_jax's outside `core`. Modules are imported by
name (`from arl_jax.core import rollout as rollout_lib`); nothing is imported
here, so that `settings` stays importable before JAX.
"""
