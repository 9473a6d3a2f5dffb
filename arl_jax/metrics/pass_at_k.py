"""Sampled evaluation's numbers: the unbiased pass@k estimator and avg@n.

With `n` samples of a problem of which `c` are solved, the chance that `k`
samples drawn without replacement hold at least one solved one is

  pass@k = 1 - C(n - c, k) / C(n, k)

(Chen et al., 2021, "Evaluating Large Language Models Trained on Code"),
unbiased for the pass@k of a policy that solves the problem with probability
`c / n`; averaged over problems. It is computed as the product
`1 - prod_{i = n - c + 1}^{n} (1 - k / i)`, which never forms the large
binomials. `avg@n` is the mean reward of all `n * problems` samples (pass@1
when rewards are 0 or 1).
"""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one problem with `c` of `n` samples solved."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def ks(n: int) -> tuple[int, ...]:
  """The k reported for `n` samples: 1, the powers of two below n, and n."""
  out = [1]
  while out[-1] * 2 < n:
    out.append(out[-1] * 2)
  return tuple(dict.fromkeys([*out, n]))


def summarise(solved: np.ndarray, rewards: np.ndarray) -> dict:
  """`{"pass_at_k": {k: mean over problems}, "avg_at_n": mean reward}` of
  `[problems, n]` solved flags and rewards."""
  solved = np.asarray(solved, bool)
  problems, n = solved.shape
  counts = solved.sum(axis=1)
  return {"pass_at_k": {k: float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
                        for k in ks(n)} if problems else {},
          "avg_at_n": float(np.mean(rewards)) if problems else 0.0}
