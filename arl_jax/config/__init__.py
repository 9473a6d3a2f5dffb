"""The configuration: the schema whose dataclasses declare every key
(`schema`), the base every config derives from (`base_config`), the one
module that reads a ConfigDict and builds the frozen `RunSpec` (`run_spec`),
the run's inputs it loads once (`inputs`), the configs that ship as package
data (`builtin`), `--config=path:arg` (`cli_argument`) and sweeps (`sweep`).

Layer 5: may import the components it configures (`core`, `sharding`,
`envs`, `metrics`, `models`, `sampler`, `orchestrator`, `learner`,
`distributed`); never `training` or the commands. Modules are imported by
name; nothing is imported here, so that `cli_argument` and `sweep` stay
importable before JAX (a launcher sets XLA flags after reading the config).
"""
