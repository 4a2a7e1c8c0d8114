"""Synthetic token data for smoke tests and parity checks.

Each sample is a function of (seed, global sample index) alone, so every rank can build exactly the samples it
needs without communication and any parallel layout sees the same global batch. Samples are arithmetic
progressions modulo the vocabulary with a random start and stride: learnable (loss falls quickly), not trivial.
"""

from __future__ import annotations

import torch

from megatron_ext.data.batches import microbatches


def mock_sample(index: int, seq_length: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(0, vocab_size, (1,), generator=g))
    stride = int(torch.randint(1, 17, (1,), generator=g))
    return (start + stride * torch.arange(seq_length + 1)) % vocab_size


def mock_batch(indices, seq_length: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    seqs = torch.stack([mock_sample(i, seq_length, vocab_size, seed) for i in indices])
    b = seqs.size(0)
    return {
        "tokens": seqs[:, :-1].contiguous(),
        "labels": seqs[:, 1:].contiguous(),
        "loss_mask": torch.ones(b, seq_length, dtype=torch.float),
        "position_ids": torch.arange(seq_length).unsqueeze(0).expand(b, -1).contiguous(),
    }


def mock_microbatches(iteration: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                      dp_size: int, seq_length: int, vocab_size: int, seed: int):
    """The micro-batches this data-parallel rank processes in `iteration`, in Megatron's sample order
    (data/batches.py)."""
    return microbatches(lambda indices: mock_batch(indices, seq_length, vocab_size, seed), iteration,
                        global_batch_size, micro_batch_size, dp_rank, dp_size)
