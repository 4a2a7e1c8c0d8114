"""The statistics the evaluation reports: intervals, pass@k, and the tests behind "significant" in comparisons.

Pure functions of plain numbers (numpy only), each with the method in its name or docstring, so a report can say
exactly what it computed:

* `wilson`: the Wilson score interval of a binomial proportion (successes out of n independent trials);
* `bootstrap_mean`: the percentile bootstrap of a mean over units (tasks), resampled with replacement; passes of
  one task stay together, so the interval accounts for passes of a task being correlated;
* `pass_at_k`: the unbiased estimator 1 - C(n-c, k) / C(n, k) of the chance that at least one of k samples is
  correct, from n samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models Trained on
  Code");
* `fisher_exact`: the two-sided Fisher exact test of a 2x2 table (one task's passes, run A against run B);
* `paired_permutation`: the paired sign-flip permutation test of a mean difference over tasks, exact up to
  `exact_up_to` tasks and Monte Carlo beyond; with one pass per run (differences in {-1, 0, 1}) it is the exact
  McNemar test;
* `holm`: Holm's step-down adjustment of p-values for testing many tasks at once.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (default 95 %) of successes / n; (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"wilson: successes {successes} outside [0, {n}]")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_mean(values: Sequence[float], level: float = 0.95, resamples: int = 10000,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampled with replacement, seeded)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return 0.0, 1.0
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k); needs 1 <= k <= n."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def fisher_exact(a_correct: int, a_total: int, b_correct: int, b_total: int) -> float:
    """Two-sided Fisher exact p-value of the table [[a_correct, a_wrong], [b_correct, b_wrong]]: the summed
    hypergeometric probability of every table with the same margins at most as likely as the observed one."""
    correct, total = a_correct + b_correct, a_total + b_total
    if total == 0:
        return 1.0
    denominator = math.comb(total, correct)

    def probability(x: int) -> float:
        return math.comb(a_total, x) * math.comb(b_total, correct - x) / denominator

    observed = probability(a_correct)
    lo, hi = max(0, correct - b_total), min(a_total, correct)
    return min(1.0, sum(p for p in (probability(x) for x in range(lo, hi + 1)) if p <= observed * (1 + 1e-7)))


def paired_permutation(differences: Sequence[float], exact_up_to: int = 16, resamples: int = 20000,
                       seed: int = 0) -> tuple[float, str]:
    """Two-sided p-value that the paired differences have mean zero (signs flipped at random under the null),
    and the method used. Units whose difference is 0 are kept (they do not change under a flip)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0 or not np.any(d):
        return 1.0, "paired sign-flip permutation (no differences)"
    observed = abs(d.sum()) - 1e-9
    nonzero = d[d != 0]
    if nonzero.size <= exact_up_to:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=nonzero.size)))
        p = float(np.mean(np.abs(signs @ nonzero) >= observed))
        return p, f"paired sign-flip permutation, exact ({2 ** nonzero.size} sign patterns)"
    rng = np.random.default_rng(seed)
    signs = rng.choice((1.0, -1.0), size=(resamples, nonzero.size))
    hits = int(np.sum(np.abs(signs @ nonzero) >= observed))
    method = f"paired sign-flip permutation, Monte Carlo ({resamples} resamples, seed {seed})"
    return (hits + 1) / (resamples + 1), method


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values (same order as given)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def median(values: Sequence[float]) -> Optional[float]:
    return float(np.median(values)) if len(values) else None
