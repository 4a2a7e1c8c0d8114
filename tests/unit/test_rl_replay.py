"""Routing replay really replays: random target experts (not what the router would choose) change the trainer's
log-probabilities, and every MoE layer routes each token to exactly the forced experts. Both checks fail if the
replay action is ignored (the agreement metric alone does not: it is computed whatever the router then does)."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.rl import forward as rl_forward
from megatron_ext.rl.arguments import add_rl_args
from megatron_ext.rl.batch import micro_batches
from megatron_ext.rl.env import DigitEnv, digit_tasks
from megatron_ext.rl.loss import aggregation_weights
from megatron_ext.rl.rollout import reference_groups
from megatron_ext.rl.types import TrainingSample
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


@pytest.fixture(scope="module")
def model():
    args = parse_args(["--model", "tiny", "--vocab-size", "32", "--seq-length", "64", "--rl-prompts", "unused",
                       "--rl-routing-replay"], world_size=1, extra=[add_rl_args])
    initialize_distributed(args)
    m = build_model(args, wrap_ddp=False)[0]
    m.eval()
    m.args = args
    yield m
    destroy()


def forced_routing_hooks(model):
    """Forward hooks on every decoder router: per call, whether each token went to exactly the replay's targets."""
    hits, handles = [], []

    def hook(router, inputs, output):
        target = router.router_replay.target_topk_idx
        if target is not None:
            forced = torch.zeros_like(output[1], dtype=torch.bool).scatter(1, target.long(), True)
            hits.append((output[1].bool() == forced).all(1))
    for router in rl_forward._decoder_routers(model):
        handles.append(router.register_forward_hook(hook))
    return hits, handles


def _micro_batch(num_layers: int, topk: int, experts: int):
    rng = np.random.RandomState(0)
    samples = []
    for gi, g in enumerate(reference_groups(digit_tasks("train", 3, seed=4), DigitEnv)):
        s = TrainingSample.from_rollout(g.rollouts[0], 1.0, gi)
        s.routing = np.stack([np.stack([rng.choice(experts, topk, replace=False) for _ in range(num_layers)])
                              for _ in range(len(s.token_ids))]).astype(np.int16)
        samples.append(s)
    weights = aggregation_weights("token-mean", [s.loss_mask for s in samples], 8)
    return micro_batches(samples, weights, 64, 1, 0, 1, 1, list(range(3)), (num_layers, topk))[0]


def _logprobs(model, mb, replay: bool):
    output, loss_func = rl_forward.logprob_forward_step(iter([mb]), model, routing_replay=replay)
    with torch.no_grad():
        return loss_func(output)[2]["logprobs"].view(-1)


def test_random_replayed_experts_are_the_ones_used_and_change_the_logprobs(model):
    cfg = model.config
    layers = len(rl_forward._decoder_routers(model))
    mb = _micro_batch(layers, cfg.moe_router_topk, cfg.num_moe_experts)
    hits, handles = forced_routing_hooks(model)
    try:
        with torch.no_grad():
            own = _logprobs(model, mb, replay=False)
            assert hits == []  # nothing forced without replay
            replayed = _logprobs(model, mb, replay=True)
    finally:
        for h in handles:
            h.remove()
    assert len(hits) == layers and all(bool(h.all()) for h in hits)
    mask = mb["loss_mask"].view(-1).bool()
    assert (own - replayed)[mask].abs().max() > 1e-3


def test_reference_pass_uses_the_reference_models_own_routing(model):
    from megatron_ext.rl.trainer import reference_logprobs

    cfg = model.config
    mb = _micro_batch(len(rl_forward._decoder_routers(model)), cfg.moe_router_topk, cfg.num_moe_experts)
    with torch.no_grad():
        own, replayed = _logprobs(model, mb, replay=False), _logprobs(model, mb, replay=True)
    ref = reference_logprobs(model, [mb], model.args)[0].view(-1)
    assert torch.allclose(ref, own, atol=1e-6) and not torch.allclose(ref, replayed, atol=1e-3)


def test_sampling_temperature_divides_the_scored_logits_but_not_the_mtp_teacher(model):
    """At temperature T the RL forward scores labels under logits / T; the MTP layers keep distilling from the
    policy's own logits (their loss is the same at any T)."""
    from megatron_ext.mtp import distill
    from megatron_ext.rl.loss import LossConfig

    cfg = model.config
    assert cfg.mtp_num_layers
    mb = _micro_batch(len(rl_forward._decoder_routers(model)), cfg.moe_router_topk, cfg.num_moe_experts)
    out = {}
    model.train()  # the MTP losses are recorded in training forwards
    try:
        for t in (1.0, 0.5):
            with torch.no_grad():
                output, _ = rl_forward.forward_step(LossConfig(), 1.0, iter([mb]), model, temperature=t)
            out[t] = (-output.view(-1), distill.pop_metrics(1))
    finally:
        model.eval()
    rl_forward._SUMS.clear()
    rl_forward._MAX.clear()
    mask = mb["loss_mask"].view(-1).bool()
    assert (out[1.0][0] - out[0.5][0])[mask].abs().max() > 1e-2
    assert out[0.5][1] and out[0.5][1] == pytest.approx(out[1.0][1], rel=1e-5)
