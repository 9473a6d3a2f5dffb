"""reasoning-gym's difficulty levels as a curriculum that moves with the
measured reward (`env.curriculum.enabled`; the rule: `curriculum.py`).

A task's level sets its curriculum attributes (reasoning-gym's own
`create_curriculum(task)`: chain_sum's terms and digits, gcd's numbers and
values, ...) through `reasoning_gym_env.level_options`; its other keys stay
as configured. Training questions are drawn one at a time, so each draw
sees the levels as they are now: a task by its weight (a counter-keyed
draw from the run's seed), then the next question of that task at its
current level, skipping any equal to a held-out one. Held-out questions
stay at the configured options: the fixed target evaluation measures.

The stream is checkpointed with the run's open work (`get_state`,
`set_state`: draws so far, each level's next question, the curriculum's
levels and windows), so a resumed run draws what the uninterrupted one
would have, given the same rewards. The orchestrator reports each finished
group's rewards (`observe`): the task's own score (a judged run's `rule`
part), never evaluation's.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from arl_jax.envs import curriculum as curriculum_lib
from arl_jax.envs import env_api
from arl_jax.envs import reasoning_gym_env as rg


class CurriculumPrompts:
  """An endless stream of training prompts at each task's current level."""

  def __init__(self, cfg: rg.ReasoningGymConfig, seed: int):
    self.cfg, self._seed = cfg, seed
    self._tasks = cfg.trained_tasks
    weights = np.array([cfg.weights[t] for t in self._tasks], np.float64)
    self._p = weights / weights.sum()
    self.curriculum = curriculum_lib.Curriculum(
        cfg.curriculum_cfg, {t: rg.top_level(t) for t in self._tasks})
    self._heldout = {t: {e["question"] for e in rg.split_dataset(cfg, t, "heldout")}
                     for t in self._tasks}
    self._draws = 0
    self._next = collections.Counter()  # "task/level" -> the next question's index
    self._lock = threading.Lock()

  def __iter__(self):
    return self

  def __next__(self) -> env_api.TextPrompt:
    with self._lock:
      rng = np.random.default_rng((self._seed, self._draws))
      self._draws += 1
      task = self._tasks[int(rng.choice(len(self._tasks), p=self._p))]
      level = self.curriculum.level(task)
      data = rg.split_dataset(self.cfg, task, "train", level)
      key = f"{task}/{level}"
      for _ in range(len(data)):
        index = self._next[key] % len(data)
        self._next[key] += 1
        entry = data[index]
        if entry["question"] not in self._heldout[task]:
          return env_api.TextPrompt(prompt_id=rg.prompt_id(task, "train", index, level),
                                    text=rg.question(self.cfg, entry),
                                    answer=rg.reference(entry))
    raise ValueError(f"every training question of {task} at curriculum level {level} is also "
                     "a held-out one: raise env.size or lower env.heldout_size")

  def observe(self, prompt_id: int, rewards) -> None:
    """The training rewards of one finished group of prompt `prompt_id`."""
    task, split, _, level = rg.decode_prompt_id(self.cfg, prompt_id)
    if split == "train" and level is not None:
      self.curriculum.observe(task, level, rewards)

  def metrics(self) -> dict:
    return self.curriculum.metrics()

  def get_state(self) -> dict:
    with self._lock:
      return {"draws": self._draws, "next": dict(self._next),
              "curriculum": self.curriculum.state_dict()}

  def set_state(self, state: dict) -> None:
    with self._lock:
      self._draws = int(state["draws"])
      self._next = collections.Counter({k: int(v) for k, v in state["next"].items()})
      self.curriculum.load_state_dict(state["curriculum"])


def make_stream(cfg: rg.ReasoningGymConfig, seed: int) -> CurriculumPrompts | None:
  """The training stream of a curriculum run (None: the run's shuffled list)."""
  return CurriculumPrompts(cfg, seed) if cfg.curriculum_cfg.enabled else None
