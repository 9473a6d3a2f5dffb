"""skyrl-gym's text environments as an arl_jax multi-turn environment
(`env.name = "skyrl_gym"`).

skyrl-gym (`pip install -e ".[skyrl-gym]"`) environments are Gymnasium-style
and text in, text out: `skyrl_gym.make(env_class, env_config=..., extras=row)`
makes one per episode from a dataset row, `init(prompt_messages)` gives the
conversation the model answers, and `step(action_text)` answers each turn
with `{"observations": [messages], "reward", "done", "metadata"}`.

Here: the prompt is `init`'s conversation in the model's chat template; each
segment the policy ends on a stop token (its end of turn) is an action,
stepped with its text (stop tokens left out); the observations are appended
as the template's turns (loss mask 0) and the episode continues, until
`done`. The reward is the sum of the turn rewards; its parts are `turns`
and `last_turn_reward`, its outcome `done` (the environment ended it) or
`cut_off` (the length limit did; a cut-off last segment is not stepped).

Rows: a JSONL file (`env.path`) in SkyRL's dataset form, one object a line:
`{"prompt": [{"role": ..., "content": ...}, ...] or text, "env_class":
optional (default `env.env_class`), "reward_spec": {...}, "extra_info":
{...}}` plus an optional `id`; a `heldout_fraction` of them (by a hash of the
id) are held out. With no file, the 400 word problems shipped for
`math_answer` become gsm8k rows (`reward_spec.ground_truth` the answer, the
question asking for `#### ANSWER`). `env.env_class` is a registered id
(`gsm8k`, `gsm8k_multi_turn`, `aime`, ...) or `module.path:Class` of an
environment of one's own (registered under that name on first use).

State: arl_jax's `step` is a function of the transcript, which is what makes
a restored episode continue exactly. A skyrl-gym environment keeps state, so
the adapter keeps each live episode's environment beside the transcript it
has seen; for a transcript it holds none for (after a restart, or two
episodes with equal transcripts) it makes one and replays the transcript's
actions, checking that the observations come out as recorded. That assumes
what skyrl-gym's text environments are: deterministic in their actions (a
tool that calls a service would be called again on a replay).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
import zlib
from collections.abc import Mapping, Sequence

from arl_jax.envs import env_api, jsonl_source, sample_data
from arl_jax.envs import tokenizer as tokenizer_lib

GSM8K_INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."
_MAX_LIVE = 4096  # environments kept for live episodes (beyond: made again by replay)


def _library():
  try:
    import skyrl_gym  # noqa: PLC0415 - the [skyrl-gym] extra
  except ImportError as e:
    raise ValueError('env.name="skyrl_gym" needs the skyrl-gym package: pip install -e '
                     '".[skyrl-gym]"') from e
  return skyrl_gym


def _check_env_class(env_class: str, where: str) -> None:
  """A registered id, or `module:Class` registered under that name now."""
  skyrl_gym = _library()
  if env_class in skyrl_gym.registry:
    return
  if ":" in env_class:
    module, _, attr = env_class.partition(":")
    try:
      import importlib  # noqa: PLC0415

      getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"{where}: cannot load the environment class {env_class!r}: {e}") from e
    skyrl_gym.register(id=env_class, entry_point=env_class)
    return
  raise ValueError(f"{where}: no skyrl-gym environment {env_class!r}; registered: "
                   f"{sorted(skyrl_gym.registry)} (or give module.path:Class)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SkyRLGymConfig:
  """Attributes:
    env_class: the environment of rows that name none: a skyrl-gym id, or
      `module.path:Class`.
    path: a JSONL file of rows in SkyRL's dataset form; "" for the shipped
      word problems as gsm8k rows.
    heldout_fraction: the share of rows held out (by a hash of their id).
    env_config: what each environment is made with (`env_config`).
    max_turns: the most turns an episode may take (passed as the rows'
      `extras["max_turns"]`, which multi-turn environments read); 0 leaves
      the environment's own.
  """

  env_class: str = "gsm8k"
  path: str = ""
  heldout_fraction: float = 0.1
  env_config: Mapping = dataclasses.field(default_factory=dict)
  max_turns: int = 0

  def __post_init__(self):
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ValueError(f"env.heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
    if not isinstance(self.max_turns, int) or self.max_turns < 0:
      raise ValueError(f"env.max_turns must be an int >= 0, got {self.max_turns!r}")
    _check_env_class(self.env_class, "env.env_class")
    for row in load_rows(self.path):  # (a bad file or class is named now)
      if row.get("env_class"):
        _check_env_class(row["env_class"], f"{self.path}: row {row['id']}: env_class")


@functools.lru_cache(maxsize=8)
def load_rows(path: str) -> tuple[dict, ...]:
  """The rows of `path` (or the shipped word problems as gsm8k rows), each
  with an int `id`; ValueError naming the file and line of a bad one."""
  if not path:
    records = jsonl_source.load(os.path.join(sample_data.DATA_DIR, "math_answer.jsonl"),
                                env_name="math_answer").prompts
    return tuple({"id": p.prompt_id, "prompt": [{"role": "user",
                                                 "content": p.text + GSM8K_INSTRUCTION}],
                  "reward_spec": {"method": "rule", "ground_truth": p.answer},
                  "env_class": "", "extra_info": {}} for p in records)
  if not os.path.isfile(path):
    raise ValueError(f"env.path: no file {path!r}")
  rows = []
  for where, row in jsonl_source.json_objects(path, "a row"):
    rows.append(_checked_row(row, len(rows), where))
  if not rows:
    raise ValueError(f"env.path: {path!r} holds no rows")
  ids = [r["id"] for r in rows]
  if len(set(ids)) != len(ids):
    raise ValueError(f"env.path: {path!r}: row ids repeat")
  return tuple(rows)


def _checked_row(row: dict, index: int, where: str) -> dict:
  prompt = row.get("prompt")
  if isinstance(prompt, str):
    prompt = [{"role": "user", "content": prompt}]
  if (not isinstance(prompt, list) or not prompt
      or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                 and isinstance(m.get("content"), str) for m in prompt)):
    raise ValueError(f"{where}: prompt must be text or a list of {{role, content}} messages")
  for key in ("reward_spec", "extra_info"):
    if not isinstance(row.get(key, {}), dict):
      raise ValueError(f"{where}: {key} must be an object")
  row_id = row.get("id", index)
  if not isinstance(row_id, int) or isinstance(row_id, bool):
    raise ValueError(f"{where}: id must be an int, got {row_id!r}")
  env_class = row.get("env_class") or ""
  if not isinstance(env_class, str):
    raise ValueError(f"{where}: env_class must be text")
  return {"id": row_id, "prompt": [{"role": m["role"], "content": m["content"]} for m in prompt],
          "env_class": env_class, "reward_spec": row.get("reward_spec", {}),
          "extra_info": row.get("extra_info", {})}


def make_prompts(cfg: SkyRLGymConfig, split: str) -> list[env_api.TextPrompt]:
  """One record a row of `split`: its text the row's prompt messages as JSON,
  its answer the rest of the row as JSON (so a checkpoint holds all of it)."""
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  prompts = []
  for row in load_rows(cfg.path):
    heldout = zlib.crc32(str(row["id"]).encode()) % 10_000 < cfg.heldout_fraction * 1e4
    if heldout != (split == "heldout"):
      continue
    extras = {"env_class": row["env_class"] or cfg.env_class, "reward_spec": row["reward_spec"],
              "extra_info": row["extra_info"]}
    prompts.append(env_api.TextPrompt(prompt_id=row["id"], text=json.dumps(row["prompt"]),
                                      answer=json.dumps(extras, sort_keys=True)))
  return prompts


@dataclasses.dataclass
class _Episode:
  """One episode's skyrl-gym environment and what it has seen."""

  env: object
  transcript: tuple[int, ...] = ()  # the completion tokens its steps account for
  reward: float = 0.0
  turns: int = 0
  last_reward: float = 0.0
  done: bool = False


