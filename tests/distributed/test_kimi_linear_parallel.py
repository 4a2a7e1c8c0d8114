"""The Kimi Linear hybrid (KDA heads split over TP, position-free MLA, MoE, MTP) at TP2+SP equals one rank: in
training the same losses, gradient norm, and every parameter's gradient (KDA's per-head convolutions, A_log,
dt_bias and its replicated output-norm weight included); in generation the same tokens and log-probabilities."""

import json
import math
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.harness import _free_port, invariant_model, join, run_layout
from tests.distributed.test_parallel_parity import CP_LOGGED_MTP_CE_RTOL, GRAD_RTOL, RTOL

BASE = ["--model", "tiny-kimi-linear", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--seed", "7"]


# Under CP every rank runs the whole KDA recurrence from gathered inputs and the gradients of those inputs are the
# sum of every rank's partial ones (the gather's reduce-scatter): a different summation order than one rank.
# Measured after one optimizer step: 1.1e-4 of the largest entry on A_log (a tensor of 4 small gradients); a
# missing or doubled reduction is O(1).
CP_GRAD_RTOL = 5e-4
# The router's weight gradient is a sum of cancelling per-token terms (it ends ~1e-5, far below its terms), and under
# TP2+SP it is reduced in another order than on one rank: measured 1.02e-4 of its largest entry (1.49e-9 of 1.47e-5);
# a missing or doubled reduction is O(1).
ROUTER_GRAD_RTOL = 5e-4


@pytest.fixture(scope="module")
def reference():
    return run_layout(BASE, world=1, full_grads=True)


# ~80 s each on a shared 2-core machine (two trainings): `make test-all` runs them. PP2 checks that each stage
# builds its own slice of --hybrid-layer-pattern (KK | KM, the MTP layer on the last stage).
@pytest.mark.slow
@pytest.mark.parametrize("world,flags", [(2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
                                         (2, ["--pipeline-model-parallel-size", "2"]),
                                         (2, ["--context-parallel-size", "2"])], ids=["tp2_sp", "pp2", "cp2"])
def test_layout_matches_single_rank(world, flags, reference):
    want = reference
    cp = "--context-parallel-size" in flags
    got = run_layout(BASE + flags, world=world, full_grads=True)
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g["losses"]) == set(w["losses"]) and "lm loss" in w["losses"]
        for name, value in w["losses"].items():
            # Megatron-Core's logged MTP cross-entropy averages per-CP-rank token means (test_parallel_parity)
            rtol = CP_LOGGED_MTP_CE_RTOL if cp and name == "mtp_1 loss" else RTOL
            assert math.isclose(g["losses"][name], value, rel_tol=rtol), (step, name, g["losses"][name], value)
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=RTOL)
        ref, ours = w["full_grads"], g["full_grads"]
        assert set(ours) == set(ref)
        kda_keys = [k for k in ref if ".self_attention." in k and ("conv1d" in k or "A_log" in k or "dt_bias" in k
                                                                   or "o_norm" in k or "f_a_proj" in k)]
        assert len(kda_keys) == 3 * 7  # three KDA layers: 3 convs, A_log, dt_bias, o_norm, f_a
        for key, r in ref.items():
            scale = float(r.abs().max())
            assert scale > 0, f"step {step} {key}: no gradient in the one-rank run"
            err = float((ours[key] - r).abs().max())
            rtol = CP_GRAD_RTOL if cp else ROUTER_GRAD_RTOL if key.endswith("router.weight") else GRAD_RTOL
            assert err <= rtol * scale, \
                f"step {step} {key}: max |diff| {err:.3g} vs max |grad| {scale:.3g}"


PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 97], [93, 238, 46, 264, 338]]


def _generate_worker(rank: int, world: int, port: int, flags: list[str], out_dir: str):
    join(rank, world, port)
    from megatron_ext.inference.engine import InferenceEngine, SamplingParams
    from megatron_ext.training.initialize import destroy

    _, model = invariant_model(flags, world, seed=2)
    engine = InferenceEngine(model.eval())
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    groups = [c for g in engine.generate_groups(PROMPTS[1:], 2, SamplingParams(max_tokens=6, seed=6)) for c in g]
    forced = engine.forward(torch.tensor([PROMPTS[0]]), torch.arange(6).unsqueeze(0),
                            engine.new_cache(len(engine.layers), 1, 8), torch.tensor([0]))[0]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ids": [c.token_ids for c in greedy + groups], "logprobs": [c.logprobs for c in greedy + groups],
                   "forced": forced.tolist()}, f)
    destroy()


def _generate(flags, world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_generate_worker, args=(world, _free_port(), flags, tmp), nprocs=world, join=True,
                           start_method="spawn")
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def test_tp2_generation_matches_one_rank():
    """The engine's KDA step on this rank's heads (partial output projection summed over TP) = one rank."""
    flags = ["--model", "tiny-kimi-linear", "--mock-data", "--seed", "5"]
    want = _generate(flags, 1)[0]
    ranks = _generate(flags + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2)
    assert ranks[0] == ranks[1]
    assert ranks[0]["ids"] == want["ids"]
    for got, ref in zip(ranks[0]["logprobs"], want["logprobs"]):
        assert got == pytest.approx(ref, abs=1e-5)
    torch.testing.assert_close(torch.tensor(ranks[0]["forced"]), torch.tensor(want["forced"]), rtol=1e-5, atol=1e-5)
