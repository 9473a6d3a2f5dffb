"""Checks launcher jobs before they start: each job's `arl_jax.launch` config
flags, parsed as `arl_jax.launch` parses them and built by `run_spec.build`
for the devices the job will have, so a bad key or value is one line here
instead of a failed job (`launch/xm_launch.py`)."""

from __future__ import annotations


def first_problem(jobs: list[tuple[str, dict[str, str]]], num_devices: int | None,
                  device_gib: float | None) -> str | None:
  """The first job's problem, as one line naming the job, or None.

  Args:
    jobs: `(name, args)` per job, args as `arl_jax.launch` flags without `--`.
    num_devices: devices to plan meshes on (None: this process's own).
    device_gib: memory of one device, for `sampler.kv_memory_fraction`.
  """
  from absl import flags  # noqa: PLC0415 - JAX only when checking
  from ml_collections import config_flags  # noqa: PLC0415

  from arl_jax.config import cli_argument, run_spec  # noqa: PLC0415

  devices = None if num_devices is None else list(range(num_devices))
  memory = None if device_gib is None else int(device_gib * 2**30)
  for name, args in jobs:
    argv = ["arl_jax.launch"] + [f"--{k}={v}" for k, v in args.items()
                                 if k == "config" or k.startswith("config.")]
    try:
      argv = cli_argument.resolve(argv)  # (a built-in config by name, as launch takes it)
    except cli_argument.MissingConfigFile as e:
      return f"job {name!r}: {e}"
    values = flags.FlagValues()
    # (ml_collections finds the `--config.*` overrides in the argv it is given here)
    config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
    try:
      values(argv)
      run_spec.build(values.config, devices, device_memory=memory)
    except Exception as e:  # noqa: BLE001 - worded as arl_jax.launch words it, else raised
      message = cli_argument.load_error(e, argv)  # the config file's own exception
      if message is not None:
        return f"job {name!r}: {message}"
      if isinstance(e, (AttributeError, KeyError)):
        return f"job {name!r}: {run_spec.unknown_key_message(argv, e)}"
      if isinstance(e, (flags.Error, OSError, run_spec.ConfigError)):
        return f"job {name!r}: {str(e).strip().splitlines()[-1].strip()}"
      raise
  return None
