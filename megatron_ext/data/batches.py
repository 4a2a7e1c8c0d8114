"""Which global samples a data-parallel rank takes in an iteration, and how samples become micro-batches.

Megatron consumes a global batch in rounds of micro_batch_size x dp_size samples, rank r taking slot r of each
round. Every data source here (mock tokens, indexed GPT datasets, packed SFT conversations) is addressed by global
sample index, so this one function fixes the order for all of them: a run resumed at iteration i, or resharded to
another data-parallel size, sees exactly the samples an uninterrupted run would.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch


def microbatch_indices(iteration: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                       dp_size: int) -> Iterator[range]:
    """Global sample indices of each micro-batch this rank processes in `iteration`."""
    per_round = micro_batch_size * dp_size
    first = iteration * global_batch_size
    for round_start in range(first, first + global_batch_size, per_round):
        lo = round_start + dp_rank * micro_batch_size
        yield range(lo, lo + micro_batch_size)


def microbatches(fetch: Callable[[range], dict], iteration: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Lazily fetched micro-batches: the schedule pulls one at a time, so only one is ever materialised."""
    for indices in microbatch_indices(iteration, global_batch_size, micro_batch_size, dp_rank, dp_size):
        yield fetch(indices)


def collate(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack per-sample tensors into [micro_batch, ...]; every sample of a source has the same keys and shapes."""
    return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in samples[0]}
