"""Context parallelism through the MLA latent: sharding helpers, packed documents with uneven loss masks."""

import math

import pytest
import torch
import torch.multiprocessing as mp

from megatron_ext.models import context_parallel
from tests.distributed.harness import _free_port, join, run_layout


def test_local_index_is_load_balanced():
    # 16 tokens, CP 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert context_parallel.local_index((0, 16), 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_parallel.local_index((0, 16), 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # packed: every document is split on its own
    assert context_parallel.local_index((0, 4, 12), 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    held = torch.cat([context_parallel.local_index((0, 8, 24), 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="divisible by 2 x CP = 4"):
        context_parallel.local_index((0, 6), 2, 0)


def test_shift_left_one_rank_respects_documents():
    x = torch.arange(10, dtype=torch.float).view(10, 1)
    got = context_parallel.shift_left(x, 2, (0, 6, 10), dim=0).view(-1).tolist()
    assert got == [2, 3, 4, 5, 0, 0, 8, 9, 0, 0]


def _shift_worker(rank, world, port, bounds, shift, result):
    join(rank, world, port)
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    try:
        full = torch.randn(bounds[-1], 3, generator=torch.Generator().manual_seed(0))
        index = context_parallel.local_index(bounds)
        got = context_parallel.shift_left(full[index], shift, bounds, dim=0)
        want = torch.zeros_like(got)
        for row, p in enumerate(index.tolist()):  # the value `shift` ahead in p's own document, if any
            end = next(e for e in bounds[1:] if p < e)
            if p + shift < end:
                want[row] = full[p + shift]
        result[rank] = bool(torch.equal(got, want))
        gathered = context_parallel.gather_sequence(full[index], bounds)
        result[world + rank] = bool(torch.equal(gathered, full))
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world,bounds,shift", [(2, (0, 16), 1), (2, (0, 8, 24), 2),
                                                    pytest.param(4, (0, 16, 32), 1, marks=pytest.mark.slow)])
def test_shift_and_gather_across_ranks(world, bounds, shift):
    with mp.Manager() as manager:
        result = manager.dict()
        mp.start_processes(_shift_worker, args=(world, _free_port(), bounds, shift, result), nprocs=world,
                           join=True, start_method="spawn")
        assert all(result[r] for r in range(2 * world)), dict(result)


# Packed documents (lengths multiples of 2 x CP) with some tokens masked out of the loss, so the CP ranks hold
# different numbers of counted tokens: the loss must still be the whole sequence's token mean.
SEQ = 64
DOCS = [(20, 12, 32), (8, 40, 16)]


def _packed_microbatch(doc_lengths, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (1, SEQ), generator=g)
    labels = torch.randint(0, 256, (1, SEQ), generator=g)
    loss_mask = (torch.rand(1, SEQ, generator=g) > 0.3).float()
    bounds = [0]
    for n in doc_lengths:
        bounds.append(bounds[-1] + n)
    position_ids = torch.cat([torch.arange(n) for n in doc_lengths]).view(1, SEQ)
    cu = torch.full((1, 8), -1, dtype=torch.int32)
    cu[0, :len(bounds)] = torch.tensor(bounds, dtype=torch.int32)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "cu_seqlens": cu}


BASE = ["--model", "tiny", "--mock-data", "--seq-length", str(SEQ), "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-3", "--seed", "7"]


@pytest.fixture(scope="module")
def packed_batches():
    return [[_packed_microbatch(DOCS[m], seed=10 * step + m) for m in range(2)] for step in range(2)]


@pytest.mark.parametrize("world,flags", [
    (2, ["--context-parallel-size", "2"]),
    # 4 ranks on 2 cores (26 s): slow, like test_parallel_parity.py's 4-rank layouts (cp2_tp2 among them)
    pytest.param(4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
                 marks=pytest.mark.slow),
], ids=["cp2", "cp2_tp2"])
def test_packed_documents_with_masks_match_one_rank(world, flags, packed_batches):
    cp_only = "--tensor-model-parallel-size" not in flags  # then every parameter is whole on rank 0
    want = run_layout(BASE, world=1, batches=packed_batches, param_grads=cp_only)
    got = run_layout(BASE + flags, world=world, batches=packed_batches, param_grads=cp_only)
    for step, (g, w) in enumerate(zip(got, want)):
        for name in ("lm loss", "mtp_1 distill loss", "mtp_1 top1 agreement", "seq_load_balancing_loss"):
            assert math.isclose(g["losses"][name], w["losses"][name], rel_tol=1e-5), (step, name, g, w)
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=1e-5), (step, g, w)
        if cp_only:  # each parameter's gradient, not only the total norm
            assert set(g["param_grads"]) == set(w["param_grads"])
            floor = 1e-6 * w["grad_norm"]
            for name, value in w["param_grads"].items():
                assert math.isclose(g["param_grads"][name], value, rel_tol=1e-5, abs_tol=floor), (step, name)


def test_hard_label_mtp_loss_is_normalised_over_the_whole_sequence():
    """--mtp-loss ce under CP2 trains like Megatron-Core's own MTP cross-entropy on one rank (whose CP path divides
    the gradient by the CP size): the loss runs through our CP-normalised path instead."""
    flags = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
             "--seed", "7", "--mtp-loss", "ce"]
    want = run_layout(flags, world=1)
    got = run_layout(flags + ["--context-parallel-size", "2"], world=2)
    for step, (g, w) in enumerate(zip(got, want)):
        assert math.isclose(g["losses"]["lm loss"], w["losses"]["lm loss"], rel_tol=1e-5)
        assert math.isclose(g["losses"]["mtp_1 ce loss"], w["losses"]["mtp_1 loss"], rel_tol=1e-5), (step, g, w)
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=1e-5), (step, g, w)
