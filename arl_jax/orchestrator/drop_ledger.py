"""Drop accounting: what did not train, why, for which environment, completion
length and task (docs/design.md section 4).

Reasons:
- `stale`: a finished group swept from the buffer right before a cut (lag > K);
- `cancelled`: a group cancelled in flight because it could never ship;
- `env_error`: a rollout its environment failed on (exception, timeout,
  malformed answer); it is masked out of the loss and of its group's baseline;
- `truncated`: a rollout that hit `max_new_tokens`, masked the same way when
  `mask_truncated_completions` is on (DAPO's overlong filtering);
- `zero_variance`: a finished group whose rewards do not differ, dropped by
  dynamic sampling (`orchestrator.filter_zero_variance`, `zero_variance.py`).

Everything is counted in rollouts (a dropped group counts G), so drop rates of
all reasons share one denominator: every rollout retired so far (trained rows
plus dropped groups), masked rows of trained groups included. Lengths are
bucketed into quarters of `max_new_tokens`; a group cancelled in flight has no
final length and is counted as `unfinished` (its drop rate is 1 by
construction; compare the other buckets with each other).

Tasks are counted in groups: a task is an (environment, prompt id) pair, its
drop rate is dropped groups / retired groups, and it is lost (so far) when
every group of it retired until now was dropped, including a task whose
requeued group is still in flight. Preventing lost tasks is what requeueing
(`orchestrator.requeue_dropped`) is for.
"""

from __future__ import annotations

import collections
import dataclasses

from arl_jax.core import rollout as rollout_lib

REASONS = ("stale", "cancelled", "env_error", "truncated", "zero_variance")
UNFINISHED = "unfinished"
NUM_LENGTH_BUCKETS = 4


@dataclasses.dataclass
class TaskRecord:
  """Groups of one task (prompt) by outcome, and its dropped rollouts by reason."""

  groups_trained: int = 0
  groups_dropped: int = 0
  rollouts_dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  @property
  def drop_rate(self) -> float:
    return self.groups_dropped / max(self.groups_trained + self.groups_dropped, 1)


def _nested(counters: dict[str, collections.Counter]) -> dict[str, dict[str, int]]:
  return {k: dict(sorted(c.items())) for k, c in sorted(counters.items())}


