"""Layouts and memory savers from the gpu flag group train exactly like one rank without them: an uneven pipeline
split (K2.5's 61 layers need one) and full or selective activation recomputation."""

import math

import pytest

from tests.distributed.harness import run_layout

BASE = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--seed", "7"]

LAYOUTS = {
    "pp2_first3": (2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3"]),
    "recompute_full": (1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]),
    "recompute_selective": (1, ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj",
                                "moe", "layernorm", "core_attn"]),
}


@pytest.fixture(scope="module")
def reference():
    return run_layout(BASE, world=1)


# full recompute (no flag file uses it; examples/kimi-k2.5 recompute selectively) runs in `make test-all`
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n == "recompute_full" else n
                                    for n in sorted(LAYOUTS)])
def test_matches_the_plain_single_rank_run(layout, reference):
    world, flags = LAYOUTS[layout]
    result = run_layout(BASE + flags, world=world)
    assert len(result) == len(reference) == 2
    for step, (got, want) in enumerate(zip(result, reference)):
        assert set(got["losses"]) == set(want["losses"]) and "lm loss" in want["losses"]
        for name, value in want["losses"].items():
            assert math.isclose(got["losses"][name], value, rel_tol=1e-5), (step, name, got["losses"][name], value)
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-5), (step, got["grad_norm"])
