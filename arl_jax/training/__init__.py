"""The composition root: `run(config, workdir)` as a page (`run_lib`), the
phases it reads (where a run starts, its rollout side, the learner loop, the
stop sequence, a follower process's loop), held-out evaluation
(`evaluation`, `sampled_eval`), and the `--dry_run` plan (`dry_run`).

Layer 6: may import every package below it, `config` included; only the
commands (`arl_jax.launch`, `arl_jax.plot`, `arl_jax.export_hf`) and the API
in `arl_jax/__init__.py` stand above it. Modules are imported by name (`from
arl_jax.training import learner_loop`); nothing is imported here, so that
`stop` stays importable before JAX.
"""
