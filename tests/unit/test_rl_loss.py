"""GRPO loss variants against direct per-token re-implementations (values and gradients), advantages and
aggregation weights on hand-made numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_ext.rl.advantage import group_advantages, is_zero_advantage, kl_penalised
from megatron_ext.rl.loss import LossConfig, aggregation_weights, grpo_loss

# two samples packed in one micro-batch: sample 0 at positions 0..3, sample 1 at 4..8, padding at 9
MASK = [0, 1, 1, 1, 0, 0, 1, 1, 1, 0]
IDS = [0, 0, 0, 0, 1, 1, 1, 1, 1, -1]
ADV = [0.7, 0.7, 0.7, 0.7, -0.4, -0.4, -0.4, -0.4, -0.4, 0.0]
LOGP = [-1.0, -0.5, -2.0, -0.1, -3.0, -1.2, -0.3, -0.9, -4.0, -0.2]
SAMPLER = [0.0, -0.4, -2.9, -0.1, 0.0, 0.0, -0.35, -0.2, -4.1, 0.0]
OLD = [-1.0, -0.6, -1.5, -0.15, -3.0, -1.2, -0.5, -0.95, -3.5, -0.2]
REF = [-1.1, -0.55, -2.2, -0.3, -2.5, -1.0, -0.4, -1.5, -3.8, -0.2]
ENT = [1.0, 2.0, 0.5, 1.5, 0.3, 0.1, 0.9, 1.2, 0.4, 0.0]


def _batch(weights, old=False, ref=False):
    b = {"loss_mask": torch.tensor(MASK, dtype=torch.float32), "agg_weight": torch.tensor(weights, dtype=torch.float32),
         "advantage": torch.tensor(ADV), "sampler_logprobs": torch.tensor(SAMPLER), "sample_ids": torch.tensor(IDS)}
    if old:
        b["old_logprobs"] = torch.tensor(OLD)
    if ref:
        b["ref_logprobs"] = torch.tensor(REF)
    return b


def _reference(cfg: LossConfig, weights, use_old: bool, use_ref: bool, use_entropy: bool) -> tuple[float, list[float]]:
    """The loss and d loss / d logp written out token by token in plain floats."""
    old = OLD if use_old else LOGP
    seq_log = {}
    for t in range(len(MASK)):
        if MASK[t]:
            seq_log[IDS[t]] = seq_log.get(IDS[t], 0.0) + old[t] - SAMPLER[t]
    loss, grad = 0.0, []
    for t in range(len(MASK)):
        ratio = math.exp(old[t] - SAMPLER[t])
        mode = cfg.importance_sampling
        if mode == "none":
            w = 1.0
        elif mode == "tis":
            w = min(ratio, cfg.is_truncation_coef)
        elif mode == "icepop":
            w = ratio if cfg.icepop_low <= ratio <= cfg.icepop_high else 0.0
        else:
            w = min(math.exp(seq_log.get(IDS[t], 0.0)), cfg.is_truncation_coef) if IDS[t] >= 0 else 1.0
        rho = math.exp(LOGP[t] - old[t])
        a = ADV[t]
        lo, hi = 1 - cfg.clamp_eps_lower, 1 + cfg.clamp_eps_upper
        clipped_rho = min(max(rho, lo), hi)
        if rho * a <= clipped_rho * a:
            term, dterm = -w * rho * a, -w * rho * a  # d(rho)/d logp = rho
        else:
            term, dterm = -w * clipped_rho * a, 0.0
        if use_ref and cfg.kl_beta and cfg.kl_estimator != "k1":
            log_r = REF[t] - LOGP[t]
            if cfg.kl_estimator == "k2":
                term += cfg.kl_beta * 0.5 * log_r ** 2
                dterm += cfg.kl_beta * (-log_r)
            else:
                term += cfg.kl_beta * (math.exp(log_r) - 1 - log_r)
                dterm += cfg.kl_beta * (-math.exp(log_r) + 1)
        if use_entropy and cfg.entropy_weight:
            term -= cfg.entropy_weight * ENT[t]
        loss += weights[t] * MASK[t] * term
        grad.append(weights[t] * MASK[t] * dterm)
    return loss, grad


VARIANTS = [
    dict(),
    dict(importance_sampling="tis", is_truncation_coef=1.5),
    dict(importance_sampling="icepop", icepop_low=0.8, icepop_high=1.25),
    dict(importance_sampling="sequence", is_truncation_coef=3.0),
    dict(kl_beta=0.1, kl_estimator="k2"),
    dict(kl_beta=0.1, kl_estimator="k3"),
    dict(kl_beta=0.1, kl_estimator="k1"),  # k1 lives in the reward: no loss term
    dict(entropy_weight=0.01),
    dict(clamp_eps_lower=0.1, clamp_eps_upper=0.05),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "default")
@pytest.mark.parametrize("use_old", [False, True], ids=["iteration1", "ppo"])
def test_loss_matches_per_token_reference(variant, use_old):
    cfg = LossConfig(**variant)
    weights = [0.05] * 4 + [0.1] * 5 + [0.0]
    logp = torch.tensor(LOGP, requires_grad=True)
    entropy = torch.tensor(ENT, requires_grad=True)
    loss, stats = grpo_loss(logp, _batch(weights, old=use_old, ref=True), cfg, entropy)
    loss.backward()
    want, want_grad = _reference(cfg, weights, use_old, True, True)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert logp.grad.tolist() == pytest.approx(want_grad, rel=1e-5, abs=1e-7)
    if cfg.entropy_weight:
        assert entropy.grad.tolist() == pytest.approx([-cfg.entropy_weight * w * m for w, m in zip(weights, MASK)])
    # statistics: KL estimators from their definitions, mismatch |logp - sampler|
    t = 2
    assert float(stats["k1"][t]) == pytest.approx(LOGP[t] - REF[t])
    assert float(stats["k3"][t]) == pytest.approx(math.exp(REF[t] - LOGP[t]) - 1 - (REF[t] - LOGP[t]), rel=1e-5)
    assert float(stats["mismatch"][t]) == pytest.approx(abs(LOGP[t] - SAMPLER[t]), rel=1e-5)


def test_iteration_one_gradient_is_the_policy_gradient():
    """At --grpo-iterations 1 the PPO form is exactly -A d log p (weights 1, no clipping)."""
    logp = torch.tensor(LOGP, requires_grad=True)
    weights = [1.0] * len(MASK)
    loss, _ = grpo_loss(logp, _batch(weights), LossConfig())
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-a * m for a, m in zip(ADV, MASK)])


def test_importance_statistics_count_corrected_tokens():
    cfg = LossConfig(importance_sampling="tis", is_truncation_coef=1.5)
    _, stats = grpo_loss(torch.tensor(LOGP), _batch([1.0] * 10), cfg)
    ratios = [math.exp(LOGP[t] - SAMPLER[t]) for t in range(10)]
    assert stats["is_corrected"].tolist() == [float(MASK[t] and ratios[t] > 1.5) for t in range(10)]
    cfg = LossConfig(importance_sampling="icepop", icepop_low=0.8, icepop_high=1.25)
    _, stats = grpo_loss(torch.tensor(LOGP), _batch([1.0] * 10), cfg)
    assert stats["is_corrected"].tolist() == [float(MASK[t] and not 0.8 <= ratios[t] <= 1.25) for t in range(10)]
    assert sum(stats["is_corrected"].tolist()) >= 1  # the hand-made numbers do exercise the band


def test_aggregation_weights():
    masks = [np.array([0, 1, 1, 0], np.float32), np.array([0, 0, 1, 1, 1, 1], np.float32)]
    const = aggregation_weights("constant", masks, 8, episodes=2)
    assert [w.tolist() for w in const] == [[0, 1 / 16, 1 / 16, 0], [0, 0] + [1 / 16] * 4]
    tok = aggregation_weights("token-mean", masks, 8)
    assert sum(float((w * m).sum()) for w, m in zip(tok, masks)) == pytest.approx(1.0)
    assert tok[0][1] == pytest.approx(1 / 6)
    seq = aggregation_weights("sequence-mean", masks, 8)
    assert seq[0][1] == pytest.approx(1 / 4) and seq[1][2] == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match="--rl-loss-aggregation"):
        aggregation_weights("mean", masks, 8)


def test_constant_normaliser_is_a_constant_of_the_configuration():
    """Dr.GRPO's 1 / (prompts x group size x L_max): a sample's token weights do not depend on how many sequences
    the step holds (a partial last step, pending groups after a resume, self-summarisation chains)."""
    rng = np.random.RandomState(0)
    masks = [(rng.uniform(size=12) > 0.4).astype(np.float32) for _ in range(8)]
    full = aggregation_weights("constant", masks, 10, episodes=8)
    for n in (1, 3, 5, 11):  # fewer sequences than episodes, or more (chains)
        part = aggregation_weights("constant", (masks * 2)[:n], 10, episodes=8)
        assert all(np.array_equal(a, b) for a, b in zip(part, (full * 2)[:n]))
    assert full[0].max() == pytest.approx(1 / 80)
    with pytest.raises(ValueError, match="--grpo-group-size"):
        aggregation_weights("constant", masks, 10)


def test_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]).tolist() == [0.5, -0.5, -0.5, 0.5]
    std = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalize=True)
    assert std.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    assert group_advantages([0.3] * 4).tolist() == [0.0] * 4 and is_zero_advantage([0.3] * 4)
    assert not is_zero_advantage([0.3, 0.2])
    # k1 in the reward: r - beta * sum k1
    assert kl_penalised([1.0, 0.0], [2.0, -1.0], 0.1).tolist() == pytest.approx([0.8, 0.1])


def test_importance_correction_defaults_to_tis_when_samples_may_be_stale():
    from megatron_ext.arguments import parse_args
    from megatron_ext.rl.arguments import add_rl_args, loss_config

    def mode(*flags):
        args = parse_args(["--model", "tiny", "--rl-prompts", "p.jsonl", *flags], extra=[add_rl_args], world_size=1)
        return loss_config(args).importance_sampling

    stale = ["--rl-rollout-workers", "2", "--rl-max-staleness", "1"]
    assert mode(*stale) == "tis"
    assert mode("--rl-rollout-workers", "2") == "none"  # staleness 0: every token on-policy
    assert mode() == "none"
    assert mode(*stale, "--rl-importance-sampling", "none") == "none"  # an explicit choice stands
    assert mode(*stale, "--rl-importance-sampling", "icepop") == "icepop"


def test_bad_config_is_refused_with_the_flag_name():
    with pytest.raises(ValueError, match="--rl-kl-estimator"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ValueError, match="--rl-icepop-band"):
        LossConfig(importance_sampling="icepop", icepop_low=1.5)
