"""Process-local batch shards across real processes (2 x one CPU device,
gloo): each process builds its block of the global batch from the groups it
holds; a block whose groups all come from its own process moves no token
bytes, only the plan (kilobytes); a checkpoint collects held groups to
process 0 bit for bit."""

from arl_jax.testing import lockstep_worker


def test_a_block_fed_from_its_own_process_moves_no_token_bytes():
  reports = lockstep_worker.run(2, placement="local", collect=True)
  for report in reports:
    assert report["block_equal"], report
    assert report["moved_rollouts"] == 0 and report["token_bytes_moved"] == 0, report
    # What reached the process: the step's header and plan, and the
    # collectives' own traffic; the batch is ~1 MB.
    assert report["received"] < 0.02 * report["batch_bytes"], report
  assert reports[0]["collect_equal"]


def test_rollouts_move_only_to_balance_and_arrive_intact():
  reports = lockstep_worker.run(2, placement="process0", collect=True)
  for report in reports:
    assert report["block_equal"], report
    assert report["moved_rollouts"] > 0 and report["token_bytes_moved"] > 0, report
    # The moved rollouts' arrays (16 bytes per completion token), not the batch.
    assert report["received"] < 0.3 * report["batch_bytes"], report
  assert reports[0]["collect_equal"]


def test_a_process_missing_a_planned_group_fails_every_process_not_a_hang():
  reports = lockstep_worker.run(2, placement="local", lose=1, timeout_s=120)
  for report in reports:  # group 1 is process 1's
    assert "do not hold rollouts process 0's plan says they hold" in report["error"], report
    assert "{1: 4}" in report["error"], report
