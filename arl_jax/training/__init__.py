"""How a run is wired: where it starts, its rollout side, the learner loop and
the stop sequence (`run_lib.run` reads these as a page).

Modules are imported by name (`from arl_jax.training import learner_loop`);
nothing is imported here, so that `stop` stays importable before JAX.
"""
