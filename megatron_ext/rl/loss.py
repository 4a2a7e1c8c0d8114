"""The GRPO loss of the Composer 2 recipe and its variants, one small function each.

Per token t of sample i (model tokens only), with log p the trainer's log-probability, log q_s the sampler's,
log p_old the policy's before this step's first update (= log p detached when --grpo-iterations is 1):

    rho    = exp(log p - log p_old)                               PPO ratio (1 with gradient d log p at iteration 1)
    w      = importance weight of p_old against the sampler        none | tis | icepop | sequence   (detached)
    policy = -w * min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i)
    term   = policy + beta * k(log p, log p_ref)   (k2 or k3 in the loss; k1 goes into the reward instead)
                    - c_ent * H_t                   (optional entropy bonus)
    loss   = sum_t a_t term_t                       a_t: aggregation weight (constant, token-mean, sequence-mean)
             constant: a_t = 1 / (prompts per step x group size x L_max), a constant of the configuration

The aggregation weight is computed from the whole step's batch before it is split into micro-batches and ranks
(`aggregation_weights`), so the loss is the same under any DP/CP/PP layout. Advantages live in advantage.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

AGGREGATIONS = ("constant", "token-mean", "sequence-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_MODES = ("none", "tis", "icepop", "sequence")


@dataclass
class LossConfig:
    kl_beta: float = 0.0
    kl_estimator: str = "k1"            # k1: in the reward (advantage.py); k2/k3: in the loss
    clamp_eps_lower: float = 0.2
    clamp_eps_upper: float = 0.2
    importance_sampling: str = "none"
    is_truncation_coef: float = 2.0     # TIS / sequence-level cap C
    icepop_low: float = 0.5             # IcePop band [low, high] of the ratio
    icepop_high: float = 2.0
    entropy_weight: float = 0.0

    def __post_init__(self):
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"--rl-kl-estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.importance_sampling not in IS_MODES:
            raise ValueError(f"--rl-importance-sampling must be one of {IS_MODES}, got {self.importance_sampling!r}")
        if not 0 < self.icepop_low <= 1 <= self.icepop_high:
            raise ValueError("--rl-icepop-band LOW HIGH needs 0 < LOW <= 1 <= HIGH")
        if self.is_truncation_coef <= 0:
            raise ValueError("--rl-importance-sampling-truncation-coef must be positive")


def kl_estimates(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """k1, k2, k3 per token for samples drawn from p, with log r = log p_ref - log p."""
    log_r = ref_logp - logp
    return {"k1": -log_r, "k2": 0.5 * log_r ** 2, "k3": torch.exp(log_r) - 1 - log_r}


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       sample_ids: torch.Tensor, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Detached weights correcting for the sampler's distribution, and a 0/1 per token: truncated or masked.

    tis: min(ratio, C). icepop: ratio inside [low, high], 0 outside (the token drops out of the gradient).
    sequence: min(prod_t ratio, C) of the whole sample, the same for each of its tokens. `sample_ids` [T] numbers
    the packed samples (-1 on padding); a sample must be whole in this micro-batch for 'sequence'."""
    log_ratio = (old_logp - sampler_logp).detach() * mask
    ratio = torch.exp(log_ratio)
    mode = cfg.importance_sampling
    if mode == "none":
        return torch.ones_like(ratio), torch.zeros_like(ratio)
    if mode == "tis":
        clipped = (ratio > cfg.is_truncation_coef).float() * mask
        return torch.clamp(ratio, max=cfg.is_truncation_coef), clipped
    if mode == "icepop":
        outside = ((ratio < cfg.icepop_low) | (ratio > cfg.icepop_high)).float() * mask
        return ratio * (1 - outside), outside
    ids = sample_ids.clamp(min=0)
    seq_log = torch.zeros(int(ids.max()) + 1 if ids.numel() else 1, dtype=log_ratio.dtype,
                          device=log_ratio.device).index_add(0, ids, log_ratio * (sample_ids >= 0))
    per_token = torch.exp(seq_log)[ids]
    clipped = (per_token > cfg.is_truncation_coef).float() * mask
    return torch.clamp(per_token, max=cfg.is_truncation_coef), clipped


def policy_term(logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor, weight: torch.Tensor,
                cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """-w min(rho A, clip(rho) A) per token, and a 0/1 per token: the clip was active."""
    rho = torch.exp(logp - old_logp.detach())
    unclipped = rho * advantage
    clipped = torch.clamp(rho, 1 - cfg.clamp_eps_lower, 1 + cfg.clamp_eps_upper) * advantage
    surrogate = torch.minimum(unclipped, clipped)
    return -weight.detach() * surrogate, (clipped < unclipped).float()


def aggregation_weights(mode: str, masks: list[np.ndarray], max_response_length: int,
                        episodes: int | None = None) -> list[np.ndarray]:
    """Per-token weights a_t of every sample of a step (masks: the loss mask of each, over the whole step).

    constant (Dr.GRPO): 1 / (E L_max) with E = `episodes`, the configuration's episodes per step (prompts per step
    x group size), not the number of sequences at hand: a partial last step, groups pending from a checkpoint or
    self-summarisation chains (several sequences per episode) must not rescale every token's gradient.
    token-mean: 1 / (total masked tokens); sequence-mean: 1 / (N |o_i|)."""
    n = len(masks)
    if mode == "constant":
        if max_response_length <= 0:
            raise ValueError("--grpo-max-response-length must be positive for the constant aggregation")
        if not episodes or episodes < 1:
            raise ValueError("the constant aggregation needs the episodes per step (--grpo-prompts-per-step x "
                             "--grpo-group-size)")
        return [m / (episodes * max_response_length) for m in masks]
    if mode == "token-mean":
        total = max(sum(float(m.sum()) for m in masks), 1.0)
        return [m / total for m in masks]
    if mode == "sequence-mean":
        return [m / (n * max(float(m.sum()), 1.0)) for m in masks]
    raise ValueError(f"--rl-loss-aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def grpo_loss(logp: torch.Tensor, batch: dict[str, torch.Tensor], cfg: LossConfig,
              entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss contribution of one micro-batch (already globally normalised by batch['agg_weight']) and
    per-token statistics for logging ([T] tensors, meaningful where batch['loss_mask'] is 1).

    batch (flat [T] tensors, aligned with `logp`, the log-probability of each label): loss_mask, agg_weight,
    advantage, sampler_logprobs, sample_ids; optional old_logprobs (--grpo-iterations > 1) and ref_logprobs
    (k2/k3 in the loss or KL metrics)."""
    mask = batch["loss_mask"].float()
    old = batch.get("old_logprobs")
    old = logp.detach() if old is None else old
    weight, corrected = importance_weights(old, batch["sampler_logprobs"], mask, batch["sample_ids"], cfg)
    policy, clip_active = policy_term(logp, old, batch["advantage"], weight, cfg)
    term = policy
    stats = {"policy": policy.detach(), "is_corrected": corrected, "clipped": clip_active,
             "mismatch": (logp.detach() - batch["sampler_logprobs"]).abs() * mask}
    ref = batch.get("ref_logprobs")
    if ref is not None:
        kl = kl_estimates(logp, ref)
        if cfg.kl_beta and cfg.kl_estimator != "k1":
            term = term + cfg.kl_beta * kl[cfg.kl_estimator]
        stats.update(k1=kl["k1"].detach(), k3=kl["k3"].detach())
    if entropy is not None:
        if cfg.entropy_weight:
            term = term - cfg.entropy_weight * entropy
        stats["entropy"] = entropy.detach()
    loss = torch.sum(batch["agg_weight"] * mask * term)
    return loss, stats
