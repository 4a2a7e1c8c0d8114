"""An RL training step (GRPO loss on packed rollouts, k3 KL in the loss, TIS, entropy bonus, routing replay, MTP
self-distillation with the trunk detached) gives the same losses, statistics and gradients under TP2+SP, EP2 and
PP2 as on one rank."""

from __future__ import annotations

import json
import math
import os
import tempfile
from functools import partial

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.harness import _free_port, join

BASE = ["--model", "tiny", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64", "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3",
        "--seed", "7", "--rl-prompts", "unused", "--rl-routing-replay", "--mtp-detach-trunk"]
LAYOUTS = {
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}
DP_SPLIT = 2  # samples are dealt to two data-parallel slots in every layout, so micro-batches are identical


def _samples():
    """Hand-made rollouts: digit prompts with arbitrary answers, sampler logprobs, advantages and routing."""
    from megatron_ext.rl.env import DigitEnv, digit_tasks
    from megatron_ext.rl.rollout import reference_groups
    from megatron_ext.rl.types import TrainingSample

    rng = np.random.RandomState(0)
    out = []
    for gi, g in enumerate(reference_groups(digit_tasks("train", 8, seed=2), DigitEnv)):
        s = TrainingSample.from_rollout(g.rollouts[0], float(rng.uniform(-1, 1)), gi)
        s.logprobs = np.where(s.loss_mask > 0, rng.uniform(-6.0, -4.0, len(s.logprobs)), 0).astype(np.float32)
        # three MoE layers, top-2 of 8 experts, distinct per token
        s.routing = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)])
                              for _ in range(len(s.token_ids))]).astype(np.int16)
        out.append(s)
    return out


def _micro_batches(dp: int, dp_rank: int):
    from megatron_ext.rl.batch import micro_batches
    from megatron_ext.rl.loss import aggregation_weights

    samples = _samples()
    weights = aggregation_weights("constant", [s.loss_mask for s in samples], 16, episodes=len(samples))
    slots = [[i for i, s in enumerate(samples) if s.group_index % DP_SPLIT == d] for d in range(DP_SPLIT)]
    per_slot = [micro_batches([samples[i] for i in r], [weights[i] for i in r], 32, 1, 0, 2, 1, r, (3, 2))
                for r in slots]
    rng = np.random.RandomState(1)
    import torch

    for mbs in per_slot:
        for mb in mbs:  # a hand-made reference policy's log-probabilities
            mb["ref_logprobs"] = torch.tensor(rng.uniform(-4, -0.5, (1, mb["tokens"].numel())), dtype=torch.float32)
    # DP_SPLIT slots over `dp` ranks: rank d runs slots d, d + dp, ... back to back
    mine = [mb for slot in range(dp_rank, DP_SPLIT, dp) for mb in per_slot[slot]]
    return mine


def _worker(rank, world, port, flags, out):
    join(rank, world, port)
    import megatron_ext  # noqa: F401
    from megatron.core import parallel_state

    from megatron_ext.arguments import parse_args
    from megatron_ext.rl import forward as rl_forward
    from megatron_ext.rl.arguments import add_rl_args
    from megatron_ext.rl.loss import LossConfig
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import setup_model_and_optimizer, train_step

    args = parse_args(flags, world_size=world, extra=[add_rl_args])
    initialize_distributed(args)
    model, optimizer = setup_model_and_optimizer(args, init_fn=partial(init_layout_invariant_, seed=3))
    dp = parallel_state.get_data_parallel_world_size()
    mbs = _micro_batches(dp, parallel_state.get_data_parallel_rank())
    cfg = LossConfig(kl_beta=0.1, kl_estimator="k3", importance_sampling="tis", is_truncation_coef=1.5,
                     entropy_weight=0.01)
    step = partial(rl_forward.forward_step, cfg, float(len(mbs) * dp), routing_replay=True)
    from tests.unit.test_rl_replay import forced_routing_hooks

    hits, handles = forced_routing_hooks(model[0])
    r = train_step(step, iter(mbs), model, optimizer, args, len(mbs))
    for h in handles:
        h.remove()
    metrics = rl_forward.pop_metrics()
    metrics["forced experts"] = float(torch.cat(hits).float().mean()) if hits else -1.0
    grads = {name: float(p.main_grad.double().norm()) for name, p in model[0].named_parameters()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": r["losses"], "grad_norm": r["grad_norm"], "metrics": metrics,
                       "grads": grads}, f)
    destroy()


def _run(flags, world):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        mp.start_processes(_worker, args=(world, _free_port(), flags, out), nprocs=world, join=True,
                           start_method="spawn")
        return json.load(open(out))


