"""Drop accounting by reason, environment, completion length and task."""

import json

import numpy as np
import pytest

from arl_jax.core import rollout as rollout_lib
from arl_jax.orchestrator import drop_ledger as drop_ledger_lib


def group(group_id, prompt_id, lengths, reasons, env="arith"):
  rollouts = [rollout_lib.Rollout(
      group_id=group_id, sample_index=s, prompt_ids=np.array([1], np.int32),
      completion_ids=np.ones(n, np.int32), loss_mask=np.ones(n, np.float32),
      behaviour_logprobs=np.zeros(n, np.float32), token_versions=np.zeros(n, np.int32),
      dispatch_version=0, finish_reason=reason, reward=0.0, env_name=env)
      for s, (n, reason) in enumerate(zip(lengths, reasons))]
  return rollout_lib.Group(group_id=group_id, prompt_id=prompt_id, dispatch_version=0,
                           rollouts=rollouts)


def test_length_buckets_are_quarters_of_the_budget():
  ledger = drop_ledger_lib.DropLedger(max_new_tokens=24)
  assert [ledger.length_bucket(n) for n in (1, 6, 7, 18, 19, 24)] == [
      "1-6", "1-6", "7-12", "13-18", "19-24", "19-24"]
  small = drop_ledger_lib.DropLedger(max_new_tokens=2)
  assert [small.length_bucket(n) for n in (1, 2)] == ["1-1", "2-2"]


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_counts_by_reason_env_length_and_task(mask_truncated):
  ledger = drop_ledger_lib.DropLedger(max_new_tokens=8, mask_truncated_completions=mask_truncated)
  masked = ledger.record_trained([
      group(0, 10, [2, 8], ["stop", "length"]),
      group(1, 11, [3, 5], ["error", "stop"], env="tool_agent")])
  assert masked == ({"env_error": 1, "truncated": 1} if mask_truncated else {"env_error": 1})
  ledger.record_stale([group(2, 12, [8, 7], ["length", "stop"])])
  ledger.record_cancelled(prompt_id=10, env_name="arith", group_size=2)
  m = ledger.metrics()
  truncated = 1 if mask_truncated else 0
  assert (m["dropped_stale"], m["dropped_cancelled"], m["dropped_env_error"],
          m["dropped_truncated"]) == (2, 2, 1, truncated)
  assert m["dropped_total"] == 5 + truncated
  assert m["drop_rate"] == pytest.approx((5 + truncated) / 8)  # 8 rollouts retired
  assert m["drops_by_env"]["tool_agent"] == {"env_error": 1}
  assert m["drops_by_env"]["arith"] == {"cancelled": 2, "stale": 2,
                                        **({"truncated": 1} if mask_truncated else {})}
  assert m["drops_by_length"]["7-8"]["stale"] == 2
  assert m["drops_by_length"]["unfinished"] == {"cancelled": 2}
  assert m["drop_rate_by_length"]["unfinished"] == 1.0
  # Tasks: 10 trained once and lost one group; 12 never trained.
  assert (m["tasks_seen"], m["tasks_lost"]) == (3, 1)
  table = ledger.task_table()
  assert [(row["env"], row["prompt_id"]) for row in table] == [("arith", 12), ("arith", 10)]
  assert table[0]["drop_rate"] == 1.0 and table[1]["drop_rate"] == 0.5
  assert table[1]["rollouts_dropped"] == {"cancelled": 2, **(
      {"truncated": 1} if mask_truncated else {})}


def test_masked_rollouts_leave_the_loss_and_the_baseline():
  from arl_jax.core import train_batch as train_batch_lib
  g = group(0, 0, [3, 3, 3, 8], ["stop", "stop", "error", "length"])
  for r, reward in zip(g.rollouts, (1.0, 0.0, 5.0, 7.0)):
    r.reward = reward
  kw = dict(prompt_len=2, max_new_tokens=8, pad_id=0, advantage_estimator="grpo")
  kept = train_batch_lib.assemble([g], **kw)
  masked = train_batch_lib.assemble([g], mask_truncated_completions=True, **kw)
  assert kept.loss_mask[3].sum() == 8 and masked.loss_mask[3].sum() == 0
  assert kept.loss_mask[2].sum() == masked.loss_mask[2].sum() == 0  # errors: always
  assert np.all(masked.advantages[3] == 0)
  # Without the truncated row, the baseline is over the two valid rewards only.
  np.testing.assert_allclose(masked.advantages[:2, 2], [1.0, -1.0], atol=1e-3)


def test_the_ledger_round_trips_through_json():
  ledger = drop_ledger_lib.DropLedger(max_new_tokens=8)
  ledger.record_cancelled(prompt_id=3, env_name="arith", group_size=4)
  restored = drop_ledger_lib.DropLedger(max_new_tokens=8)
  restored.restore(json.loads(json.dumps(ledger.to_json())))
  assert restored.metrics() == ledger.metrics()
  assert restored.task_table() == ledger.task_table()
