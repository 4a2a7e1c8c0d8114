"""The Kimi Linear hybrid (KDA heads split over TP, position-free MLA, MoE, MTP) trains at TP2+SP exactly like one
rank: same losses, gradient norm, and every parameter's gradient (KDA's per-head convolutions, A_log, dt_bias and
its replicated output-norm weight included)."""

import math

import pytest

from tests.distributed.harness import run_layout
from tests.distributed.test_parallel_parity import GRAD_RTOL, RTOL

BASE = ["--model", "tiny-kimi-linear", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--seed", "7"]


# ~80 s on a shared 2-core machine (two trainings): `make test-all` runs it.
@pytest.mark.slow
@pytest.mark.parametrize("world,flags", [(2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"])],
                         ids=["tp2_sp"])
def test_tp2_matches_single_rank(world, flags):
    want = run_layout(BASE, world=1, full_grads=True)
    got = run_layout(BASE + flags, world=world, full_grads=True)
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g["losses"]) == set(w["losses"]) and "lm loss" in w["losses"]
        for name, value in w["losses"].items():
            assert math.isclose(g["losses"][name], value, rel_tol=RTOL), (step, name, g["losses"][name], value)
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
            assert err <= GRAD_RTOL * scale, f"step {step} {key}: max |diff| {err:.3g} vs max |grad| {scale:.3g}"
