"""A checkpoint saved under one parallel layout loads under others and training continues identically.

Resharding optimizer state across TP/PP/EP is the explicit choice --dist-ckpt-optim-fully-reshardable; the
default (Megatron-LM's dp_reshardable, fully parallel save) round-trips, reshards across DP, and refuses other
layout changes by name."""

import math

import pytest

from tests.distributed.harness import run_entry
from tests.tb import scalars

BASE = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--seq-length", "32", "--use-distributed-optimizer", "--lr-decay-style", "constant"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    save = str(root / "ckpt")
    run_entry(BASE + TP2 + ["--train-iters", "2", "--save", save, "--dist-ckpt-optim-fully-reshardable"], world=2)
    ref_tb = str(root / "tb_tp2")
    run_entry(BASE + TP2 + ["--train-iters", "3", "--load", save, "--tensorboard-dir", ref_tb], world=2)
    return save, scalars(ref_tb), root


@pytest.mark.parametrize("name, flags", [
    ("tp1_dp2", []),
    pytest.param("pp2", ["--pipeline-model-parallel-size", "2"], marks=pytest.mark.slow),
    # EP 1 -> 2 changes how Megatron-Core chains optimizers; weights reshard, optimizer state cannot (the loss
    # and gradient norm of the next step are computed before the update, so they still must match)
    pytest.param("ep2_weights", ["--expert-model-parallel-size", "2", "--no-load-optim"], marks=pytest.mark.slow),
])
def test_tp2_checkpoint_continues_under(name, flags, saved):
    save, ref, root = saved
    tb = str(root / f"tb_{name}")
    run_entry(BASE + flags + ["--train-iters", "3", "--load", save, "--tensorboard-dir", tb], world=2)
    got = scalars(tb)
    assert sorted(got["lm loss"]) == [3]
    for tag in ("lm loss", "mtp_1 loss", "seq_load_balancing_loss", "grad-norm"):
        assert math.isclose(got[tag][3], ref[tag][3], rel_tol=1e-5), (tag, got[tag][3], ref[tag][3])


def test_optimizer_structure_change_is_refused_clearly(saved):
    save, _, _ = saved
    with pytest.raises(Exception, match="cannot map optimizer state between EP = 1 and EP > 1"):
        run_entry(BASE + ["--expert-model-parallel-size", "2", "--train-iters", "3", "--load", save], world=2)


@pytest.fixture(scope="module")
def saved_default(tmp_path_factory):
    """DP2, default format: 2 iterations saved; the same 3 iterations uninterrupted as the reference."""
    root = tmp_path_factory.mktemp("dp_reshardable")
    save = str(root / "ckpt")
    run_entry(BASE + ["--train-iters", "3", "--exit-interval", "2", "--save", save, "--ckpt-fully-parallel-load"],
              world=2)
    ref_tb = str(root / "tb_ref")
    run_entry(BASE + ["--train-iters", "3", "--tensorboard-dir", ref_tb], world=2)
    return save, scalars(ref_tb), root


@pytest.mark.parametrize("name, world, flags", [
    ("round_trip", 2, ["--ckpt-fully-parallel-load"]),
    ("dp1", 1, []),  # dp_reshardable: the data-parallel size may change
])
def test_default_format_continues_identically(name, world, flags, saved_default):
    from megatron.core import dist_checkpointing

    save, ref, root = saved_default
    common = dist_checkpointing.load_common_state_dict(f"{save}/iter_0000002")
    assert common["optim_sharding_type"] == "dp_reshardable"
    tb = str(root / f"tb_{name}")
    run_entry(BASE + flags + ["--train-iters", "3", "--load", save, "--tensorboard-dir", tb], world=world)
    got = scalars(tb)
    assert sorted(got["lm loss"]) == [3]
    for tag in ("lm loss", "grad-norm"):
        assert math.isclose(got[tag][3], ref[tag][3], rel_tol=1e-5), (tag, got[tag][3], ref[tag][3])


def test_default_format_refuses_a_tensor_parallel_change_naming_the_fix(saved_default):
    save, _, _ = saved_default
    with pytest.raises(Exception, match="only the data-parallel size may change.*--dist-ckpt-optim-fully-reshardable"):
        run_entry(BASE + TP2 + ["--train-iters", "3", "--load", save], world=2)
