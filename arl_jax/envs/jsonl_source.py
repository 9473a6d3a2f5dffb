"""Prompt records from JSONL (or ArrayRecord) files, validated record by record
before a run starts.

Schema (one JSON object per line, or per record of an `.array_record` file
whose records are UTF-8 JSON; README "Prompt data"):

  {"prompt": "12+7=", "answer": "19", "env": "arith", "id": 1207}

- `prompt` (string, required, non-empty): the text the environment encodes;
- `answer` (string or number, required): what the environment checks;
- `env` (string, optional): the environment the record is for; a record for
  another environment than the run's is malformed;
- `id` (int or string, optional): a stable prompt id (drop accounting and
  requeueing name tasks by it); a string is hashed (63-bit blake2b); without
  one the id is the record's position in the files (stable while the files
  are). An id used twice is malformed (the message names both lines).

A malformed line (not JSON, not an object, a missing or empty field, a wrong
type, another environment, or a record its environment cannot use: `check_fn`)
raises `MalformedRecord` naming `file:line` (for ArrayRecord, `file:record N`,
1-based) and the problem, or with `on_malformed="skip"` is skipped and listed
in `JsonlPrompts.skipped` (each entry `file:line: problem`), so the run can
report how many it lost.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
from collections.abc import Callable, Sequence

import grain

from arl_jax.envs import env_api

ON_MALFORMED = ("error", "skip")
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")


class MalformedRecord(ValueError):
  """A JSONL line that is not a valid prompt record (the message names file:line)."""


@dataclasses.dataclass(frozen=True)
class JsonlPrompts:
  """Attributes:
    prompts: the valid records, in file order.
    skipped: `file:line: problem` for every skipped line.
    envs: each valid record's `env` (None where it has none).
    wheres: each valid record's `file:line` (`file:record N` for ArrayRecord).
  """

  prompts: list[env_api.TextPrompt]
  skipped: list[str]
  envs: list[str | None] = dataclasses.field(default_factory=list)
  wheres: list[str] = dataclasses.field(default_factory=list)


def _string_id(text: str) -> int:
  """A stable 63-bit id for a string id (collisions are negligible)."""
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def _record(obj, env_name: str | None, mixture_envs, position: int):
  if not isinstance(obj, dict):
    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
  unknown = sorted(set(obj) - {"prompt", "answer", "env", "id"})
  if unknown:
    raise ValueError(f"unknown field(s) {unknown}; known: answer, env, id, prompt")
  prompt = obj.get("prompt")
  if not isinstance(prompt, str) or not prompt:
    raise ValueError(f"field 'prompt' must be a non-empty string, got {prompt!r}")
  answer = obj.get("answer")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or answer == "":
    raise ValueError(f"field 'answer' must be a non-empty string or a number, got {answer!r}")
  env = obj.get("env")
  if mixture_envs is not None and env not in mixture_envs:
    raise ValueError(f"field 'env' must name one of the mixture's environments "
                     f"{sorted(mixture_envs)}, got {env!r}")
  if mixture_envs is None and env is not None and env_name is not None and env != env_name:
    raise ValueError(f"record is for env {env!r}, this run's env is {env_name!r}")
  raw_id = obj.get("id", position)
  if isinstance(raw_id, bool) or not isinstance(raw_id, (int, str)):
    raise ValueError(f"field 'id' must be an int or a string, got {raw_id!r}")
  prompt_id = raw_id if isinstance(raw_id, int) else _string_id(raw_id)
  return env_api.TextPrompt(prompt_id=prompt_id, text=prompt, answer=str(answer)), env


def _raw_records(path: str):
  """`(where, text)` of every non-blank JSONL line, or of every ArrayRecord record."""
  if path.endswith(ARRAY_RECORD_SUFFIXES):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"No such file: {path!r}")
    source = grain.sources.ArrayRecordDataSource([path])
    for i in range(len(source)):
      yield f"{path}:record {i + 1}", bytes(source[i])  # json.loads decodes UTF-8
    return
  with open(path, "rb") as f:  # bytes: a bad UTF-8 line is reported with its number
    for line_number, line in enumerate(f, start=1):
      if line.strip():
        yield f"{path}:{line_number}", line


def json_objects(path: str, what: str = "a record"):
  """`(where, object)` of each non-blank line of a JSONL file of an
  environment's own schema (`.gz`: read compressed), `where` its file and
  line; ValueError naming them for a line that is not a JSON object."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON: {e}") from e
      if not isinstance(record, dict):
        raise ValueError(f"{where}: {what} must be a JSON object")
      yield where, record


def load(paths: str | Sequence[str], *, env_name: str | None = None,
         on_malformed: str = "error", mixture_envs=None,
         check_fn: Callable[[env_api.TextPrompt, str | None], None] | None = None
         ) -> JsonlPrompts:
  """Reads and validates every line of `paths` (blank lines are ignored).

  `mixture_envs` (for a mixture of environments): every record must name one
  of them in `env`. `check_fn(prompt, env)`: the environment's own checks of
  a record that passed the schema (`env`: the record's environment, else
  `env_name`); a ValueError it raises makes the line malformed.

  Raises:
    MalformedRecord: on the first bad line when `on_malformed == "error"`.
    FileNotFoundError: for a missing file.
  """
  if on_malformed not in ON_MALFORMED:
    raise ValueError(f"on_malformed must be one of {ON_MALFORMED}, got {on_malformed!r}")
  paths = [paths] if isinstance(paths, str) else list(paths)
  prompts, skipped, envs, wheres, seen = [], [], [], [], {}
  for path in paths:
    for where, raw in _raw_records(path):
      try:
        prompt, env = _record(json.loads(raw), env_name, mixture_envs,
                              len(prompts) + len(skipped))
        if check_fn is not None:
          check_fn(prompt, env if env is not None else env_name)
        if (env, prompt.prompt_id) in seen:
          raise ValueError(f"prompt id {prompt.prompt_id} was already used at "
                           f"{seen[(env, prompt.prompt_id)]} (without an `id`, a record's id "
                           "is its position)")
        seen[(env, prompt.prompt_id)] = where
        prompts.append(prompt)
        envs.append(env)
        wheres.append(where)
      except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        if on_malformed == "error":
          raise MalformedRecord(f"{where}: {e}") from None
        skipped.append(f"{where}: {e}")
  return JsonlPrompts(prompts=prompts, skipped=skipped, envs=envs, wheres=wheres)
