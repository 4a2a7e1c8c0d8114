"""Helpers for parity tests and benchmarks: the same model at any parallel layout.

Megatron-Core's initialisation depends on the layout (each pipeline stage draws only its own layers, each
expert-parallel rank only its experts, GLU weights are split per rank), so two layouts start from different
models. `init_layout_invariant_` instead fills every tensor from a generator keyed by its global checkpoint key:
through `sharded_state_dict` each rank knows which slice of which global tensor it holds, so it writes exactly
the values that slice has in the one-rank model.
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group


def _global_tensor(key: str, shape, seed: int, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(key.encode()))
    values = torch.randn(*shape, generator=g, dtype=torch.float64)
    if key.endswith("expert_bias"):
        return 0.1 * values
    if key.endswith("router.weight"):
        # A decisive router: at init, sigmoid scores of a random model crowd around 0.5, where rounding
        # differences between layouts flip near-tied top-k choices; spread-out scores make ties rare.
        return values
    if len(shape) - (1 if ".experts." in key else 0) <= 1 and "norm" in key:
        return 1.0 + 0.1 * values  # norm weights near one, but not exactly, so their gradients matter
    return std * values


@torch.no_grad()
def init_layout_invariant_(model: torch.nn.Module, seed: int = 1, std: float = 0.02):
    """Overwrite all weights of `model` (this rank's shard of it) with layout-independent values."""
    for sh in _sharded_tensors(model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))):
        if sh.key.endswith("_extra_state") or sh.data is None or not sh.data.is_floating_point():
            continue
        if "local_tokens_per_expert" in sh.key:
            continue
        full = _global_tensor(sh.key, sh.global_shape, seed, std)
        local = full[sh.global_slice()]
        sh.data.copy_(local.reshape(sh.data.shape).to(sh.data.dtype))


def _sharded_tensors(sharded_state_dict):
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensorFactory):
            yield from _sharded_tensors(item.build())
        elif isinstance(item, ShardedTensor):
            yield item


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)  # Megatron-Core DDP's reduced gradient
    return param.grad if grad is None else grad


def _gradient_view(sh: ShardedTensor, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The gradient elements matching `sh.data`, a view into one of `params` (GLU factories hand out chunks)."""
    size = sh.data.element_size()
    start = sh.data.data_ptr()
    for p in params:
        lo = p.data_ptr()
        if lo <= start < lo + p.numel() * size and sh.data.untyped_storage().data_ptr() == \
                p.untyped_storage().data_ptr():
            grad = _grad_of(p)
            if grad is None:
                return None
            if not (p.is_contiguous() and grad.is_contiguous() and grad.shape == p.shape):
                raise ValueError(f"{sh.key}: parameter and gradient must be contiguous and of the same shape")
            return grad.as_strided(sh.data.shape, sh.data.stride(), grad.storage_offset() + (start - lo) // size)
    return None


def gather_full_gradients(model: torch.nn.Module, group=None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at its full (one-rank) shape, keyed by its global checkpoint key, on every rank
    of `group` (default: the world): each rank places the main replica of its slices, one all-reduce sums them.

    Layout-free, so a run under TP/SP, EP, PP or DP can be compared tensor by tensor with a one-rank run."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    params = [p for p in model.parameters() if p.requires_grad]
    pieces, shapes = [], {}
    for sh in _sharded_tensors(model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))):
        if sh.key.endswith("_extra_state") or sh.data is None or not sh.data.is_floating_point():
            continue
        view = _gradient_view(sh, params)
        if view is None:
            continue  # a buffer, not a trained parameter
        shapes[sh.key] = tuple(sh.global_shape)
        if is_main_replica(sh.replica_id):
            pieces.append((sh, view))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    union = {}
    for d in everyone:
        union.update(d)
    keys = sorted(union)
    offsets, total = {}, 0
    for key in keys:
        offsets[key] = total
        total += math.prod(union[key])
    device = params[0].device if params else torch.device("cpu")
    flat = torch.zeros(total, dtype=torch.float64, device=device)
    for sh, view in pieces:
        full = flat[offsets[sh.key]: offsets[sh.key] + math.prod(union[sh.key])].view(union[sh.key])
        target = full[sh.global_slice()]
        target.copy_(view.detach().reshape(target.shape).to(torch.float64))
    dist.all_reduce(flat, group=group)
    return {key: flat[offsets[key]: offsets[key] + math.prod(union[key])].view(union[key]) for key in keys}