@pytest.fixture(scope="module")
def reference():
    return _run(BASE, 1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rl_step_matches_one_rank(layout, reference):
    world, flags = LAYOUTS[layout]
    got = _run(BASE + flags, world)
    want = reference
    assert {"rl loss", "mtp_1 distill loss"} <= set(want["losses"])
    for name, value in want["losses"].items():
        assert math.isclose(got["losses"][name], value, rel_tol=1e-5, abs_tol=1e-9), (name, got["losses"][name], value)
    assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-5)
    assert want["grad_norm"] > 0
    for name in ("policy", "entropy", "k1", "k3", "is_corrected", "mismatch", "trainer_logprob", "mismatch_max",
                 "routing replay agreement"):
        assert math.isclose(got["metrics"][name], want["metrics"][name], rel_tol=1e-5, abs_tol=1e-9), name
    # every token of every replayed layer went to the sampler's (random) experts, on every layout's routers
    assert got["metrics"]["forced experts"] == 1.0 and want["metrics"]["forced experts"] == 1.0
    assert 0 < want["metrics"]["is_corrected"] < 1  # TIS truncates some tokens, not all
    # random replayed experts: the router's own top-2 of 8 agrees with about a quarter of them
    assert 0.05 < want["metrics"]["routing replay agreement"] < 0.6
    # parameters whole on both sides (not split by this layout) have the same gradient
    common = set(got["grads"]) & set(want["grads"])
    assert common
    same_shape = [n for n in common if "embedding" in n or "router" in n or "layernorm" in n or "norm" in n]
    for name in same_shape:
        if layout == "pp2":
            continue  # stage-local parameter names restart per stage
        assert math.isclose(got["grads"][name], want["grads"][name], rel_tol=1e-4, abs_tol=1e-10), name


def _overlap_worker(rank, world, port, flags, out):
    """Three DP2 RL steps whose micro-batch counts change (n + 1, then more, then fewer), as RL packing does."""
    join(rank, world, port)
    import megatron_ext  # noqa: F401
    from megatron.core import parallel_state

    from megatron_ext.arguments import parse_args
    from megatron_ext.rl import forward as rl_forward
    from megatron_ext.rl.arguments import add_rl_args
    from megatron_ext.rl.batch import micro_batches, rows_needed
    from megatron_ext.rl.loss import LossConfig, aggregation_weights
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import setup_model_and_optimizer, train_step

    args = parse_args(flags, world_size=world, extra=[add_rl_args])
    initialize_distributed(args)
    model, optimizer = setup_model_and_optimizer(args, init_fn=partial(init_layout_invariant_, seed=3))
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    samples = _samples()
    weights = aggregation_weights("constant", [s.loss_mask for s in samples], 16, episodes=len(samples))
    mine = [i for i in range(len(samples)) if i % dp == dp_rank]
    least = max(rows_needed([samples[i] for i in range(len(samples)) if i % dp == d], 32, 1) for d in range(dp))
    assert least + 2 <= len(mine)  # every micro-batch holds a sample (an empty one makes the MTP loss 0/0)
    steps = []
    for nmb in (least + 1, least + 2, least):
        mbs = micro_batches([samples[i] for i in mine], [weights[i] for i in mine], 32, 1, 0, nmb, 1, mine, (3, 2))
        step = partial(rl_forward.forward_step, LossConfig(), float(nmb * dp), routing_replay=True)
        r = train_step(step, iter(mbs), model, optimizer, args, nmb)
        rl_forward.pop_metrics()
        steps.append({"nmb": nmb, "grad_norm": r["grad_norm"], "loss": r["losses"]["rl loss"],
                      "grads": {name: float(p.main_grad.double().norm()) for name, p in model[0].named_parameters()}})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(steps, f)
    destroy()


@pytest.mark.slow
def test_overlap_grad_reduce_with_varying_micro_batch_counts_gives_the_same_gradients():
    """--overlap-grad-reduce: Megatron-Core's DDP reduces a bucket once its parameters' gradients are ready as
    often as in the first step, unless the schedule marks the last micro-batch (config.no_sync_func); without it a
    step with more micro-batches reduces early and drops the extra gradient, one with fewer fails."""
    def run(flags):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            mp.start_processes(_overlap_worker, args=(2, _free_port(), flags, out), nprocs=2, join=True,
                               start_method="spawn")
            return json.load(open(out))

    plain = run(BASE)
    overlap = run(BASE + ["--overlap-grad-reduce"])
    assert len({s["nmb"] for s in plain}) == 3
    for want, got in zip(plain, overlap):
        assert want["grad_norm"] > 0
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-6), (want["nmb"], got, want)
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-6)
        for name, value in want["grads"].items():
            assert math.isclose(got["grads"][name], value, rel_tol=1e-5, abs_tol=1e-12), (want["nmb"], name)
