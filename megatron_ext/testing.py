"""Helpers for parity tests and benchmarks: the same model at any parallel layout.

Megatron-Core's initialisation depends on the layout (each pipeline stage draws only its own layers, each
expert-parallel rank only its experts, GLU weights are split per rank), so two layouts start from different
models. `init_layout_invariant_` instead fills every tensor from a generator keyed by its global checkpoint key:
through `sharded_state_dict` each rank knows which slice of which global tensor it holds, so it writes exactly
the values that slice has in the one-rank model.
"""

from __future__ import annotations

import contextlib
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
    if "conv1d" in key:
        return 0.3 * values  # KDA's short convolutions: at std 0.02 they would all but zero q, k and v
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


# --------------------------------------------------------------------------------------------------------
# Device placement on a machine without a GPU
# --------------------------------------------------------------------------------------------------------


class DevicePlacementError(RuntimeError):
    """A host tensor met a device tensor: on a GPU this op would fail (or silently copy every step)."""


class _MetaIsTheGpu(torch.overrides.TorchFunctionMode):
    """'cuda' means the meta device; any op whose tensor arguments (0-d ones aside, as in torch) lie on both the
    host and the meta device raises DevicePlacementError naming the op and the tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.utils import _pytree as pytree

        from megatron_ext import platform

        kwargs = kwargs or {}
        meta = torch.device("meta")
        if kwargs.get("device") is not None and platform.is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=meta)
        if func is torch.Tensor.cuda:
            return args[0].to(meta)
        if func is torch.Tensor.to and len(args) > 1 and platform.is_cuda_device(args[1]):
            args = (args[0], meta) + tuple(args[2:])
        if func is torch._has_compatible_shallow_copy_type:  # Module.to's query before it moves a tensor
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        kinds = {t.device.type for t in tensors if t.dim() > 0}
        if "meta" in kinds and "cpu" in kinds:
            where = ", ".join(f"{tuple(t.shape)} on {t.device.type}" for t in tensors)
            raise DevicePlacementError(f"{getattr(func, '__qualname__', func)}: host and device tensors meet "
                                       f"({where})")
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device_as_gpu():
    """Run code as if the meta device were the GPU: `platform.device()` and `torch.cuda.current_device()` say
    meta, CUDA device arguments become meta, and a host tensor meeting a device tensor raises. Build the model
    inside ``with torch.device("meta")``. Ops without meta kernels (data-dependent shapes such as the MoE
    dispatcher's `masked_select`, or reading values with `.item()`) cannot run this way."""
    from megatron_ext import platform

    saved = platform.device, torch.cuda.current_device
    platform.device = lambda: torch.device("meta")
    torch.cuda.current_device = lambda: torch.device("meta")
    try:
        with _MetaIsTheGpu():
            yield
    finally:
        platform.device, torch.cuda.current_device = saved


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
