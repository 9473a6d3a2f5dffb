"""End-to-end: the tiny config, asynchronous, on 4 learner + 4 sampler devices."""

import collections
import json
import os
import re

import numpy as np
import pytest

from arl_jax.learner import optim
from arl_jax.testing import tiny, tool_rows
from arl_jax.training import run_lib


def test_tiny_async_run_end_to_end(tmp_path):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 6
  lines = []
  result = run_lib.run(config, str(tmp_path), print_fn=lines.append, keep_batches=True)
  k = config.orchestrator.max_off_policy_steps
  groups_per_batch = config.orchestrator.batch_size // config.orchestrator.group_size

  # Versions advance one per update; the learner consumed exactly its batches.
  assert result.final_version == 6
  assert [b["batch_version"] for b in result.trained_batches] == list(range(6))
  assert result.groups_trained == 6 * groups_per_batch
  for b in result.trained_batches:
    assert len(b["group_ids"]) == groups_per_batch
    sampled = b["loss_mask"] > 0
    versions = b["token_versions"]
    # Every trained token records the version that sampled it: never missing,
    # never from the future, never older than the group's dispatch version.
    assert sampled.any()
    assert np.all(versions[sampled] >= 0)
    assert np.all(versions[sampled] <= b["batch_version"])
    assert np.all(versions[~sampled] == -1)  # prompt and padding carry no version
    dispatch = np.repeat(b["dispatch_versions"], config.orchestrator.group_size)
    np.testing.assert_array_equal(b["lag"], b["batch_version"] - dispatch)
    assert np.all(b["lag"] <= k)
    oldest = np.where(sampled, versions, np.iinfo(np.int32).max).min(axis=1)
    has_tokens = sampled.any(axis=1)
    np.testing.assert_array_equal(oldest[has_tokens], dispatch[has_tokens])
  # The sampler really did pick up published versions (not only version 0).
  assert max(int(b["token_versions"].max()) for b in result.trained_batches) >= 1
  # With max_async_level=1 the sampler runs ahead: some batch trains off-policy.
  assert max(int(b["lag"].max()) for b in result.trained_batches) >= 1

  # Metrics on disk, progress on stdout.
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  rl = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert [r["step"] for r in rl] == list(range(6))
  for key in ("version", "reward_mean", "lag_mean", "lag_histogram", "lag_in_flight_histogram",
              "lag_in_queue_histogram", "tokens_per_s", "drop_rate", "dropped_stale",
              "dropped_cancelled", "dropped_env_error", "dropped_truncated", "drops_by_env",
              "drops_by_length", "drop_rate_by_length", "tasks_lost", "task_drop_rate_mean",
              "cancelled_tokens_saved_max", "ratio_max", "clip_fraction", "grad_norm", "entropy"):
    assert key in rl[0], key
  for r in rl:  # versions in flight and in the queue are never negative
    assert min(int(v) for v in r["lag_in_flight_histogram"]) >= 0
    assert min(int(v) for v in r["lag_in_queue_histogram"]) >= 0
  assert any(line.startswith("step") and "v6" in line for line in lines)
  assert any(line.startswith("eval") for line in lines)


def test_tight_staleness_bound_drops_or_cancels_and_still_trains(tmp_path):
  """K=0 with a sampler two batches ahead: stale work is dropped, never trained.
  (With packed learner rows: the loop trains whatever rows hold.)"""
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 5
  config.eval_every = 0
  config.warmup.steps = 0
  config.orchestrator.update(max_async_level=2, max_off_policy_steps=0)
  config.learner.pack_len = 16
  result = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None, keep_batches=True)
  assert result.final_version == 5
  for b in result.trained_batches:
    assert np.all(b["lag"] == 0)
    # Every rollout of the batch is one segment of a row (the packer chose
    # how many a row holds: at this size attention costs favour one).
    assert b["segment_ids"].max(axis=1).sum() == config.orchestrator.batch_size
  assert all(0 < r["batch_fill"] <= 1 and r["batch_columns"] in (8, 16) for r in result.history)
  last = result.history[-1]
  assert last["dropped_stale"] + last["dropped_cancelled"] > 0
  assert last["drop_rate"] > 0
  # Per-task outcomes of every task that lost a group are on disk.
  tasks = json.load(open(os.path.join(tmp_path, "task_drops.json")))
  assert tasks and all(t["groups_dropped"] > 0 for t in tasks)


def test_tool_agent_episodes_span_policy_versions_while_tools_are_slow(tmp_path):
  """Multi-turn end to end: tool latency outlives weight updates, so episodes
  are re-admitted under newer weights and their segments record several versions."""
  config = tiny.load_config("tool_agent", "tiny")
  config.num_steps = 10
  config.eval_every = 0
  # Tools slower than a tiny update step: episodes wait across publishes.
  config.env.update(latency_median_s=0.3, latency_p99_s=1.0, latency_max_s=1.5)
  result = run_lib.run(config, str(tmp_path), print_fn=lambda _: None, keep_batches=True)
  spans, observed_rows = [0], 0
  for b in result.trained_batches:
    # Observations are real tokens of the row, never trained on, each after
    # a "]" the policy sampled; `gaps`: how much newer the policy after the
    # tool's answer was than every one before it.
    observed, gaps = tool_rows.check_batch(b, prompt_len=config.sampler.prompt_len,
                                           max_lag=config.orchestrator.max_off_policy_steps)
    observed_rows += observed
    spans += gaps
  assert observed_rows > 0, "no episode called the tool"
  assert max(spans) >= 1, "no episode was re-admitted under newer weights"
  # ... and the logged metrics say so.
  records = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
  rl = [r for r in records if r.get("phase") == "rl" and "loss" in r]
  assert rl[-1]["env_turns"] >= rl[-1]["sampler_resumes"] > 0
  assert max(r["multi_version_fraction"] for r in rl) > 0
  assert rl[-1]["env_errors"] == rl[-1]["env_timeouts"] == 0


