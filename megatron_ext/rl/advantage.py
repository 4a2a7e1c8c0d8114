"""Group-relative advantages (Dr.GRPO): reward minus the group mean, optionally over the group's std.

With the k1 estimator the KL to the reference enters the reward first: r_i <- r_i - beta * sum_t k1_t, where
k1_t = log p(o_t) - log p_ref(o_t) over the model tokens of sample i (p: the sampler's raw log-probabilities,
the policy that produced the tokens). Groups whose rewards are all equal get zero advantages and are trained
on anyway (dropping them would break exactly-once); they are counted.
"""

from __future__ import annotations

import numpy as np


def group_advantages(rewards, std_normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    a = r - r.mean()
    if std_normalize:
        a = a / (r.std() + eps)
    return a


def kl_penalised(rewards, k1_sums, beta: float) -> np.ndarray:
    """Rewards with the k1 KL penalty folded in (k1_sums: per sample, summed over its model tokens)."""
    return np.asarray(rewards, dtype=np.float64) - beta * np.asarray(k1_sums, dtype=np.float64)


def is_zero_advantage(rewards) -> bool:
    r = np.asarray(rewards, dtype=np.float64)
    return bool(np.all(r == r[0]))
