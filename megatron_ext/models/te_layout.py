"""One checkpoint layout for both backends: Transformer Engine's.

Transformer Engine fuses a norm into the linear layer that follows it (`TELayerNormColumnParallelLinear`, whose
parameters are ``weight`` and ``layer_norm_weight``): in Megatron-Core's TE spec for MLA the q and kv latent norms
live inside ``linear_q_up_proj`` / ``linear_kv_up_proj``, and a dense layer's pre-MLP norm inside
``mlp.linear_fc1`` (MoE layers keep a separate ``pre_mlp_layernorm``: the router reads the normed input too). The
local spec keeps them as separate norm modules, so a checkpoint written by one backend would not load under the
other. `FUSED_NORM_KEYS` renames the local spec's norm keys to TE's canonical names through Megatron-Core's
`sharded_state_dict_keys_map` (what its ModelOpt specs do for the same reason): every checkpoint, whatever backend
wrote it (training, tools/convert_checkpoint.py), has TE's keys, and loads under either backend.

`te_spec_on_cpu()` builds Megatron-Core's own TE specs from CPU modules with TE's parameter names, so the TE
layout can be derived and a TE-shaped model run without Transformer Engine (tests, and the inference engine's
check that it reads fused norm weights).
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.mlp import MLPSubmodules

from megatron_ext.models.local_backend import LocalBackend, ReplicatedLinear

# local spec name (prefix inside a transformer layer) -> TE spec name
MLA_FUSED_NORM_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
DENSE_FUSED_NORM_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def fused_norm_keys(moe: bool) -> dict[str, str]:
    """The `sharded_state_dict_keys_map` of a local MLA layer: dense layers also fuse their pre-MLP norm."""
    return dict(MLA_FUSED_NORM_KEYS) if moe else {**MLA_FUSED_NORM_KEYS, **DENSE_FUSED_NORM_KEYS}


def drop_absent_extra_state(sharded_model: dict, ckpt_dir: str) -> dict:
    """The model's sharded state dict without the ``_extra_state`` objects `ckpt_dir` lacks.

    TE modules carry FP8 metadata as ``_extra_state`` objects that local modules do not write (and TE's grouped
    experts name theirs differently); absent ones are left at their initial state, as Megatron-LM does when it
    loads a checkpoint from another backend. Every weight must still be present: that is checked by the caller.
    """
    objects = [v for v in sharded_model.values() if isinstance(v, ShardedObject) and v.key.endswith("_extra_state")]
    if not objects:
        return sharded_model
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    present = {v.key for v in load_sharded_metadata(ckpt_dir).values()
               if isinstance(v, ShardedObject)}
    return {k: v for k, v in sharded_model.items()
            if not (isinstance(v, ShardedObject) and v.key.endswith("_extra_state") and v.key not in present)}


# --------------------------------------------------------------------------------------------------------
# Megatron-Core's TE specs on a CPU
# --------------------------------------------------------------------------------------------------------


class NormColumnParallelLinear(ColumnParallelLinear):
    """CPU stand-in for TE's `TELayerNormColumnParallelLinear` (RMSNorm): RMSNorm with ``layer_norm_weight``, then
    the column-parallel linear; the same parameters, names and arithmetic."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        kwargs.pop("skip_weight_param_allocation", None)
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        setattr(self.layer_norm_weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, input_, *args, **kwargs):
        x = input_.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(input_.dtype)
        return super().forward(self.layer_norm_weight * x, *args, **kwargs)


def _cpu_te_backend():
    class CpuTESpecProvider(LocalBackend):
        """Megatron-Core's `TESpecProvider` answered with CPU modules that have TE's parameter names."""

        def linear(self) -> type:
            return ReplicatedLinear  # TELinear: replicated ("duplicated") on every TP rank

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return NormColumnParallelLinear

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
            # TEGroupedMLP's checkpoint keys equal SequentialMLP's (Megatron-Core maps them), so either stands in.
            from megatron.core.tensor_parallel.layers import RowParallelLinear

            return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

        def activation_func(self):
            return None

    return CpuTESpecProvider


@contextlib.contextmanager
def te_spec_on_cpu():
    """While active, Megatron-Core's TE spec functions (`get_gpt_layer_with_transformer_engine_spec`, the decoder
    and MTP block specs) build from CPU modules: the module tree, the fused-norm placement and every parameter and
    checkpoint name are the TE spec's; only the kernels differ. Build with ``--transformer-impl
    transformer_engine`` set on the args after parsing (parsing refuses it without TE)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_ext.models.norm import RMSNorm

    missing = object()
    saved = {name: getattr(gpt_layer_specs, name, missing) for name in ("TESpecProvider", "TENorm")}
    gpt_layer_specs.TESpecProvider = _cpu_te_backend()
    gpt_layer_specs.TENorm = RMSNorm
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(gpt_layer_specs, name)
            else:
                setattr(gpt_layer_specs, name, value)
