"""The sampler's scheduler without JAX (`arl_jax/sampler/scheduler.py`):
admission, page accounting, preemption order, chunk budgets, forks and
cancellation on hand-sized cases, and long random runs (arrivals, finishes,
cancellations, publishes, preemptions) that check its invariants after every
iteration against a model of the device (`fake_device.py`)."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import numpy as np
import pytest

from arl_jax.sampler import engine_config, plans, weight_updates
from arl_jax.sampler import scheduler as scheduler_lib
from tests.sampler.fake_device import FakeDevice


@dataclasses.dataclass(frozen=True)
class Request:
  """The fields of a `group_request.GroupRequest` the scheduler reads."""

  group_id: int
  prompt_ids: tuple[int, ...]
  group_size: int
  dispatch_time: float = 0.0
  prompt: object = None
  dispatch_version: int = 0
  max_new_tokens: int | None = None

  def budget(self, default: int) -> int:
    return default if self.max_new_tokens is None else min(self.max_new_tokens, default)


class Requests:
  """A `sources.RequestSource` over a list of requests."""

  def __init__(self, requests):
    self.pending = list(requests)
    self.noted: list[tuple[int, int]] = []  # (group, version) of `note_sampling`

  def take(self, max_groups: int, live_version: int, timeout: float) -> list:
    del live_version, timeout
    taken, self.pending = self.pending[:max_groups], self.pending[max_groups:]
    return taken

  def note_sampling(self, group_id: int, version: int) -> None:
    self.noted.append((group_id, version))


def _cfg(**options) -> engine_config.EngineConfig:
  defaults = dict(num_slots=8, group_size=4, prompt_len=8, max_new_tokens=8, kv_cache="dense",
                  decode_burst=1, precompile=False)
  return engine_config.EngineConfig(**{**defaults, **options})


def _requests(n, *, group_size=4, prompt_len=4, seed=0, budgets=None, distinct=None):
  """`n` groups; `distinct`: prompts drawn from that many (groups then share
  prompts, and their prefills: `admission.plan`)."""
  rng = np.random.default_rng(seed)
  lens = prompt_len if isinstance(prompt_len, tuple) else (prompt_len, prompt_len)
  pool = [tuple(int(t) for t in rng.integers(2, 100, rng.integers(lens[0], lens[1] + 1)))
          for _ in range(distinct or n)]
  return [Request(group_id=g, group_size=group_size,
                  prompt_ids=pool[int(rng.integers(len(pool))) if distinct else g],
                  max_new_tokens=None if budgets is None else budgets[g % len(budgets)])
          for g in range(n)]


def _scheduler(cfg, source: Requests, version=0):
  sched = scheduler_lib.Scheduler(cfg, source,
                                  weight_updates.make_policy(cfg.weight_update, cfg.kv_policy))
  sched.publish(version, f"params v{version}")
  sched.went_live(version, 0.0)
  return sched


def test_the_scheduler_imports_no_jax():
  code = ("import sys; import arl_jax.sampler.scheduler, tests.sampler.scheduler_test; "
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_inserts_one_prompt_and_forks_the_rest():
  source = Requests(_requests(3))
  sched = _scheduler(_cfg(), source)
  sched.take_requests()
  assert len(sched.waiting) == 8  # two groups: what 8 slots hold
  plan = sched.plan_prefill()
  insert, fork = plan.work
  assert isinstance(insert, plans.Insert) and isinstance(fork, plans.Fork)
  assert [slot for slot, _ in insert.items] == [0, 4] and insert.params == "params v0"
  assert [(slot, source) for slot, source, _ in fork.items] == [
      (1, 0), (2, 0), (3, 0), (5, 4), (6, 4), (7, 4)]
  assert sorted(source.noted) == [(0, 0)] * 4 + [(1, 0)] * 4  # before any token is sampled
  assert all(row.sampled == (slot in (0, 4)) for slot, row in enumerate(sched.rows))
  assert sched.stats.inserts == 8 and sched.stats.forked_rows == 6
  sched.check()


def test_without_shared_prompts_every_row_is_inserted_in_its_bucket():
  sched = _scheduler(_cfg(share_prompts=False, prompt_buckets=(4, 8)),
                     Requests(_requests(2, prompt_len=(3, 7), seed=3)))
  sched.take_requests()
  plan = sched.plan_prefill()
  assert all(isinstance(work, plans.Insert) for work in plan.work)
  for work in plan.work:
    assert all(len(row.episode.context_ids()) <= work.bucket for _, row in work.items)
  assert sum(len(work.items) for work in plan.work) == 8


def test_an_admission_beyond_max_insert_rows_goes_in_several_inserts_of_one_iteration():
  """8 rows admitted at once, 3 an insert: inserts of 3, 3 and 2 in the same
  plan (what is admitted when is the uncapped engine's)."""
  sched = _scheduler(_cfg(share_prompts=False, max_insert_rows=3),
                     Requests(_requests(2, prompt_len=4)))
  sched.take_requests()
  plan = sched.plan_prefill()
  assert [len(work.items) for work in plan.work] == [3, 3, 2]
  assert all(isinstance(work, plans.Insert) for work in plan.work)
  assert len({slot for work in plan.work for slot, _ in work.items}) == 8
  sched.check()


def test_paged_admission_takes_pages_and_waits_for_them():
  # 4-column pages; a 4-token prompt and its first sample need 2 pages, a fork 2 of its own.
  cfg = _cfg(kv_cache="paged", page_size=4, kv_pages=13, attention_block=8)
  sched = _scheduler(cfg, Requests(_requests(2)))
  sched.take_requests()
  plan = sched.plan_prefill()
  assert plan.page_table is not None
  pool = sched.pages
  assert pool.in_use == 12 and pool.free == 0  # 2 + 3 * 2 for group 0, 2 + 2 for group 1
  # The second group's prompt fits (2 pages), one fork (2 more), the rest wait.
  admitted = [slot for slot, row in enumerate(sched.rows) if row is not None]
  assert admitted == [0, 1, 2, 3, 4, 5] and len(sched.waiting) == 2
  sched.check()


def test_cancellation_frees_slots_and_pages_at_once_and_stops_them_on_the_device():
  cfg = _cfg(kv_cache="paged", page_size=4, attention_block=8)
  sched = _scheduler(cfg, Requests(_requests(3)))
  device = FakeDevice(cfg.num_slots, cfg.max_new_tokens, eos_rate=0.0)
  sched.iterate(device)
  before = sched.pages.in_use
  sched.cancel([0])
  sched.apply_cancellations()
  assert sched.pages.in_use == before - (2 + 3 * 2)
  assert sched.rows[:4] == (None,) * 4 and sched.stats.cancelled_rollouts == 4
  sched.take_requests()  # group 2 waits for the freed slots; admitted by the next plan
  prefill = sched.plan_prefill()
  assert [slot for slot, _ in prefill.work[0].items] == [0]
  device.prefill(prefill)
  decode = sched.plan_decode()
  # Slots 0-3 were taken again by group 2: nothing is left to stop.
  assert decode.stop is None
  sched.cancel([2])
  sched.apply_cancellations()
  decode = sched.plan_decode()
  assert decode.stop.tolist() == [True] * 4 + [False] * 4
  sched.check()


def test_preemption_evicts_the_youngest_and_keeps_its_open_segment():
  # 5 usable pages of 4 columns: two slots with 4-token prompts and 8 new tokens
  # (columns 0-10 written: 3 pages each at the end) cannot both finish; the younger is preempted.
  cfg = _cfg(num_slots=2, group_size=1, kv_cache="paged", page_size=4, kv_pages=6,
             attention_block=8, prompt_len=4)
  sched = _scheduler(cfg, Requests(_requests(2, group_size=1)))
  device = FakeDevice(cfg.num_slots, cfg.max_new_tokens, eos_rate=0.0)
  preempted_plan = None
  for _ in range(40):
    sched.take_requests()
    plan = sched.plan_prefill()
    if plan:
      sched.prefilled(plan, device.prefill(plan))
    decode = sched.plan_decode()
    if decode is not None:
      if decode.preempted and preempted_plan is None:
        preempted_plan = decode
        row = sched.waiting[0]
        assert row.episode.group_id == 1  # the younger row, first in line
      sched.decoded(decode, *device.decode(decode))
      if preempted_plan is decode:
        assert row.episode.open_tokens == device.drawn[(1, 0)]
        assert sched.stats.preemptions == 1
    finished = sched.finished()
    for episode in sched.harvest(finished, device.read_segments(finished)):
      assert episode.completion_ids == device.drawn[(episode.group_id, 0)]
      assert len(episode.completion_ids) == cfg.max_new_tokens
    sched.check()
    if not sched.active and not sched.waiting:
      break
  assert preempted_plan is not None and preempted_plan.preempted == (1,)
  assert sched.stats.finished_segments == 2 and sched.pages.in_use == 0


def test_a_long_prompt_is_prefilled_a_chunk_per_iteration_and_its_forks_wait():
  cfg = _cfg(prefill_chunk=4, prompt_len=16)
  sched = _scheduler(cfg, Requests(_requests(1, prompt_len=10)))
  sched.take_requests()
  plan = sched.plan_prefill()
  sched.prefilled(plan, np.zeros((cfg.num_slots,), bool))
  begin, chunk = plan.work
  assert isinstance(begin, plans.BeginChunks) and isinstance(chunk, plans.Chunk)
  assert [start for _, start, _ in begin.items] == [0]
  assert chunk.starts.tolist() == [0] and chunk.final.tolist() == [False]
  assert sched.plan_decode() is None  # every occupied slot is held
  kinds = []
  for _ in range(2):
    plan = sched.plan_prefill()
    kinds.append([type(work).__name__ for work in plan.work])
    sched.prefilled(plan, np.zeros((cfg.num_slots,), bool))
  assert kinds == [["Chunk"], ["Chunk", "Fork"]]  # starts 2, 6: the last samples, forks go
  assert sched.rows[0].sampled == 1 and not sched.prefilling
  assert sched.stats.prefill_chunks == 3 and sched.stats.forked_rows == 3


def test_the_prefill_budget_pays_for_prefills_under_way_then_admits_in_queue_order():
  """8 tokens an iteration: chunks of 4 (a 10-token prompt: 3 chunks), a
  3-token prompt inserted whole. No row jumps the queue."""
  cfg = _cfg(group_size=1, prefill_chunk=4, prompt_len=16, max_prefill_tokens=8)
  requests = [Request(group_id=g, group_size=1, prompt_ids=tuple(range(20 * g, 20 * g + n)))
              for g, n in enumerate((10, 3, 10, 3))]
  sched = _scheduler(cfg, Requests(requests))
  sched.take_requests()
  steps = []
  for _ in range(4):
    plan = sched.plan_prefill()
    steps.append([(type(work).__name__, _slots(work)) for work in plan.work])
    sched.prefilled(plan, np.zeros((cfg.num_slots,), bool))
  assert steps == [
      # group 0 begins (its first chunk: 4), group 1 inserted (3); group 2's chunk (4) waits
      [("Insert", [1]), ("BeginChunks", [0]), ("Chunk", [0])],
      # group 0's second chunk first (4), then group 2 begins (4); group 3 (3) waits behind it
      [("BeginChunks", [2]), ("Chunk", [0, 2])],
      [("Chunk", [0, 2])],  # group 0's last chunk; group 3 still waits (nothing left)
      [("Insert", [3]), ("Chunk", [2])]]  # group 2's last chunk (4), group 3 (3)
  assert sched.stats.prefill_tokens == 7 + 8 + 8 + 7
  assert [slot for slot, row in enumerate(sched.rows) if row is not None] == [0, 1, 2, 3]


def test_the_first_item_of_an_iteration_fits_any_budget():
  cfg = _cfg(max_prefill_tokens=2)  # (prompts of 4 tokens, inserted whole)
  sched = _scheduler(cfg, Requests(_requests(2)))
  sched.take_requests()
  plan = sched.plan_prefill()
  insert, fork = plan.work  # the first group's prompt (4 > 2 tokens) and its free forks
  assert [slot for slot, _ in insert.items] == [0] and len(fork.items) == 3
  assert len(sched.waiting) == 4 and sched.stats.prefill_tokens == 4


def _slots(work) -> list[int]:
  if isinstance(work, plans.Chunk):
    return sorted(set(work.rows.tolist()))
  return [item[0] for item in work.items]


def _prefill_cost(plan, cfg) -> tuple[int, int]:
  """Tokens a prefill plan computes (a whole insert its contexts', a chunk
  its columns per row, a fork none) and the items that cost them."""
  cost, items = 0, 0
  for work in plan.work:
    if isinstance(work, plans.Insert):
      cost += sum(len(row.episode.context_ids()) for _, row in work.items)
      items += len(work.items)
    elif isinstance(work, plans.Chunk):
      rows = len(set(work.rows.tolist()))
      cost, items = cost + rows * cfg.chunk_columns, items + rows
  return cost, items


def test_pinned_rows_decode_with_their_own_version():
  cfg = _cfg(weight_update="pinned")
  source = Requests(_requests(1))
  sched = _scheduler(cfg, source)
  device = FakeDevice(cfg.num_slots, cfg.max_new_tokens, eos_rate=0.0)
  sched.iterate(device)  # group 0 on v0
  assert sched.publish(1, "params v1") is weight_updates.Swap.NOW
  sched.went_live(1, 0.0)
  source.pending = _requests(2)[1:]  # a second group arrives
  sched.take_requests()
  plan = sched.plan_prefill()
  sched.prefilled(plan, device.prefill(plan))
  decode = sched.plan_decode()
  assert [(call.version, call.params, call.mask.tolist()) for call in decode.calls] == [
      (0, "params v0", [True] * 4 + [False] * 4), (1, "params v1", [False] * 4 + [True] * 4)]


# -- random runs -------------------------------------------------------------------


RANDOM_CONFIGS = {
    "dense": dict(),
    "dense_burst_pinned": dict(decode_burst=4, weight_update="pinned"),
    "drain": dict(weight_update="drain"),
    "paged_small_pool": dict(kv_cache="paged", page_size=4, kv_pages=12, attention_block=8),
    "paged_chunked": dict(kv_cache="paged", page_size=4, kv_pages=16, attention_block=8,
                          prefill_chunk=4, prompt_len=12),
    "paged_recompute_unshared": dict(kv_cache="paged", page_size=4, kv_pages=14,
                                     attention_block=8, share_prompts=False,
                                     kv_policy="recompute", decode_burst=2),
    "paged_chunked_recompute": dict(kv_cache="paged", page_size=4, kv_pages=14,
                                    attention_block=8, prefill_chunk=4, prompt_len=12,
                                    kv_policy="recompute"),
    "dense_prefill_budget": dict(max_prefill_tokens=10),
    "dense_unshared_insert_rows": dict(share_prompts=False, max_insert_rows=3),
    "paged_chunked_prefill_budget": dict(kv_cache="paged", page_size=4, kv_pages=16,
                                         attention_block=8, prefill_chunk=4, prompt_len=12,
                                         max_prefill_tokens=8),
    # Episodes handed back with an observation (`resume`), re-admitted with their context.
    "paged_multi_turn": dict(kv_cache="paged", page_size=4, kv_pages=20, attention_block=8,
                             multi_turn=True, context_bucket=4, max_new_tokens=12),
}

OBSERVATION = [7, 8]


@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_runs_keep_every_invariant(name, seed):
  cfg = _cfg(**RANDOM_CONFIGS[name])
  rng = np.random.default_rng(seed)
  # Prompts repeat across groups: a group's rows may fork another group's prefill.
  requests = _requests(40, prompt_len=(1, cfg.prompt_len), seed=seed, budgets=(8, 3, 5),
                       distinct=6)
  source = Requests([])
  sched = _scheduler(cfg, source)
  device = FakeDevice(cfg.num_slots, cfg.max_new_tokens, eos_rate=0.15, seed=seed)
  prefill, costs = device.prefill, []

  def within_budget(plan):  # (the first item of an iteration fits any budget)
    cost, items = _prefill_cost(plan, cfg)
    assert cost <= (cfg.max_prefill_tokens or cost) or items == 1, f"{cost} tokens, {items}"
    costs.append(cost)
    return prefill(plan)

  device.prefill = within_budget
  harvested, cancelled, version, pending = {}, set(), 0, None
  drawn_at_cancel = {}  # group -> tokens drawn for its rows when its cancellation applied
  resumed = {}  # (group, sample) -> the episode, last handed back
  for step in itertools.count():
    assert step < 2000, "the run did not drain"
    if rng.random() < 0.3 and requests:  # arrivals
      source.pending.append(requests.pop(0))
    if rng.random() < 0.05:  # a cancellation of a group dispatched so far
      seen = {row.group_id for row in (*sched.waiting, *filter(None, sched.rows))}
      if seen:
        gid = int(rng.choice(sorted(seen)))
        sched.cancel([gid])
        cancelled.add(gid)
    sched.apply_cancellations()
    for gid in cancelled - set(drawn_at_cancel):
      drawn_at_cancel[gid] = _drawn(device, gid)
    if rng.random() < 0.1 and pending is None:  # a publish
      pending = version + 1
    if pending is not None:
      swap = sched.publish(pending, f"params v{pending}")
      if swap is not weight_updates.Swap.DEFER:
        if swap is weight_updates.Swap.RECOMPUTE:
          device.recompute(sched.plan_recompute(f"params v{pending}"))
          for slot in np.flatnonzero(device.recomputed):  # only rows that are on the device
            assert device.slots[slot].episode is sched.rows[slot].episode, f"slot {slot}"
        sched.went_live(pending, 0.0)
        version, pending = pending, None
    for episode in sched.iterate(device):
      key = (episode.group_id, episode.sample_index)
      assert key not in harvested, f"{key} harvested twice"
      assert episode.group_id not in cancelled, f"cancelled {key} harvested"
      room = episode.budget(cfg.max_new_tokens) - episode.length
      if cfg.multi_turn and episode.turns < 3 and room > len(OBSERVATION) and rng.random() < 0.5:
        episode.add_observation(OBSERVATION)  # an environment's answer: the next turn
        sched.resume(episode)
        resumed[key] = episode
        continue
      harvested[key] = episode
    _check(sched, device, harvested)
    if not requests and not sched.active and not sched.waiting and pending is None:
      break
  for (gid, index), episode in harvested.items():
    sampled = [t for t, v in zip(episode.completion_ids, episode.versions) if v >= 0]
    assert sampled == device.drawn[(gid, index)], "tokens lost or doubled"
    assert 1 <= len(episode.completion_ids) <= episode.budget(cfg.max_new_tokens)
    versions = [v for v in episode.versions if v >= 0]
    assert versions == sorted(versions) and max(versions) <= version
    if cfg.weight_update == "pinned":
      assert len(set(episode.versions)) == 1
  for gid, drawn in drawn_at_cancel.items():
    assert _drawn(device, gid) == drawn, f"group {gid} sampled after its cancellation"
  taken = {(g, i) for g in range(40) for i in range(cfg.group_size)}
  lost = {key for key in taken if key not in harvested and key[0] not in cancelled}
  assert not lost, f"rows lost: {sorted(lost)[:5]}"
  assert sched.stats.cancelled_rollouts == len(
      {key for key in taken if key[0] in cancelled and key not in harvested})
  assert sched.pages is None or sched.pages.in_use == 0
  assert sched.stats.prefill_tokens == sum(costs)
  dropped = [e for key, e in resumed.items() if key not in harvested]  # (cancelled)
  assert all(e.group_id in cancelled for e in dropped)
  assert sched.stats.finished_segments == sum(e.turns for e in [*harvested.values(), *dropped])


def _drawn(device, gid) -> int:
  return sum(len(tokens) for (g, _), tokens in device.drawn.items() if g == gid)


def _check(sched, device, harvested) -> None:
  """The scheduler's own invariants, and each row in one place only."""
  sched.check()
  places = [(row.group_id, row.episode.sample_index) for row in sched.waiting]
  places += [(row.group_id, row.episode.sample_index) for row in sched.rows if row is not None]
  assert len(places) == len(set(places)), "a row is in two places"
  assert not set(places) & set(harvested), "a harvested row is still scheduled"
  stops = sched.pending_stops
  for slot, row in enumerate(sched.open_slots()):  # what is on the device is the row's
    assert row is None or device.slots[slot].episode is row.episode, f"slot {slot}"
    # A slot live on the device holds its row, or the next decode ends it.
    live = not device.slots[slot].done
    assert not live or row is not None or stops[slot], f"slot {slot} is live, unheld"
  if sched.pages is not None:
    for slot, row in enumerate(sched.rows):  # the device writes the pages the host holds
      if row is not None:
        np.testing.assert_array_equal(device.page_table[slot], sched.pages.table[slot])