class DropLedger:
  """Cumulative drop counts; not thread-safe (the learner thread owns it)."""

  def __init__(self, max_new_tokens: int, mask_truncated_completions: bool = False):
    self._max_new_tokens = max_new_tokens
    self._mask_truncated = mask_truncated_completions
    edges = sorted({max(1, round(max_new_tokens * (i + 1) / NUM_LENGTH_BUCKETS))
                    for i in range(NUM_LENGTH_BUCKETS)})
    self._buckets = [(lo + 1, hi) for lo, hi in zip([0, *edges[:-1]], edges)]
    self.dropped: collections.Counter[str] = collections.Counter()
    self.retired_rollouts = 0
    self._by_env: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    self._by_length: dict[str, collections.Counter] = collections.defaultdict(
        collections.Counter)
    self._retired_by_length: collections.Counter[str] = collections.Counter()
    self.tasks: dict[tuple[str, int], TaskRecord] = {}

  def to_json(self) -> dict:
    """The cumulative counts, for a checkpoint (a resumed run keeps counting)."""
    return {
        "dropped": dict(self.dropped), "retired_rollouts": self.retired_rollouts,
        "by_env": _nested(self._by_env), "by_length": _nested(self._by_length),
        "retired_by_length": dict(self._retired_by_length),
        "tasks": [[env, pid, t.groups_trained, t.groups_dropped, dict(t.rollouts_dropped)]
                  for (env, pid), t in self.tasks.items()],
    }

  def restore(self, record: dict) -> None:
    """Continues from a `to_json` record (before anything is counted)."""
    self.dropped = collections.Counter(record["dropped"])
    self.retired_rollouts = record["retired_rollouts"]
    for mine, saved in ((self._by_env, record["by_env"]), (self._by_length, record["by_length"])):
      mine.clear()
      mine.update({k: collections.Counter(v) for k, v in saved.items()})
    self._retired_by_length = collections.Counter(record["retired_by_length"])
    self.tasks = {(env, pid): TaskRecord(trained, dropped, collections.Counter(rollouts))
                  for env, pid, trained, dropped, rollouts in record["tasks"]}

  def length_bucket(self, completion_len: int) -> str:
    for lo, hi in self._buckets:
      if completion_len <= hi:
        return f"{lo}-{hi}"
    return f">{self._max_new_tokens}"

  def record_trained(self, groups: list[rollout_lib.Group]) -> collections.Counter[str]:
    """Counts a cut batch; returns this batch's masked rollouts by reason."""
    masked = collections.Counter()
    for g in groups:
      masked += self._retire(g, trained=True)
    return masked

  def record_stale(self, groups: list[rollout_lib.Group]) -> None:
    for g in groups:
      self._retire(g, trained=False)

  def record_zero_variance(self, group: rollout_lib.Group) -> None:
    self._retire(group, trained=False, reason="zero_variance")

  def _retire(self, group: rollout_lib.Group, trained: bool,
              reason: str = "stale") -> collections.Counter[str]:
    """Counts a finished group's rollouts: dropped (as stale, or `reason`), or
    trained with masked rollouts (env errors, truncated when masked) counted
    as drops."""
    task = self._task(group.prompt_id, group.rollouts[0].env_name)
    if trained:
      task.groups_trained += 1
    else:
      task.groups_dropped += 1
    dropped = collections.Counter()
    group_reason = reason
    for r in group.rollouts:
      bucket = self.length_bucket(r.completion_length)
      self._retired_by_length[bucket] += 1
      if not trained:
        reason = group_reason
      elif r.finish_reason == "error":
        reason = "env_error"
      elif r.is_masked(self._mask_truncated):
        reason = "truncated"
      else:
        continue
      dropped[reason] += 1
      self._count(reason, r.env_name, bucket, task)
    self.retired_rollouts += len(group.rollouts)
    return dropped

  def record_cancelled(self, prompt_id: int, env_name: str, group_size: int) -> None:
    task = self._task(prompt_id, env_name)
    task.groups_dropped += 1
    self._retired_by_length[UNFINISHED] += group_size
    self._count("cancelled", env_name, UNFINISHED, task, group_size)
    self.retired_rollouts += group_size

  def _task(self, prompt_id: int, env_name: str) -> TaskRecord:
    return self.tasks.setdefault((env_name, prompt_id), TaskRecord())

  def _count(self, reason, env_name, bucket, task, n=1) -> None:
    self.dropped[reason] += n
    self._by_env[env_name][reason] += n
    self._by_length[bucket][reason] += n
    task.rollouts_dropped[reason] += n

  def metrics(self) -> dict:
    """Cumulative counts and rates for the run's JSON lines."""
    total = sum(self.dropped.values())
    lost = sum(t.groups_trained == 0 for t in self.tasks.values())
    return {
        **{f"dropped_{reason}": int(self.dropped[reason]) for reason in REASONS},
        "dropped_total": int(total),
        "drop_rate": total / max(self.retired_rollouts, 1),
        "drops_by_env": _nested(self._by_env),
        "drops_by_length": _nested(self._by_length),
        "drop_rate_by_length": {
            b: sum(self._by_length.get(b, {}).values()) / n
            for b, n in sorted(self._retired_by_length.items())},
        "tasks_seen": len(self.tasks),
        "tasks_lost": int(lost),
        "task_drop_rate_mean": (sum(t.drop_rate for t in self.tasks.values())
                                / max(len(self.tasks), 1)),
    }

  def task_table(self) -> list[dict]:
    """Per-task outcomes of every task that lost at least one group, worst first."""
    rows = [{"env": env, "prompt_id": pid, "groups_trained": t.groups_trained,
             "groups_dropped": t.groups_dropped, "drop_rate": t.drop_rate,
             "rollouts_dropped": dict(t.rollouts_dropped)}
            for (env, pid), t in self.tasks.items() if t.groups_dropped]
    return sorted(rows, key=lambda row: (-row["drop_rate"], -row["groups_dropped"],
                                         row["env"], row["prompt_id"]))