@pytest.mark.parametrize("learner, logged", [
    (dict(loss="m2po", num_minibatches=2, kl_coef=0.05),
     ("masked_fraction", "kl_reference", "behaviour_weight_mean")),
    (dict(loss="vtrace", rho_bar=2.0, aggregation="seq_sum_norm", entropy_coef=0.01),
     ("clip_fraction",)),
    (dict(loss="vtrace", lam=0.95, c_bar=1.0, value_head=True),
     ("value_loss", "explained_variance")),
    (dict(loss="clipped_ratio", num_epochs=2, num_microbatches=2, tis_cap=2.0, age_decay=0.5,
          advantage="rloo"),
     ("tis_truncated_fraction", "behaviour_weight_mean")),
    (dict(loss="gspo", aggregation="seq_mean_token_mean", mismatch_mask="sequence",
          pack_len=64, lr_schedule="cosine", lr_warmup_steps=2, advantage="reinforce_pp"),
     ("clip_fraction", "mismatch_masked_fraction")),
    (dict(loss="cispo", seq_tis_cap=2.0, advantage="reinforce_pp_baseline",
          lr_schedule="linear"),
     ("clip_fraction", "seq_tis_truncated_fraction")),
])
def test_every_loss_trains_end_to_end(tmp_path, learner, logged):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 3
  config.eval_every = 0
  config.model.value_head = learner.pop("value_head", False)
  config.learner.update(learner)
  result = run_lib.run(config, str(tmp_path), print_fn=lambda *_: None)
  assert result.final_version == 3
  last = result.history[-1]
  assert last["skipped_steps"] == 0 and np.isfinite(last["loss"]) and last["entropy"] > 0
  assert last["optimizer_steps"] == learner.get("num_epochs", 1) * learner.get(
      "num_minibatches", 1)
  for key in logged:
    assert np.isfinite(last[key]), key
  # Each update's row holds the rate it trained at.
  rate = optim.learning_rate(optim.OptimConfig(
      lr=config.learner.lr, **{k: v for k, v in learner.items() if k.startswith("lr_")}), 3)
  np.testing.assert_allclose([r["lr"] for r in result.history], [rate(u) for u in range(3)],
                             rtol=1e-6)


def test_a_run_with_one_epoch_of_prompts_ends_when_they_are_used_up(tmp_path):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 1000
  config.eval_every = 0
  config.data.num_epochs = 1
  config.orchestrator.update(batch_size=64, group_size=4)  # 16 prompts per batch
  lines = []
  result = run_lib.run(config, str(tmp_path), print_fn=lines.append, keep_batches=True)
  from arl_jax.envs import arith
  num_train = len(arith.make_prompts(arith.ArithConfig(max_operand=9), "train"))
  assert 0 < result.final_version < 1000
  last = result.history[-1]
  assert last["dropped_total"] == 0
  # Every batch is full and every trained group had a different prompt (one epoch) ...
  assert last["tasks_seen"] == 16 * result.final_version <= num_train
  # ... and the run used the epoch up to its last full batch (what is left cannot fill one).
  assert num_train - 16 * result.final_version < 16
  assert any(line.startswith("data exhausted after") for line in lines)


def test_dynamic_sampling_drops_zero_variance_groups_and_keeps_batches_full(tmp_path):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 3
  config.eval_every = 0
  config.orchestrator.filter_zero_variance = True
  config.warmup.steps = 40  # (else the tiny model gets every sum wrong: no group varies)
  lines = []
  result = run_lib.run(config, str(tmp_path), print_fn=lines.append)
  assert result.final_version == 3
  last = result.history[-1]
  events = [json.loads(line) for line in open(os.path.join(tmp_path, "groups.jsonl"))]
  dropped = [e for e in events if e["event"] == "dropped_zero_variance"]
  trained = collections.Counter(e["version"] for e in events if e["event"] == "trained")
  g = config.orchestrator.group_size
  # The tiny model mostly fails or mostly succeeds: groups of equal rewards
  # came, were dropped, counted in rollouts, and replaced ...
  assert dropped and last["dropped_zero_variance"] >= g * len(dropped) - g * 8
  assert 0 < last["zero_variance_kept_fraction"] < 1
  # ... and every batch was full, of groups whose rewards differ.
  assert set(trained.values()) == {config.orchestrator.batch_size // g}
  assert all(r["batch_rows"] == config.orchestrator.batch_size for r in result.history)
  assert any(f" z{last['dropped_zero_variance']} " in line for line in lines)


def test_a_run_without_signal_stops_and_says_why(tmp_path):
  config = tiny.load_config("arith", "tiny")
  config.num_steps = 3
  config.eval_every = 0
  config.orchestrator.filter_zero_variance = True  # the untrained model: every reward 0
  lines = []
  result = run_lib.run(config, str(tmp_path), print_fn=lines.append)
  assert not result.complete and result.final_version == 0
  assert "no group's rewards differed" in result.stop_reason
  # The sampler goes on dropping while the learner looks, so the count it
  # names is at least the threshold (256 for this batch), not exactly it.
  counts = [int(m.group(1)) for line in lines
            for m in [re.search(r"dropped the last (\d+) groups in a row", line)] if m]
  assert counts and min(counts) >= 256
