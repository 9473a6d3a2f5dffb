"""The memory ledger charges each live buffer once, to the first owner that
declared it, and the memory log notes each phase's peak and account."""

import gc

import jax.numpy as jnp

from arl_jax.metrics import host_memory, memory_ledger, memory_log


class _Holder:
  def __init__(self, **trees):
    self.__dict__.update(trees)


def test_each_buffer_counts_once_for_the_first_owner_and_the_rest_is_unclaimed():
  ledger = memory_ledger.Ledger()
  params = {"w": jnp.ones((256, 256), jnp.float32), "b": jnp.ones((256,), jnp.float32)}
  cache = jnp.zeros((64, 1024), jnp.float32)
  learner, sampler = _Holder(params=params), _Holder(params=params, cache=cache)
  ledger.hold("learner params", learner, lambda h: h.params)
  ledger.hold("sampler params", sampler, lambda h: h.params)  # (the same buffers: colocated)
  ledger.hold("sampler kv cache", sampler, lambda h: h.cache)
  stray = jnp.full((128, 128), 2.0)  # nobody declared it
  account = ledger.account()
  assert account.by_owner["learner params"] == 257 * 256 * 4
  assert account.by_owner["sampler params"] == 0
  assert account.by_owner["sampler kv cache"] == 64 * 1024 * 4
  assert account.by_owner[memory_ledger.UNCLAIMED] >= stray.nbytes
  ours = 257 * 256 * 4 + 64 * 1024 * 4 + stray.nbytes  # (all on the default device)
  assert account.live >= account.busiest_device >= ours
  record = account.record()
  assert record["by_owner"]["learner params"] == 257 * 256 * 4
  assert record["live_bytes"] == account.live and record["host_rss_bytes"] > 0


def test_a_holder_that_is_gone_or_a_donated_buffer_holds_nothing():
  ledger = memory_ledger.Ledger()
  holder = _Holder(x=jnp.ones((1000,)))
  donated = _Holder(x=jnp.ones((2000,)))
  ledger.hold("gone", holder, lambda h: h.x)
  ledger.hold("donated", donated, lambda h: h.x)
  del holder
  gc.collect()
  donated.x.delete()  # (what a donating jitted step leaves behind)
  account = ledger.account()  # (the weak reference kept nothing alive; no error)
  assert account.by_owner["gone"] == 0 and account.by_owner["donated"] == 0


def test_an_array_donated_while_the_account_reads_it_holds_nothing(monkeypatch):
  """Another thread may donate an array between the account's deleted check
  and its read of the shards (seen in a recorded run: `TypeError` from the
  deleted array's shard list): it counts as holding nothing, no error."""
  ledger = memory_ledger.Ledger()
  racing = _Holder(x=jnp.ones((3000,)), y=jnp.ones((10,)))
  ledger.hold("racing", racing, lambda h: h.x)
  ledger.hold("kept", racing, lambda h: h.y)
  array_type = type(racing.x)
  shards = array_type.addressable_shards

  def deleted_midway(self):
    if self is racing.x:
      raise TypeError("'NoneType' object is not iterable")
    return shards.fget(self)

  monkeypatch.setattr(array_type, "addressable_shards", property(deleted_midway))
  account = ledger.account()
  assert account.by_owner["racing"] == 0 and account.by_owner["kept"] == 10 * 4


def test_the_log_writes_each_phase_after_open_and_keeps_the_row_peak():
  windows = host_memory.PeakWindows()
  log = memory_log.MemoryLog(memory_ledger.Ledger(), windows)
  log.note("import")  # (before the run's folder exists: kept)
  rows = []
  log.open(rows.append)
  keep = jnp.ones((1 << 18,))  # 1 MiB live
  log.note("update", 1)
  assert [r["phase"] for r in rows] == ["import", "update"] and rows[1]["step"] == 1
  assert rows[1]["live_bytes"] >= keep.nbytes
  peak = log.row_peak()
  assert peak is None or peak >= host_memory.resident_bytes() // 2
  assert log.row_peak() is None  # (started over)
