"""model_provider(args): a Megatron-Core GPTModel with MLA, MoE and the MTP block, from parsed flags."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_ext.models.gpt import ComposerGPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_ext import gpu, platform
from megatron_ext.models import attn_residuals
from megatron_ext.models.kda import HybridSpec
from megatron_ext.models.presets import ModelPreset, parameter_counts
from megatron_ext.models.local_backend import ReplicatedLinear
from megatron_ext.models.specs import decoder_block_spec, mtp_block_spec


def transformer_config(args: argparse.Namespace) -> MLATransformerConfig:
    arch: ModelPreset = args.arch
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    moe = {}
    if arch.num_experts:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_layer_freq=arch.moe_layer_pattern,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=arch.moe_shared_expert_intermediate_size,
            moe_router_topk=arch.moe_router_topk,
            moe_router_score_function=arch.moe_router_score_function,
            moe_router_enable_expert_bias=arch.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_topk_scaling_factor=arch.moe_router_topk_scaling_factor,
            moe_router_num_groups=arch.moe_router_num_groups,
            moe_router_group_topk=arch.moe_router_group_topk,
            moe_router_load_balancing_type=arch.moe_router_load_balancing_type,
            moe_aux_loss_coeff=arch.moe_aux_loss_coeff,
            moe_router_dtype="fp32",  # the HF reference routes in fp32
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=args.moe_grouped_gemm,
            moe_enable_routing_replay=getattr(args, "rl_routing_replay", False),  # RL: replay the sampler's experts
        )
    return MLATransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_head_dim,
        qk_pos_emb_head_dim=arch.qk_pos_emb_head_dim,
        v_head_dim=arch.v_head_dim,
        qk_layernorm=True,  # MLA's q and kv latent RMSNorms
        rope_type=arch.rope_type,
        rotary_base=arch.rotary_base,
        rotary_scaling_factor=arch.rotary_scaling_factor,
        original_max_position_embeddings=arch.original_max_position_embeddings,
        beta_fast=arch.beta_fast,
        beta_slow=arch.beta_slow,
        mscale=arch.mscale,
        mscale_all_dim=arch.mscale_all_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        mtp_num_layers=arch.mtp_num_layers or None,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        fp8=args.fp8_format,
        fp8_recipe=args.fp8_recipe if args.fp8_format else "delayed",
        use_cpu_initialization=platform.bridge_needed(),
        masked_softmax_fusion=False,  # our SDPA core attention (local) or TE's fused attention: no apex softmax
        persist_layer_norm=False,
        **gpu.transformer_config_kwargs(args),
        **moe,
    )


def model_provider(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True,
                   vp_stage=None, config: MLATransformerConfig | None = None) -> GPTModel:
    """The model piece this rank holds: its pipeline stage, its tensor and expert shards."""
    config = config or transformer_config(args)
    hybrid = HybridSpec.from_arch(args.arch)  # Kimi Linear: KDA / position-free MLA layers
    layer_spec = decoder_block_spec(config, args.transformer_impl, vp_stage=vp_stage, hybrid=hybrid)
    if args.arch.attention_residuals:
        layer_spec = attn_residuals.layer_specs(layer_spec)  # sublayers return their own outputs
    model = ComposerGPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.arch.untie_embeddings_and_output_weights,
        position_embedding_type="rope",  # MLA builds its own (YaRN) rotary embedding
        mtp_block_spec=mtp_block_spec(config, args.transformer_impl, vp_stage=vp_stage, hybrid=hybrid),
        vp_stage=vp_stage,
        mtp_loss=getattr(args, "mtp_loss", "ce"),
        mtp_distill_temperature=getattr(args, "mtp_distill_temperature", 1.0),
        mtp_detach_trunk=getattr(args, "mtp_detach_trunk", False),
    )
    if args.arch.attention_residuals:
        attn_residuals.install(model.decoder, args.arch.attention_residuals, args.arch.attn_res_block_size)
    to_device_(model)
    init_replicated_linears_(model, config)
    return model


def to_device_(model: torch.nn.Module):
    """Move the whole model to this process's device, as Megatron-LM's `model.cuda()` does.

    Megatron-Core 0.16.1 builds some tensors on the host whatever `use_cpu_initialization` says (the MoE router's
    weight, norms and linears of local specs, our replicated MLA down projections); without this only the
    distributed optimizer's buffers would carry them to the GPU, and a TP broadcast of a host tensor would fail
    under NCCL. A model built for its shapes only (under ``torch.device("meta")``: converters, planners) is left
    where it is."""
    if any(t.is_meta for t in model.parameters()) and platform.device().type != "meta":
        return model
    return model.to(platform.device())


@torch.no_grad()
def init_replicated_linears_(model: torch.nn.Module, config: MLATransformerConfig):
    """Megatron's init for the TP-replicated MLA down projections (their class keeps torch's default init),
    broadcast so every tensor-parallel rank holds the same copy."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for module in model.modules():
        if type(module) is ReplicatedLinear:
            config.init_method(module.weight)
            if tp_group.size() > 1:
                torch.distributed.broadcast(module.weight, src=torch.distributed.get_global_rank(tp_group, 0),
                                            group=tp_group)


def print_parameter_counts(args: argparse.Namespace, print_fn=print):
    """The two start-up lines, computed from the configuration (no allocation, works for the 1T model)."""
    arch = args.arch.replace(vocab_size=args.padded_vocab_size)
    total, active = parameter_counts(arch)
    print_fn(f"total parameters: {total}")
    print_fn(f"active parameters per token: {active}")
    # the input embedding is a table lookup, not compute; model cards often quote "active" without it (Kimi
    # Linear's "A3B")
    print_fn(f"active parameters per token without the input embedding: {active - arch.vocab_size * arch.hidden_size}")
    return total, active
