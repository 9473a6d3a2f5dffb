"""A difficulty curriculum that moves with the measured reward.

Each task has a level in `[0, top]`. The rewards of training rollouts
sampled at a task's current level fill that task's window; once it holds
`window` rewards, the level moves one up when their mean is at least
`promote_at`, one down when it is at most `demote_at`, and the window
starts again. So each decision judges rollouts sampled at the level it
moves from: rollouts of another level (in flight when the level moved, in
an asynchronous run) are not counted.

Why a band: a group-relative advantage (GRPO and its kin) is zero for a
group whose rewards are all equal, so questions the policy always solves,
or never does, teach nothing. Keeping each task's success rate between
`demote_at` and `promote_at` keeps its groups informative, and moves the
policy to harder questions as soon as it masters easier ones. The band
(0.2, 0.7) and a window of 64 rollouts are defaults, not tuned values; a
window shorter than a few groups moves on noise.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurriculumConfig:
  """Attributes:
    enabled: draw training questions at each task's moving level (else all
      at the configured options).
    start_level: every task's first level (at most its top).
    window: training rollouts scored at a level before it may move.
    promote_at: a window's mean reward at or above this moves one level up.
    demote_at: at or below this, one level down (never below 0).
  """

  enabled: bool = False
  start_level: int = 0
  window: int = 64
  promote_at: float = 0.7
  demote_at: float = 0.2

  def __post_init__(self):
    where = "env.curriculum"
    if not isinstance(self.enabled, bool):
      raise ValueError(f"{where}.enabled must be True or False, got {self.enabled!r}")
    for name in ("start_level", "window"):
      value, low = getattr(self, name), (0 if name == "start_level" else 1)
      if type(value) is not int or value < low:
        raise ValueError(f"{where}.{name} must be an int >= {low}, got {value!r}")
    for name in ("promote_at", "demote_at"):
      if not isinstance(getattr(self, name), (int, float)):
        raise ValueError(f"{where}.{name} must be a number, got {getattr(self, name)!r}")
    if not self.demote_at < self.promote_at:
      raise ValueError(f"{where}: demote_at ({self.demote_at}) must be below promote_at "
                       f"({self.promote_at})")


class Curriculum:
  """Each task's level, moved by the rewards `observe` is told (thread-safe:
  environment workers report, the dispatcher reads)."""

  def __init__(self, cfg: CurriculumConfig, tops: Mapping[str, int]):
    """`tops`: each task's highest level."""
    self.cfg, self.tops = cfg, dict(tops)
    self._levels = {task: min(cfg.start_level, top) for task, top in self.tops.items()}
    self._window: dict[str, list[float]] = {task: [] for task in self.tops}
    self._moves = {task: {"up": 0, "down": 0} for task in self.tops}
    self._lock = threading.Lock()

  def level(self, task: str) -> int:
    with self._lock:
      return self._levels[task]

  def observe(self, task: str, level: int, rewards) -> None:
    """Training rewards of rollouts `task` sampled at `level`."""
    with self._lock:
      if self._levels.get(task) != level:
        return  # (sampled before the level moved: judges another level)
      window = self._window[task]
      window.extend(float(r) for r in rewards)
      if len(window) < self.cfg.window:
        return
      mean = float(np.mean(window))
      window.clear()
      if mean >= self.cfg.promote_at and level < self.tops[task]:
        move = "up"
      elif mean <= self.cfg.demote_at and level > 0:
        move = "down"
      else:
        return
      self._levels[task] = level + (1 if move == "up" else -1)
      self._moves[task][move] += 1

  def metrics(self) -> dict:
    """Each task's level and moves so far, for the step records."""
    with self._lock:
      return {"curriculum_level": dict(sorted(self._levels.items())),
              "curriculum_moves": {t: dict(m) for t, m in sorted(self._moves.items())}}

  def state_dict(self) -> dict:
    with self._lock:
      return {"levels": dict(self._levels), "window": {t: list(w) for t, w in
                                                       self._window.items()},
              "moves": {t: dict(m) for t, m in self._moves.items()}}

  def load_state_dict(self, state: Mapping) -> None:
    """Restores a saved state; a task the state does not know keeps its start."""
    with self._lock:
      for task in self.tops:
        if task in state["levels"]:
          self._levels[task] = min(int(state["levels"][task]), self.tops[task])
          self._window[task] = [float(r) for r in state["window"].get(task, [])]
          self._moves[task] = {k: int(v) for k, v in state["moves"].get(task, {}).items()}
