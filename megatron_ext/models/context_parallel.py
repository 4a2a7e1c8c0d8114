"""Context parallelism for MLA without Transformer Engine: sequence sharding, latent all-gather, shifts.

The sequence (or, packed, every document) is cut into 2 x CP chunks; rank r holds chunks r and 2CP-1-r, so causal
attention costs every rank the same (Megatron-Core's `get_batch_on_this_cp_rank` convention, also used by its
rotary embeddings and MTP shifts). Attention needs the keys and values of the whole sequence: MLA derives them
from a per-token latent of kv_lora_rank + rope dims (576 numbers for K2.5, against 64 heads x 320 for full K/V), so
the latent is all-gathered over the CP group and up-projected locally. The gather's backward is a
reduce-scatter: every rank's queries contribute to every token's latent gradient.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def cp_size() -> int:
    return parallel_state.get_context_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1


def cp_rank() -> int:
    return parallel_state.get_context_parallel_rank()


def document_bounds(total: int, packed_seq_params: Optional[PackedSeqParams]) -> tuple[int, ...]:
    """Global boundaries [0, ..., total] of the sequences whose chunks are spread over CP ranks."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return (0, total)
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    return tuple(int(x) for x in cu.tolist())


@lru_cache(maxsize=64)
def _local_index(bounds: tuple[int, ...], size: int, rank: int) -> torch.Tensor:
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * size):
            raise ValueError(f"context parallelism {size} needs every sequence length divisible by 2 x CP = "
                             f"{2 * size}; got a sequence of {length} tokens (pad documents to a multiple)")
        c = length // (2 * size)
        pieces.append(torch.arange(start + rank * c, start + (rank + 1) * c))
        pieces.append(torch.arange(start + (2 * size - 1 - rank) * c, start + (2 * size - rank) * c))
    return torch.cat(pieces)


def local_index(bounds: Sequence[int], size: int | None = None, rank: int | None = None) -> torch.Tensor:
    """Global positions of this rank's tokens, in the order the rank holds them (front chunk, back chunk)."""
    size = cp_size() if size is None else size
    rank = cp_rank() if rank is None else rank
    return _local_index(tuple(bounds), size, rank)


@lru_cache(maxsize=64)
def _gather_order(bounds: tuple[int, ...], size: int) -> torch.Tensor:
    held = torch.cat([_local_index(bounds, size, r) for r in range(size)])
    return torch.argsort(held)


def shard_batch(batch: dict, packed_seq_params: Optional[PackedSeqParams] = None) -> dict:
    """This CP rank's tokens of every [b, s] tensor of a micro-batch (packed: every document's chunks).

    Packed sequence parameters keep their global ``cu_seqlens``: Megatron-Core's rotary embeddings and MTP shifts
    read them that way under CP."""
    if cp_size() == 1:
        return batch
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() == 2:
            index = local_index(document_bounds(value.size(1), packed_seq_params)).to(value.device)
            value = value.index_select(1, index)
        out[key] = value
    return out


def gather_sequence(x: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """All-gather [s_local, ...] over the CP group into the global order [s, ...]; backward reduce-scatters."""
    group = parallel_state.get_context_parallel_group()
    gathered = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    order = _gather_order(tuple(bounds), dist.get_world_size(group)).to(x.device)
    return gathered.index_select(0, order)


def shift_left(x: torch.Tensor, shift: int, bounds: Sequence[int], dim: int = 0) -> torch.Tensor:
    """x at global position t + shift for each of this rank's positions t along `dim`; zero where t + shift
    leaves its sequence (or packed document).

    Under CP a target may sit in the next chunk, held by another rank; only the first `shift` positions of every
    chunk are exchanged (an all-gather of 2 x documents x shift positions), never the whole tensor, since x may be
    vocabulary-sized (the MTP distillation targets)."""
    size = cp_size()
    bounds = tuple(int(b) for b in bounds)
    index = local_index(bounds, size) if size > 1 else torch.arange(bounds[-1])
    where = torch.full((bounds[-1],), -1, dtype=torch.long)
    extended = x
    if size > 1:
        heads = _chunk_heads(bounds, size, shift)  # local offsets, the same on every rank
        moved = x.movedim(dim, 0).index_select(0, heads.to(x.device)).contiguous()
        parts = [torch.empty_like(moved) for _ in range(size)]
        dist.all_gather(parts, moved, group=parallel_state.get_context_parallel_group())
        for r in range(size):
            where[_local_index(bounds, size, r)[heads]] = index.numel() + r * heads.numel() + \
                torch.arange(heads.numel())
        extended = torch.cat([x, torch.cat(parts).movedim(0, dim)], dim=dim)
    where[index] = torch.arange(index.numel())
    ends = torch.tensor(bounds[1:])
    target = index + shift
    valid = target < ends[torch.searchsorted(ends, index, right=True)]
    rows = where[target.clamp(max=bounds[-1] - 1)]
    if bool((rows[valid] < 0).any()):
        raise ValueError(f"shift {shift} reaches past the next context-parallel chunk; chunks must be at least "
                         f"{shift} tokens (sequence length / (2 x CP))")
    picked = extended.index_select(dim, rows.clamp(min=0).to(x.device))
    shape = [1] * x.dim()
    shape[dim] = -1
    return picked * valid.to(x.device).view(shape).to(picked.dtype)


@lru_cache(maxsize=64)
def _chunk_heads(bounds: tuple[int, ...], size: int, shift: int) -> torch.Tensor:
    """Local offsets of the first `shift` positions of each chunk a rank holds."""
    heads, offset = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        c = (end - start) // (2 * size)
        for _ in range(2):
            heads.append(torch.arange(offset, offset + min(shift, c)))
            offset += c
    return torch.cat(heads)
