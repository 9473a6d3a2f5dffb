"""Properties of asynchronous control, checked on whole runs replayed with the
fake sampler and fake clock (`testing.fake_sampler`): assembly policies when
completion time grows with difficulty, exact cancellation, flow control, the
synchronous baseline and requeueing."""

import dataclasses
import itertools

import numpy as np
import pytest

from arl_jax.orchestrator import orchestrator_config
from arl_jax.testing import fake_sampler


@dataclasses.dataclass(frozen=True)
class Task:
  prompt_id: int
  difficulty: float  # in [0, 1); a group takes 0.5 + 4 * difficulty seconds


def tasks(seed=0, num_tasks=None):
  rng = np.random.default_rng(seed)
  difficulty = rng.random(num_tasks or 100_000)
  for i in itertools.count():
    yield Task(i % len(difficulty), float(difficulty[i % len(difficulty)]))


def duration(task):
  return 0.5 + 4.0 * task.difficulty


def simulate(*, assembly="fifo", k=8, max_async_level=2, groups_per_batch=8, window_groups=2,
             num_slots=None, num_steps=60, reference="dispatch", requeue_dropped=0,
             train_seconds=1.0, prompts=None, duration_fn=duration):
  cfg = fake_sampler.SimConfig(
      orchestrator=orchestrator_config.OrchestratorConfig(
          group_size=2, batch_size=2 * groups_per_batch, max_async_level=max_async_level,
          max_off_policy_steps=k, staleness_reference=reference,
          requeue_dropped=requeue_dropped, assembly=assembly,
          window_fraction=window_groups / groups_per_batch),
      num_steps=num_steps, train_seconds=train_seconds, num_slots=num_slots)
  return fake_sampler.simulate(cfg, prompts or tasks(), duration_fn)


def displacements(result):
  """For every trained group: how many groups dispatched before it were still
  waiting (in flight or in the buffer) when the policy took it."""
  out = []
  for cut in result.cuts:
    queue = list(cut.pending)
    for g in cut.batch.groups:
      out.append(queue.index(g.group_id))
      queue.remove(g.group_id)
  return np.array(out)


def easy_bias(result):
  """Mean over batches of (difficulty of the batch - difficulty of the queue it
  was chosen from): < 0 when a policy prefers tasks that finish early."""
  difficulty = lambda gid: result.prompt_of[gid].difficulty
  return float(np.mean([
      np.mean([difficulty(g.group_id) for g in c.batch.groups])
      - np.mean([difficulty(gid) for gid in c.pending]) for c in result.cuts]))


def test_assembly_policies_when_completion_time_grows_with_difficulty():
  fifo = simulate(assembly="fifo")
  window = simulate(assembly="windowed_fifo", window_groups=2)
  first = simulate(assembly="first_done")
  for result in (fifo, window, first):
    assert len(result.cuts) == 60
    assert result.orchestrator.ledger.metrics()["dropped_total"] == 0  # K=8 drops nothing here

  # fifo preserves dispatch order exactly: every batch is the head of the queue.
  trained = [g.group_id for c in fifo.cuts for g in c.batch.groups]
  assert trained == sorted(trained) and np.all(displacements(fifo) == 0)
  # windowed_fifo takes a group out of order only within the window of 2 ...
  assert displacements(window).max() == 1
  # ... while first_done reaches far past it,
  assert displacements(first).max() >= 8
  # and fills its batches with the easy tasks that finish first.
  assert easy_bias(first) < -0.05 < easy_bias(window) <= 0.0
  assert abs(easy_bias(fifo)) < 0.01


def test_first_done_with_a_tight_bound_loses_the_hard_tasks():
  result = simulate(assembly="first_done", k=2)
  ledger = result.orchestrator.ledger
  trained = [result.prompt_of[g.group_id].difficulty for c in result.cuts
             for g in c.batch.groups]
  dispatched = [result.prompt_of[d.group_id].difficulty for d in result.dispatches]
  assert np.mean(trained) < np.mean(dispatched) - 0.03
  difficulty = {d.prompt_id: result.prompt_of[d.group_id].difficulty
                for d in result.dispatches}
  rates = {pid: t.drop_rate for (_, pid), t in ledger.tasks.items()}
  hard = [r for pid, r in rates.items() if difficulty[pid] > 0.75]
  easy = [r for pid, r in rates.items() if difficulty[pid] < 0.25]
  assert np.mean(hard) > 0.3 and np.mean(easy) < 0.05, (np.mean(hard), np.mean(easy))
  table = ledger.task_table()
  assert table[0]["drop_rate"] == 1.0 and difficulty[table[0]["prompt_id"]] > 0.5


