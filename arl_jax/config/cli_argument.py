"""The `--config=FILE[:ARG]` argument, before and after ml_collections loads it.

ml_collections' config flag turns the two commonest typos into tracebacks: a
file that does not exist becomes a placeholder that raises a chained IOError
when the config is first read (49 lines), and an exception of the file's own
`get_config` (an unknown variant, a missing argument) is re-raised with its
traceback pasted into the message. `arl_jax.launch` and the launchers' job
check instead say each in one line that names the file:

- `resolve` runs before flags are parsed: a name that is not a file but is a
  built-in config (`--config=arith:tiny`) becomes that config's file, so the
  shipped configs work from any directory and from an installed wheel; any
  other missing file is a `MissingConfigFile` listing the built-in names.
- `load_error` reads an exception raised while parsing flags and, if it came
  from running the config file, says where (`configs/arith.py:152`) and what.

No JAX here: this runs before anything initialises a backend.
"""

from __future__ import annotations

import os
import traceback

from arl_jax.config import builtin


class MissingConfigFile(Exception):
  """`--config` names no file and no built-in config."""


def find(argv: list[str], flag: str = "config") -> tuple[int, str] | None:
  """`(index, value)` of `--flag=VALUE` (or `--flag VALUE`) in `argv`; None if absent."""
  for i, arg in enumerate(argv):
    for prefix in (f"--{flag}=", f"-{flag}="):
      if arg.startswith(prefix):
        return i, arg[len(prefix):]
    if arg in (f"--{flag}", f"-{flag}") and i + 1 < len(argv):
      return i + 1, argv[i + 1]
  return None


def resolve(argv: list[str], flag: str = "config") -> list[str]:
  """`argv` with a built-in config name in `--flag` replaced by its file.

  Raises:
    MissingConfigFile: the value names neither a file nor a built-in config.
  """
  found = find(argv, flag)
  if found is None:
    return argv  # (absl reports a missing required flag itself)
  index, value = found
  file, sep, arg = value.partition(":")
  if os.path.isfile(file):
    return argv
  names = builtin.names()
  if file in names:
    resolved = list(argv)
    new_value = builtin.path(file) + sep + arg
    resolved[index] = (new_value if resolved[index] == value
                       else resolved[index][:-len(value)] + new_value)
    return resolved
  what = "is a folder, not a config file" if os.path.isdir(file) else "no such file"
  raise MissingConfigFile(
      f"--{flag}={value}: {what}: {file} (from {os.getcwd()}); built-in configs, by name or "
      f"as configs/NAME.py in a checkout: {', '.join(names)}")


def load_error(error: BaseException, argv: list[str], flag: str = "config") -> str | None:
  """One line for an exception the config file raised while it was loaded
  (`configs/arith.py:152: ValueError: unknown variant 'foo'; ...`), or None
  when `error` did not come from running that file.

  ml_collections re-raises the file's exception as a new one whose message
  holds the old traceback, and absl wraps that again: the file's own
  exception is the innermost of the chain.
  """
  found = find(argv, flag)
  if found is None:
    return None
  file = os.path.abspath(found[1].partition(":")[0])
  chain = [error]
  while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
    if len(chain) > 20:
      break
  for exc in reversed(chain):  # the innermost first
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) == file]
    if isinstance(exc, SyntaxError) and exc.filename and os.path.abspath(exc.filename) == file:
      return f"{_shown(file)}:{exc.lineno}: SyntaxError: {exc.msg}"
    if frames:
      message = str(exc).strip().splitlines()
      return (f"{_shown(file)}:{frames[-1].lineno}: {type(exc).__name__}: "
              f"{' '.join(line.strip() for line in message)}")
  return None


def _shown(file: str) -> str:
  """`file` relative to the working directory when it is under it."""
  relative = os.path.relpath(file)
  return file if relative.startswith("..") else relative
