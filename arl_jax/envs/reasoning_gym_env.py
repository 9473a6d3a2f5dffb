"""reasoning-gym's procedural tasks as an environment (`env.name = "reasoning_gym"`).

reasoning-gym (`pip install -e ".[reasoning-gym]"`) generates ~100 tasks
(arithmetic, algebra, logic, games, ...) from a seed, each with its own
scorer and difficulty settings. Config (one entry per task under
`env.tasks`, each with a sampling `weight` and that task's own config keys,
so `--config.env.tasks.chain_sum.max_terms=4` reaches them):

  config.env = dict(name="reasoning_gym", size=20_000, heldout_size=200, seed=0,
                    tasks=dict(chain_sum=dict(weight=2.0, max_terms=4),
                               gcd=dict(weight=1.0)))

Prompts: the task's question, then (with `answer_format="tags"`) the
instruction to put the final answer between `<answer>` and `</answer>`,
rendered as a user turn of the model's chat template. Reward: the task's
own `score_answer` on the last tagged answer (or, with "raw", on the whole
completion's text; with "last_number", for tasks whose answers are numbers,
on the last number the completion writes: a small model that answers in a
sentence is scored on its arithmetic, not on a tag format it never
writes); a completion cut off by the length limit scores 0.

Splits: the training prompts come from `seed`, the held-out ones from a
different seed, and a training question whose text is also a held-out one
is dropped, so the held-out set never meets a training prompt (small
tasks repeat questions). The training set holds `size` questions split
between the tasks by weight. A prompt is an `env_api.TextPrompt` whose id
says its task, split and index (`prompt_id`), which regenerates its entry
for scoring, so checkpoints hold only the record.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import zlib
from collections.abc import Mapping, Sequence

from arl_jax.core import settings
from arl_jax.envs import curriculum as curriculum_lib
from arl_jax.envs import env_api
from arl_jax.envs import tokenizer as tokenizer_lib

ANSWER_FORMATS = ("tags", "raw", "last_number")
_INSTRUCTIONS = {"tags": "\n\nGive only your final answer between <answer> and </answer>.",
                 "raw": "", "last_number": "\n\nEnd your reply with the final answer."}
# A number as `last_number` reads it (and the survey's first-number policy).
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# A prompt id: task (24 bits of a hash of its name) | split (1 bit) | curriculum
# level + 1 (6 bits; 0: the configured options) | index (25 bits).
_SPLIT_BIT, _LEVEL_SHIFT, _LEVEL_MASK, _INDEX_MASK = 1 << 31, 25, 0x3F, (1 << 25) - 1
_HELDOUT_SEED_OFFSET = 1_000_003  # (any seed the training set does not use)


def _library():
  try:
    import reasoning_gym  # noqa: PLC0415 - the [reasoning-gym] extra
  except ImportError as e:
    raise ValueError('env.name="reasoning_gym" needs the reasoning-gym package: pip install '
                     '-e ".[reasoning-gym]"') from e
  return reasoning_gym


def task_names() -> list[str]:
  """Every task reasoning-gym registers."""
  _library()
  from reasoning_gym import factory  # noqa: PLC0415

  return sorted(factory.DATASETS)


def task_options(task: str) -> dict:
  """`task`'s own config keys and their defaults (its dataset config's
  fields, less the seed and size the environment sets)."""
  _library()
  from reasoning_gym import factory  # noqa: PLC0415

  defaults = settings.defaults(factory.DATASETS[task][1])
  return {k: v for k, v in defaults.items() if k not in ("seed", "size")}


def _task_id(task: str) -> int:
  return zlib.crc32(task.encode()) & 0xFFFFFF


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningGymConfig:
  """Attributes:
    tasks: `{task: {"weight": w, **that task's config keys}}`. A task of
      weight 0 is held out whole: evaluated, never trained on (how a run
      shows what its training did to a related task).
    size: training questions, split between the tasks by weight.
    heldout_size: held-out questions per task.
    seed: the training questions' seed (the held-out ones use another).
    answer_format: "tags" (the answer between `<answer>` tags, asked for
      in the prompt), "raw" (the whole completion is the answer) or
      "last_number" (the last number in the completion; tasks whose
      answers are numbers only).
    curriculum: the keys of `curriculum.CurriculumConfig`: with `enabled`,
      training questions follow each task's level, moved by the measured
      reward (`reasoning_gym_curriculum.py`); held-out ones stay at the
      configured options.
    weights, options, curriculum_cfg: derived, validated.
  """

  tasks: Mapping[str, Mapping]
  size: int = 20_000
  heldout_size: int = 200
  seed: int = 0
  answer_format: str = "tags"
  curriculum: Mapping = dataclasses.field(
      default_factory=lambda: settings.defaults(curriculum_lib.CurriculumConfig))
  weights: Mapping[str, float] = dataclasses.field(init=False)
  options: Mapping[str, Mapping] = dataclasses.field(init=False)
  curriculum_cfg: curriculum_lib.CurriculumConfig = dataclasses.field(init=False)

  def __post_init__(self):
    if not self.tasks:
      raise ValueError("env.tasks is empty: name at least one reasoning-gym task "
                       "(configs/reasoning_gym.py:TASK[,TASK...])")
    known = task_names()
    weights, options = {}, {}
    for task, fields in sorted(self.tasks.items()):
      where = f"env.tasks.{task}"
      if task not in known:
        close = difflib.get_close_matches(task, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"{where}: unknown reasoning-gym task {task!r}{hint} Tasks: "
                         f"{', '.join(known)}")
      fields = dict(fields or {})
      weight = fields.pop("weight", 1.0)
      if not isinstance(weight, (int, float)) or weight < 0:
        raise ValueError(f"{where}.weight must be a number >= 0 (0: evaluated only), got "
                         f"{weight!r}")
      allowed = task_options(task)
      unknown = sorted(set(fields) - set(allowed))
      if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; {task}'s keys: "
                         f"{sorted(allowed) + ['weight']}")
      weights[task], options[task] = float(weight), {**allowed, **fields}
      try:  # (the task's own checks, before anything is built)
        _dataset(task, _frozen(options[task]), self.seed, 1)
      except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from e
    if not any(weights.values()):
      raise ValueError(f"env.tasks: every task has weight 0 (evaluated only); give at least "
                       f"one a weight > 0 to train on: {sorted(weights)}")
    for name, low in (("size", 1), ("heldout_size", 1)):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
        raise ValueError(f"env.{name} must be an int >= {low}, got {getattr(self, name)!r}")
    if self.answer_format not in ANSWER_FORMATS:
      raise ValueError(f"env.answer_format must be one of {ANSWER_FORMATS}, got "
                       f"{self.answer_format!r}")
    if self.answer_format == "last_number":
      for task in sorted(options):
        entry = _dataset(task, _frozen(options[task]), self.seed, 1)[0]
        if entry["answer"] is None or not NUMBER.fullmatch(str(entry["answer"]).strip()):
          raise ValueError(f"env.answer_format='last_number': {task}'s answers are not "
                           f"numbers (its first is {entry['answer']!r}); use 'tags'")
    object.__setattr__(self, "weights", weights)
    object.__setattr__(self, "options", options)
    object.__setattr__(self, "curriculum_cfg", _curriculum_config(self.curriculum, weights))

  def sizes(self, split: str) -> dict[str, int]:
    """Questions per task in `split` (training: `size` by weight, at least 1
    for a task of weight > 0)."""
    if split == "heldout":
      return {task: self.heldout_size for task in self.weights}
    total = sum(self.weights.values())
    return {task: max(1, round(self.size * w / total)) if w else 0
            for task, w in self.weights.items()}

  @property
  def trained_tasks(self) -> list[str]:
    return sorted(t for t, w in self.weights.items() if w > 0)


def _curriculum_config(fields: Mapping, tasks) -> curriculum_lib.CurriculumConfig:
  allowed = [f.name for f in dataclasses.fields(curriculum_lib.CurriculumConfig)]
  unknown = sorted(set(fields or {}) - set(allowed))
  if unknown:
    raise ValueError(f"env.curriculum: unknown key(s) {unknown}; keys: {allowed}")
  cfg = curriculum_lib.CurriculumConfig(**dict(fields or {}))
  if cfg.enabled:
    from reasoning_gym import factory  # noqa: PLC0415

    missing = sorted(t for t, w in tasks.items() if w > 0 and not factory.has_curriculum(t))
    if missing:
      raise ValueError(f"env.curriculum.enabled: reasoning-gym has no curriculum for "
                       f"{missing}; tasks with one: {', '.join(sorted(factory.CURRICULA))}")
  return cfg


def top_level(task: str) -> int:
  """The highest curriculum level of `task` (its longest attribute's)."""
  from reasoning_gym import factory  # noqa: PLC0415

  return max(len(a.levels) for a in factory.create_curriculum(task).attributes.values()) - 1


def level_options(cfg: ReasoningGymConfig, task: str, level: int) -> dict:
  """`task`'s options at curriculum `level`: its curriculum attributes set by
  reasoning-gym's `set_global_level` (each range from level 0 up to it:
  its inclusive mode), the other keys as configured."""
  from reasoning_gym import factory  # noqa: PLC0415

  curriculum = factory.create_curriculum(task)
  curriculum.set_global_level(level)
  made = curriculum.generate_configuration(defaults=dict(cfg.options[task]))
  return {k: getattr(made, k) for k in cfg.options[task]}


def _frozen(options: Mapping) -> tuple:
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


@functools.lru_cache(maxsize=64)
def _dataset(task: str, options: tuple, seed: int, size: int):
  """The task's procedural dataset (generated lazily, entry by entry)."""
  return _library().create_dataset(task, seed=seed, size=size, **dict(options))


def split_dataset(cfg: ReasoningGymConfig, task: str, split: str, level: int | None = None):
  """The questions of `task` in `split`, at curriculum `level` (training
  only; None: at the configured options)."""
  seed = cfg.seed + (_HELDOUT_SEED_OFFSET if split == "heldout" else 0)
  if level is None:
    return _dataset(task, _frozen(cfg.options[task]), seed, cfg.sizes(split)[task])
  return _dataset(task, _frozen(level_options(cfg, task, level)), seed + 7919 * (level + 1),
                  min(cfg.sizes(split)[task], _INDEX_MASK + 1))


def prompt_id(task: str, split: str, index: int, level: int | None = None) -> int:
  if not 0 <= index <= _INDEX_MASK:
    raise ValueError(f"question index {index} is outside [0, {_INDEX_MASK}]")
  coded_level = 0 if level is None else level + 1
  return ((_task_id(task) << 32) | (_SPLIT_BIT if split == "heldout" else 0)
          | (coded_level << _LEVEL_SHIFT) | index)


def decode_prompt_id(cfg: ReasoningGymConfig, pid: int) -> tuple[str, str, int, int | None]:
  """`(task, split, index, level)` of a prompt id of `cfg`'s tasks (level
  None: the configured options)."""
  by_id = {_task_id(t): t for t in cfg.weights}
  task = by_id.get(pid >> 32)
  if task is None:
    raise ValueError(f"prompt id {pid} is of none of this run's tasks {sorted(cfg.weights)}")
  coded_level = (pid >> _LEVEL_SHIFT) & _LEVEL_MASK
  return (task, "heldout" if pid & _SPLIT_BIT else "train", pid & _INDEX_MASK,
          None if coded_level == 0 else coded_level - 1)


def question(cfg: ReasoningGymConfig, entry: dict) -> str:
  return entry["question"] + _INSTRUCTIONS[cfg.answer_format]


def reference(entry: dict) -> str:
  """A correct answer to show (the warm-up's): the entry's answer, or, for a
  task with many right answers and none given (propositional_logic), its
  metadata's example answer; "" when it has neither."""
  if entry["answer"] is not None:
    return str(entry["answer"])
  example = entry.get("metadata", {}).get("example_answer")
  return "" if example is None else str(example)


def make_prompts(cfg: ReasoningGymConfig, split: str) -> list[env_api.TextPrompt]:
  """The questions of one split, task after task (the training stream
  shuffles them); training questions that are also held-out ones are left out."""
  if split not in env_api.SPLITS:
    raise ValueError(f"split must be one of {env_api.SPLITS}, got {split!r}")
  prompts = []
  for task in sorted(cfg.weights) if split == "heldout" else cfg.trained_tasks:
    heldout = {e["question"] for e in split_dataset(cfg, task, "heldout")}
    data = split_dataset(cfg, task, split)
    for index, entry in enumerate(data):
      if split == "train" and entry["question"] in heldout:
        continue
      prompts.append(env_api.TextPrompt(prompt_id=prompt_id(task, split, index),
                                        text=question(cfg, entry), answer=reference(entry)))
  return prompts


class ReasoningGymEnv(env_api.Environment):
  """Scores a completion with its task's own `score_answer`."""

  name = "reasoning_gym"

  def __init__(self, cfg: ReasoningGymConfig, tokenizer: tokenizer_lib.Tokenizer):
    self.cfg, self.tokenizer = cfg, tokenizer

  def encode_prompt(self, prompt: env_api.TextPrompt) -> list[int]:
    return env_api.encode_user_prompt(self.tokenizer, prompt.text)

  def env_name_of(self, prompt: env_api.TextPrompt) -> str:
    """Each task's rewards and drops are reported under its own name."""
    return f"reasoning_gym/{decode_prompt_id(self.cfg, prompt.prompt_id)[0]}"

  def answer_of(self, completion_ids: Sequence[int]) -> str | None:
    """The answer a completion gives (None: none, or it was cut off)."""
    if not env_api.ended_turn(self.tokenizer, completion_ids):
      return None
    stops = set(self.tokenizer.stop_ids)
    text = self.tokenizer.decode([int(i) for i in completion_ids if int(i) not in stops])
    if self.cfg.answer_format == "raw":
      return text.strip()
    if self.cfg.answer_format == "last_number":
      numbers = NUMBER.findall(text)
      return numbers[-1] if numbers else None
    from reasoning_gym import utils  # noqa: PLC0415

    return utils.extract_answer(text)

  def demonstration(self, prompt: env_api.TextPrompt) -> env_api.Demonstration | None:
    """The reference answer in the asked-for format (a supervised warm-up's);
    None for a question that gives none."""
    if not prompt.answer:
      return None
    text = prompt.answer if self.cfg.answer_format != "tags" else (
        f"<answer>{prompt.answer}</answer>")
    target = [*self.tokenizer.encode(text), self.tokenizer.end_of_turn_id]
    return env_api.Demonstration(completion_ids=tuple(target), loss_mask=(1.0,) * len(target))

  def score(self, prompt: env_api.TextPrompt, completion_ids: Sequence[int]) -> float:
    task, split, index, level = decode_prompt_id(self.cfg, prompt.prompt_id)
    data = split_dataset(self.cfg, task, split, level)
    return float(data.score_answer(self.answer_of(completion_ids), data[index]))


def make_env(cfg: ReasoningGymConfig, tokenizer, for_eval: bool = False) -> ReasoningGymEnv:
  del for_eval
  return ReasoningGymEnv(cfg, tokenizer)