class SkyRLGymEnv(env_api.MultiTurnEnvironment):
  """A skyrl-gym environment per episode (see the module docstring)."""

  name = "skyrl_gym"

  def __init__(self, cfg: SkyRLGymConfig, tokenizer: tokenizer_lib.Tokenizer):
    self.cfg, self.tokenizer = cfg, tokenizer
    self._stops = set(tokenizer.stop_ids)
    self._lock = threading.Lock()
    self._live: dict[int, list[_Episode]] = {}  # by prompt id

  # -- the environment per episode ---------------------------------------------------

  def _extras(self, prompt: env_api.TextPrompt) -> dict:
    extras = json.loads(prompt.answer)
    if self.cfg.max_turns:
      extras["max_turns"] = self.cfg.max_turns
    return extras

  def _new(self, prompt: env_api.TextPrompt) -> tuple[_Episode, list[dict]]:
    from omegaconf import OmegaConf  # noqa: PLC0415 - skyrl-gym's own dependency

    extras = self._extras(prompt)
    env = _library().make(extras.pop("env_class"), env_config=OmegaConf.create(
        dict(self.cfg.env_config)), extras=extras)
    messages, _ = env.init(json.loads(prompt.text))
    return _Episode(env), list(messages)

  def env_name_of(self, prompt: env_api.TextPrompt) -> str:
    return f"skyrl_gym/{json.loads(prompt.answer)['env_class']}"

  def encode_prompt(self, prompt: env_api.TextPrompt) -> list[int]:
    episode, messages = self._new(prompt)
    episode.env.close()
    return env_api.encode_messages(self.tokenizer, messages)

  def _observation_ids(self, messages) -> list[int]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
      raise ValueError(f"the environment's observations are not chat messages: "
                       f"{messages!r:.200}")
    messages = [{"role": str(m.get("role", "user")), "content": m["content"]}
                for m in messages]
    return self.tokenizer.encode(self.tokenizer.template.observations(messages), add_bos=False)

  def _act(self, episode: _Episode, action: Sequence[int]) -> list[int] | None:
    """Steps `episode` with one action (its tokens, the stop token last):
    the observation's ids, or None when the environment is done."""
    text = self.tokenizer.decode([int(t) for t in action if int(t) not in self._stops])
    out = episode.env.step(text)
    reward = float(out["reward"])
    if not math.isfinite(reward):
      raise ValueError(f"turn {episode.turns + 1}: reward {reward} is not finite")
    episode.reward += reward
    episode.last_reward = reward
    episode.turns += 1
    episode.transcript += tuple(int(t) for t in action)
    if out["done"]:
      episode.done = True
      return None
    observation = self._observation_ids(out.get("observations") or [])
    episode.transcript += tuple(observation)
    return observation

  def _advance(self, prompt: env_api.TextPrompt, completion: tuple[int, ...],
               last_is_action: bool) -> tuple[_Episode, list[int] | None]:
    """The episode's environment after every action of `completion` (the last
    segment too when `last_is_action`), and what its last step answered."""
    episode = self._take(prompt.prompt_id, completion)
    if episode is None:
      episode, _ = self._new(prompt)
    answer = None
    cursor = len(episode.transcript)
    while cursor < len(completion) and not episode.done:
      end = next((i + 1 for i in range(cursor, len(completion)) if completion[i] in self._stops),
                 None)
      if end is None or (end == len(completion) and not last_is_action):
        break  # (a segment that did not end on a stop token: not an action)
      answer = self._act(episode, completion[cursor:end])
      cursor = end
      if answer is not None and end < len(completion):  # a replayed turn: check its answer
        recorded = completion[cursor:cursor + len(answer)]
        if tuple(answer) != recorded:
          raise ValueError(f"replaying turn {episode.turns}: the environment answered "
                           f"differently than it did in this transcript (is it deterministic?)")
        cursor += len(answer)
    return episode, answer

  def _take(self, prompt_id: int, completion: tuple[int, ...]) -> _Episode | None:
    """The live episode whose transcript is the longest prefix of `completion`."""
    with self._lock:
      candidates = [e for e in self._live.get(prompt_id, ())
                    if completion[:len(e.transcript)] == e.transcript]
      if not candidates:
        return None
      best = max(candidates, key=lambda e: len(e.transcript))
      self._live[prompt_id].remove(best)
      return best

  def _keep(self, prompt_id: int, episode: _Episode) -> None:
    with self._lock:
      self._live.setdefault(prompt_id, []).append(episode)
      if sum(len(v) for v in self._live.values()) > _MAX_LIVE:  # the oldest prompt's go
        oldest = next(iter(self._live))
        for old in self._live.pop(oldest):
          old.env.close()

  # -- the Environment hooks -----------------------------------------------------------

  def step(self, prompt: env_api.TextPrompt, completion_ids: Sequence[int]) -> list[int] | None:
    completion = tuple(int(t) for t in completion_ids)
    episode, answer = self._advance(prompt, completion, last_is_action=True)
    self._keep(prompt.prompt_id, episode)  # (score reads it when the episode ends)
    return answer

  def score(self, prompt: env_api.TextPrompt, completion_ids: Sequence[int]) -> env_api.Score:
    completion = tuple(int(t) for t in completion_ids)
    ended = bool(completion) and completion[-1] in self._stops
    episode, _ = self._advance(prompt, completion, last_is_action=ended)
    episode.env.close()
    return env_api.Score(episode.reward, {"turns": float(episode.turns),
                                          "last_turn_reward": episode.last_reward},
                         outcome="done" if episode.done else "cut_off")


def make_env(cfg: SkyRLGymConfig, tokenizer, for_eval: bool = False) -> SkyRLGymEnv:
  del for_eval
  return SkyRLGymEnv(cfg, tokenizer)
