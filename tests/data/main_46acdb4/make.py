"""How these workdirs were made: at commit 46acdb4 (main before issue 53 moved
the top-level modules), two tiny runs of 2 updates that checkpoint at version
2 with work still open (arith: groups sampling; tool_agent: episodes between
tool turns). Kept to show that checkpoints from before the move still resume
(`tests/training/old_checkpoint_test.py`). Run from a checkout of 46acdb4:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python make.py
"""

from arl_jax import run_lib  # (46acdb4's module paths)
from arl_jax.testing import tiny

for name in ("arith", "tool_agent"):
  config = tiny.load_config(name, "tiny")
  config.num_steps = 2
  config.eval_every = 0
  config.checkpoint.update(every_steps=2, save_final=True)
  run_lib.run(config, f"/tmp/fx/{name}", print_fn=print)
