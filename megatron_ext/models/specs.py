"""Layer specs per backend.

``transformer_engine``: Megatron-Core's own TE specs, untouched. ``local``: Megatron-Core's local modules with
substitutions that make MLA, packed sequences, sequence and context parallelism work without TE: our SDPA-based
core attention, MLA that all-gathers its KV latent under context parallelism, and an RMSNorm that marks its weight
for sequence parallelism. Both write checkpoints in TE's layout (models/te_layout.py).
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_mtp_block_spec,
    get_gpt_mtp_block_spec_for_backend,
    get_mlp_module_spec_for_backend,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_ext.models.kda import HybridSpec, hybrid_layer_spec
from megatron_ext.models.local_backend import LocalBackend
from megatron_ext.models.mla import ContextParallelMLA
from megatron_ext.models.te_layout import fused_norm_keys


def mla_layer_spec(backend: LocalSpecProvider, num_experts: int | None) -> ModuleSpec:
    """A pre-norm transformer layer with MLA (latent norms on) and a dense MLP or an MoE."""
    norm = backend.layer_norm(rms_norm=True)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=ContextParallelMLA,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=backend.column_parallel_linear(),
                    linear_q_down_proj=backend.duplicated_linear(),
                    linear_q_up_proj=backend.column_parallel_linear(),
                    linear_kv_down_proj=backend.duplicated_linear(),
                    linear_kv_up_proj=backend.column_parallel_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=backend.layer_norm(rms_norm=True, for_qk=True),
                    kv_layernorm=backend.layer_norm(rms_norm=True, for_qk=True),
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts),
            mlp_bda=get_bias_dropout_add,
            # checkpoints in Transformer Engine's layout, which fuses these norms into the next linear
            sharded_state_dict_keys_map=fused_norm_keys(moe=bool(num_experts)),
        ),
    )


def decoder_block_spec(config: TransformerConfig, transformer_impl: str, vp_stage=None,
                       hybrid: HybridSpec | None = None) -> TransformerBlockSubmodules:
    """The layers this pipeline stage builds, dense or MoE as `config.moe_layer_freq` says; with `hybrid`, KDA
    or position-free MLA attention per layer as its pattern says (Kimi Linear)."""
    block = _decoder_block_spec(config, transformer_impl, vp_stage)
    if hybrid is None:
        return block
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    block.layer_specs = [hybrid_layer_spec(spec, hybrid.pattern[offset + j], hybrid, LocalBackend())
                         for j, spec in enumerate(block.layer_specs)]
    return block


def _decoder_block_spec(config: TransformerConfig, transformer_impl: str, vp_stage=None) -> TransformerBlockSubmodules:
    if transformer_impl == "transformer_engine":
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization="RMSNorm",
                                          vp_stage=vp_stage)
    backend = LocalBackend()
    dense = mla_layer_spec(backend, None)
    moe = mla_layer_spec(backend, config.num_moe_experts) if config.num_moe_experts else dense
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):
        pattern = [1 if i % pattern == 0 else 0 for i in range(config.num_layers)]
    specs = [moe if is_moe else dense for is_moe in pattern]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset:offset + count], layer_norm=backend.layer_norm(True))


def mtp_block_spec(config: TransformerConfig, transformer_impl: str, vp_stage=None,
                   hybrid: HybridSpec | None = None):
    """MTP layers (on the last pipeline stage), each wrapping a copy of the last decoder layer's spec."""
    if not config.mtp_num_layers:
        return None
    block = decoder_block_spec_full(config, transformer_impl)
    if hybrid is not None:
        block = hybrid_layer_spec(block, hybrid.pattern[-1], hybrid, LocalBackend())
    if transformer_impl == "transformer_engine":
        return get_gpt_mtp_block_spec(config, block, use_transformer_engine=True, vp_stage=vp_stage)
    return get_gpt_mtp_block_spec_for_backend(config, block, backend=LocalBackend(), vp_stage=vp_stage)


def decoder_block_spec_full(config: TransformerConfig, transformer_impl: str) -> ModuleSpec:
    """Spec of the model's last decoder layer, whatever stage builds it (the MTP layers copy it)."""
    is_moe_last = bool(config.num_moe_experts) and (
        config.moe_layer_freq[-1] if isinstance(config.moe_layer_freq, list)
        else (config.num_layers - 1) % config.moe_layer_freq == 0)
    if transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts if is_moe_last else None,
            moe_grouped_gemm=config.moe_grouped_gemm, qk_layernorm=True, multi_latent_attention=True)
    return mla_layer_spec(LocalBackend(), config.num_moe_experts if is_moe_last else None)
