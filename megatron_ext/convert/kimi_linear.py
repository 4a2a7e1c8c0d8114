"""Hugging Face ``kimi_linear`` checkpoints (Kimi-Linear-48B-A3B): config and tensor names.

The release layout (what `transformers` also writes back on save): KDA attention under ``self_attn.`` with the
short convolutions as ``{q,k,v}_conv1d.weight`` [channels, 1, K] and ``A_log`` [1, 1, heads, 1] (our module keeps
those shapes, so conversion only renames); MLA attention as DeepSeek-V3's without positional encoding; MoE
layers under ``block_sparse_moe.`` with experts as ``w1`` (gate), ``w3`` (up), ``w2`` (down); dense layers under
``mlp.`` (transformers saves them as ``block_sparse_moe.`` too; both import, export writes ``mlp.``).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from megatron_ext.convert.common import ConversionError, backbone_fields
from megatron_ext.models.presets import ModelPreset, parse_layer_pattern

MODEL_TYPE = "kimi_linear"
_SPECIAL_IDS = {"bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839}

# Megatron name inside a KDA layer's attention -> HF name inside ``self_attn.``
_KDA = {f"{p}.weight": f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "g_a_proj",
                                               "g_b_proj", "b_proj", "o_proj")}
_KDA.update({"q_conv1d": "q_conv1d.weight", "k_conv1d": "k_conv1d.weight", "v_conv1d": "v_conv1d.weight",
             "A_log": "A_log", "dt_bias": "dt_bias", "o_norm_weight": "o_norm.weight"})
_MOE = {
    "mlp.router.weight": ["block_sparse_moe.gate.weight"],
    "mlp.router.expert_bias": ["block_sparse_moe.gate.e_score_correction_bias"],
    "mlp.shared_experts.linear_fc1.weight": ["block_sparse_moe.shared_experts.gate_proj.weight",
                                             "block_sparse_moe.shared_experts.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["block_sparse_moe.shared_experts.down_proj.weight"],
}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
DENSE_IN_MOE_NAMES = re.compile(r"layers\.\d+\.block_sparse_moe\.gate_proj\.weight$")


def layer_names(prefix: str, rest: str, dense_prefix: str) -> Optional[list[str]]:
    """HF names for Megatron `rest` inside a decoder layer, or None where the DeepSeek-V3 names apply (MLA, norms)."""
    if rest.startswith("self_attention."):
        own = _KDA.get(rest[len("self_attention."):])
        if own is not None:
            return [f"{prefix}self_attn.{own}"]
        return None
    if rest in _MOE:
        return [prefix + n for n in _MOE[rest]]
    m = _EXPERT.fullmatch(rest)
    if m:
        e = f"{prefix}block_sparse_moe.experts.{m.group(1)}."
        return [e + "w1.weight", e + "w3.weight"] if m.group(2) == "1" else [e + "w2.weight"]
    if rest == "mlp.linear_fc1.weight":
        return [f"{prefix}{dense_prefix}gate_proj.weight", f"{prefix}{dense_prefix}up_proj.weight"]
    if rest == "mlp.linear_fc2.weight":
        return [f"{prefix}{dense_prefix}down_proj.weight"]
    return None


def is_kimi_linear(p: ModelPreset) -> bool:
    return bool(p.hybrid_layer_pattern) or p.mla_nope


def _first(text: dict, *keys, default=None):
    for k in keys:
        if text.get(k) is not None:
            return text[k]
    return default


def layer_pattern(text: dict, source: str) -> str:
    """'K'/'M' per layer from ``linear_attn_config`` (1-indexed kda_layers / full_attn_layers, the release
    format) or ``layer_types`` (transformers)."""
    n = text["num_hidden_layers"]
    linear = text.get("linear_attn_config") or {}
    if "kda_layers" in linear or "full_attn_layers" in linear:
        kinds = ["?"] * n
        for i in linear.get("kda_layers", []):
            kinds[i - 1] = "K"
        for i in linear.get("full_attn_layers", []):
            kinds[i - 1] = "M"
    elif text.get("layer_types"):
        kinds = ["K" if t == "linear_attention" else "M" if t == "full_attention" else "?"
                 for t in text["layer_types"]]
    else:  # transformers' default
        kinds = ["M" if i and i % 4 == 0 else "K" for i in range(n)]
    if "?" in kinds or len(kinds) != n:
        raise ValueError(f"{source}: linear_attn_config / layer_types do not give every one of the {n} layers a "
                         "kind (kda or full attention)")
    return parse_layer_pattern("".join(kinds), n)


def preset_from_config(text: dict, source: str = "config.json") -> ModelPreset:
    """The Megatron architecture of a kimi_linear config.json; refuses what Megatron cannot express."""
    def need(cond, msg):
        if not cond:
            raise ConversionError(f"{source}: {msg}")

    need(text.get("hidden_act", "silu") == "silu", f"hidden_act {text.get('hidden_act')!r}: only silu (SwiGLU)")
    need(not text.get("attention_bias", False), "attention_bias=true is not supported")
    need(_first(text, "moe_router_activation_func", default="sigmoid") == "sigmoid",
         "only sigmoid router scores are supported")
    need(text.get("moe_layer_freq", 1) == 1, "moe_layer_freq != 1 is not supported")
    experts = _first(text, "num_experts", "num_local_experts")
    topk = _first(text, "num_experts_per_token", "num_experts_per_tok", default=1)
    if experts and topk > 1:
        need(_first(text, "moe_renormalize", "norm_topk_prob", default=True),
             "moe_renormalize=false: Megatron renormalises sigmoid top-k weights")
    groups, group_topk = _first(text, "num_expert_group", "n_group", default=1), _first(text, "topk_group", default=1)
    if experts and groups > 1:
        need(topk // group_topk == 2, f"group-limited routing with {topk} experts per token / topk_group "
                                      f"{group_topk} != 2 ranks groups differently in Megatron-Core")
    linear = text.get("linear_attn_config") or {}
    heads = _first(linear, "num_heads", default=_first(text, "linear_num_heads", default=32))
    head_dim = _first(linear, "head_dim", default=_first(text, "linear_head_dim", default=128))
    conv = _first(linear, "short_conv_kernel_size", default=_first(text, "linear_conv_kernel_dim", default=4))
    try:
        pattern = layer_pattern(text, source)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    n = text["num_hidden_layers"]
    mlp_types = text.get("mlp_layer_types")
    if experts and mlp_types:
        first_dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), n)
        need(all(t == "sparse" for t in mlp_types[first_dense:]),
             "mlp_layer_types: dense layers must come first (Megatron's first_k_dense)")
    else:
        first_dense = _first(text, "first_k_dense_replace", default=1) if experts else n
    shared = (_first(text, "num_shared_experts", "n_shared_experts", default=0) or 0) * \
        (text.get("moe_intermediate_size") or 0)
    max_pos = _first(text, "model_max_length", "max_position_embeddings", default=4096)
    return ModelPreset(
        **backbone_fields(text),
        num_experts=experts or None,
        moe_router_topk=topk,
        moe_ffn_hidden_size=text.get("moe_intermediate_size") or text["intermediate_size"],
        moe_shared_expert_intermediate_size=shared or None,
        first_k_dense=first_dense,
        moe_router_topk_scaling_factor=text.get("routed_scaling_factor", 1.0),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_enable_expert_bias=bool(experts),
        rotary_base=float(text.get("rope_theta", 10000.0)),
        rope_type="rope",
        max_position_embeddings=max_pos,
        norm_epsilon=text.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not text.get("tie_word_embeddings", False),
        mtp_num_layers=0,
        seq_length=min(4096, max_pos),
        hybrid_layer_pattern=pattern,
        kda_num_heads=heads,
        kda_head_dim=head_dim,
        kda_conv_kernel=conv,
        mla_nope=True,  # Kimi Linear's MLA has no positional encoding (mla_use_nope)
    )


def config_from_preset(p: ModelPreset, dtype: torch.dtype) -> dict:
    """config.json in the release format, which `transformers`' KimiLinearForCausalLM also reads."""
    shared = p.moe_shared_expert_intermediate_size or 0
    pattern = p.hybrid_layer_pattern or "M" * p.num_layers
    # the release's special ids where the vocabulary has them (transformers' defaults would be out of range)
    special = {k: (v if v < p.vocab_size else None) for k, v in _SPECIAL_IDS.items()}
    return {**special,
        "architectures": ["KimiLinearForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": p.vocab_size, "hidden_size": p.hidden_size, "intermediate_size": p.ffn_hidden_size,
        "moe_intermediate_size": p.moe_ffn_hidden_size, "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_attention_heads, "num_key_value_heads": p.num_attention_heads,
        "q_lora_rank": p.q_lora_rank, "kv_lora_rank": p.kv_lora_rank, "qk_nope_head_dim": p.qk_head_dim,
        "qk_rope_head_dim": p.qk_pos_emb_head_dim, "v_head_dim": p.v_head_dim, "mla_use_nope": True,
        "num_experts": p.num_experts or 0, "num_experts_per_token": p.moe_router_topk,
        "num_shared_experts": shared // p.moe_ffn_hidden_size if p.num_experts else 0,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": p.moe_router_topk_scaling_factor,
        "num_expert_group": p.moe_router_num_groups or 1, "topk_group": p.moe_router_group_topk or 1,
        "first_k_dense_replace": p.first_k_dense if p.num_experts else p.num_layers, "moe_layer_freq": 1,
        "hidden_act": "silu", "rms_norm_eps": p.norm_epsilon, "rope_theta": p.rotary_base,
        "model_max_length": p.max_position_embeddings, "attention_bias": False,
        "tie_word_embeddings": not p.untie_embeddings_and_output_weights,
        "linear_attn_config": {
            "head_dim": p.kda_head_dim, "num_heads": p.kda_num_heads, "short_conv_kernel_size": p.kda_conv_kernel,
            "kda_layers": [i + 1 for i, k in enumerate(pattern) if k == "K"],
            "full_attn_layers": [i + 1 for i, k in enumerate(pattern) if k == "M"],
        },
        "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", ""),
    }
