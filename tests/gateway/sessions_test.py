"""The session store: a run's rollout sessions (bound) are never evicted by
other clients' sessions or by idling, until they are cancelled."""

import time

import pytest

from arl_jax.gateway import sessions


def test_bound_sessions_survive_the_limit_and_idling_until_cancelled():
  store = sessions.SessionStore(max_sessions=2, max_branches=4, ttl_s=0.05)
  bound = store.bind("rollout-1", (7, 0))
  for i in range(5):  # other clients' sessions: at most 2 kept
    store.get(f"client-{i}")
  assert store.get("rollout-1", create=False) is bound
  assert len(store) == 3 and store.evicted == 3
  time.sleep(0.1)
  store.get("client-new")  # (forgets the idle unbound ones)
  assert store.get("rollout-1", create=False) is bound
  bound.cancelled = "its group was cancelled"
  time.sleep(0.1)
  store.get("client-newer")
  assert store.get("rollout-1", create=False) is None  # a cancelled one idles out
  with pytest.raises(ValueError, match="exists already"):
    store.bind("client-newer", (8, 0))
