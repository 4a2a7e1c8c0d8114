"""Megatron-Core's local modules with our substitutions, as the spec provider both spec families build from: the
local specs (models/specs.py) and the CPU stand-in for Transformer Engine's (models/te_layout.py), which subclasses
it. Kept apart from specs.py so that te_layout.py, which specs.py needs for the checkpoint layout, needs nothing
from specs.py."""

from __future__ import annotations

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear

from megatron_ext.models.attention import CoreAttention
from megatron_ext.models.norm import RMSNorm


class LocalBackend(LocalSpecProvider):
    """Megatron-Core's local modules, with our core attention and sequence-parallel RMSNorm."""

    def duplicated_linear(self) -> type:
        """For MLA's down projections: replicated on every TP rank, like TE's 'duplicated' TELinear.

        With a column-parallel down projection Megatron-Core 0.16.1 drops the other TP ranks' contributions to
        the rope key's gradient (`gather_from_tensor_model_parallel_region` backpropagates only the local
        slice, but every rank uses the full rope key for its own heads). A replicated projection keeps the
        sequence-parallel path, whose reduce-scatter sums those contributions. Megatron-Core accepts exactly
        this class there; `provider.init_replicated_linears_` gives it Megatron's initialisation.
        """
        return ReplicatedLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return RMSNorm

    def core_attention(self) -> type:
        return CoreAttention