@pytest.mark.parametrize("assembly", ["fifo", "windowed_fifo", "first_done"])
@pytest.mark.parametrize(("reference", "k"),
                         [("dispatch", 1), ("dispatch", 2), ("oldest_token", 1)])
def test_cancellation_is_exact(assembly, reference, k):
  """At every publish, an in-flight group is cancelled iff it can never ship.

  Groups queue for 6 sampler slots, so many start sampling versions after
  their dispatch: the two references disagree about them. Under fifo a
  cancelled group must leave the dispatch queue, or the run stalls.
  """
  result = simulate(assembly=assembly, k=k, max_async_level=3, num_slots=6,
                    reference=reference, num_steps=40)
  disagreements = 0
  for publish in result.publishes:
    expected = []
    for group in publish.in_flight:
      first = group.first_sampled_version
      if reference == "dispatch":
        can_ship = publish.version - group.dispatch_version <= k
      else:  # every later token is at least as new as its first one
        can_ship = first is None or publish.version - first <= k
      if not can_ship:
        expected.append(group.group_id)
      late_start = first is not None and first > group.dispatch_version
      disagreements += late_start and (publish.version - group.dispatch_version > k
                                       >= publish.version - first)
    assert list(publish.cancelled) == expected, publish.version
  assert disagreements > 10  # the scenario does exercise the difference
  cancelled = {gid for p in result.publishes for gid in p.cancelled}
  assert cancelled  # and does cancel
  stale = set()
  for cut in result.cuts:
    assert not cancelled & {g.group_id for g in cut.batch.groups}
    assert cut.batch.lag_metrics()["lag_max"] <= k  # the guarantee
    stale |= {g.group_id for g in cut.batch.stale}
  assert not cancelled & stale  # a late finish of a cancelled group is not counted again
  assert len(result.cuts) == 40


@pytest.mark.parametrize("max_async_level", [0, 1, 3])
def test_flow_control_bounds_how_far_the_sampler_runs_ahead(max_async_level):
  """Never more than `max_async_level` batches ahead of the one being
  collected; with fast sampling the bound is reached; with fifo and no drops
  no group trains with lag above it."""
  result = simulate(max_async_level=max_async_level, k=8, num_steps=30,
                    duration_fn=lambda task: 0.1 + 0.2 * task.difficulty, train_seconds=1.0)
  gpb = 8
  assert result.orchestrator.ledger.metrics()["dropped_total"] == 0
  # Groups started but not trained when each group is dispatched, in batches.
  ahead = [(i + 1 - d.batches_trained * gpb) / gpb for i, d in enumerate(result.dispatches)]
  assert max(ahead) == 1 + max_async_level
  assert max(c.batch.lag_metrics()["lag_max"] for c in result.cuts) == max_async_level


def test_synchronous_mode_alternates_strictly():
  result = simulate(max_async_level=0, k=0, num_steps=12)
  kinds = [kind for _, kind, _ in result.events]
  expected = (["dispatch"] * 8 + ["train"]) * 12
  assert kinds[:len(expected)] == expected
  for cut in result.cuts:
    assert {g.dispatch_version for g in cut.batch.groups} == {cut.batch.batch_version}
    assert cut.batch.lag_metrics()["lag_max"] == 0
  assert result.orchestrator.ledger.metrics()["dropped_total"] == 0


def test_requeueing_dropped_prompts_keeps_hard_tasks_in_training():
  """Slow tasks are often dropped under a tight bound; requeued with priority
  they get more chances (a noisy duration lets some attempts finish in time)."""
  def noisy(seed):
    rng = np.random.default_rng(seed)
    return lambda task: (0.5 + 4.0 * task.difficulty) * rng.uniform(0.3, 1.0)

  outcomes = {}
  for requeue in (0, 3):
    result = simulate(assembly="first_done", k=1, num_steps=80, requeue_dropped=requeue,
                      prompts=tasks(num_tasks=200), duration_fn=noisy(1))
    outcomes[requeue] = result
    metrics = result.orchestrator.ledger.metrics()
    assert metrics["dropped_stale"] + metrics["dropped_cancelled"] > 0
  assert outcomes[0].orchestrator.dispatcher.num_requeued == 0
  with_requeue = outcomes[3]
  assert with_requeue.orchestrator.dispatcher.num_requeued > 0
  assert max(d.attempt for d in with_requeue.dispatches) == 3  # never more than asked
  hard = lambda r: [t for (_, pid), t in r.orchestrator.ledger.tasks.items()
                    if r.prompt_of[next(d.group_id for d in r.dispatches
                                        if d.prompt_id == pid)].difficulty > 0.7]
  trained_share = lambda r: np.mean([t.groups_trained > 0 for t in hard(r)])
  assert trained_share(with_requeue) > trained_share(outcomes[0]) + 0.1
