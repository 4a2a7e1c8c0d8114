"""Helpers for parity tests and benchmarks: the same model at any parallel layout.

Megatron-Core's initialisation depends on the layout (each pipeline stage draws only its own layers, each
expert-parallel rank only its experts, GLU weights are split per rank), so two layouts start from different
models. `init_layout_invariant_` instead fills every tensor from a generator keyed by its global checkpoint key:
through `sharded_state_dict` each rank knows which slice of which global tensor it holds, so it writes exactly
the values that slice has in the one-rank model.
"""

from __future__ import annotations

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
