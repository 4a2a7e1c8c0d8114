"""Named architectures as data.

A preset fixes the architecture; command-line flags override single fields (`arguments.py` maps every field to
a Megatron-LM-named flag). `parameter_counts` computes total and per-token active parameters from a preset
alone, so the real 1T model can be sized on a laptop without allocating anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


# Architecture flags: flag name -> (preset field, type, help). Defaults come from the preset. arguments.py builds the
# command line from these; checkpointing names them when a checkpoint's architecture differs from the run's.
ARCH_FLAGS = {
    "--num-layers": ("num_layers", int, "number of transformer layers"),
    "--hidden-size": ("hidden_size", int, "model width"),
    "--ffn-hidden-size": ("ffn_hidden_size", int, "hidden size of the dense MLP layers"),
    "--num-attention-heads": ("num_attention_heads", int, "attention heads"),
    "--vocab-size": ("vocab_size", int, "vocabulary size before padding (a tokenizer sets it later)"),
    "--q-lora-rank": ("q_lora_rank", int, "MLA query latent rank (0: no query compression)"),
    "--kv-lora-rank": ("kv_lora_rank", int, "MLA key/value latent rank"),
    "--qk-head-dim": ("qk_head_dim", int, "MLA per-head query/key dim without position part"),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", int, "MLA per-head rotary query/key dim"),
    "--v-head-dim": ("v_head_dim", int, "MLA per-head value dim"),
    "--num-experts": ("num_experts", int, "routed experts per MoE layer (0: dense model)"),
    "--moe-router-topk": ("moe_router_topk", int, "experts each token is routed to"),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", int, "hidden size of each routed expert"),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", int,
                                              "hidden size of the shared expert (0: none)"),
    "--first-k-dense-replace": ("first_k_dense", int, "the first k layers use a dense MLP instead of MoE"),
    "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", float,
                                         "scale of the renormalised top-k routing weights"),
    "--moe-router-num-groups": ("moe_router_num_groups", int, "expert groups for group-limited routing"),
    "--moe-router-group-topk": ("moe_router_group_topk", int, "groups each token may use"),
    "--moe-router-score-function": ("moe_router_score_function", str, "softmax or sigmoid"),
    "--moe-router-load-balancing-type": ("moe_router_load_balancing_type", str,
                                         "aux_loss, seq_aux_loss, global_aux_loss or none"),
    "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", float, "weight of the load-balancing loss"),
    "--rotary-base": ("rotary_base", float, "RoPE theta"),
    "--position-embedding-type": ("rope_type", str, "rope or yarn"),
    "--rotary-scaling-factor": ("rotary_scaling_factor", float, "YaRN context extension factor"),
    "--original-max-position-embeddings": ("original_max_position_embeddings", int,
                                           "context length the rotary frequencies were trained for"),
    "--beta-fast": ("beta_fast", float, "YaRN beta_fast"),
    "--beta-slow": ("beta_slow", float, "YaRN beta_slow"),
    "--mscale": ("mscale", float, "YaRN mscale"),
    "--mscale-all-dim": ("mscale_all_dim", float, "YaRN mscale_all_dim (also scales the softmax)"),
    "--max-position-embeddings": ("max_position_embeddings", int, "longest supported sequence"),
    "--norm-epsilon": ("norm_epsilon", float, "RMSNorm epsilon"),
    "--mtp-num-layers": ("mtp_num_layers", int, "multi-token-prediction layers (0: none)"),
    "--seq-length": ("seq_length", int, "training sequence length"),
    # Kimi Linear hybrid (models/kda.py)
    "--hybrid-layer-pattern": ("hybrid_layer_pattern", str,
                               "layer kinds, one per layer: K (Kimi Delta Attention) or M (MLA), e.g. KKKMKKKM or "
                               "'KDA KDA KDA MLA'"),
    "--kda-num-heads": ("kda_num_heads", int, "Kimi Delta Attention heads"),
    "--kda-head-dim": ("kda_head_dim", int, "Kimi Delta Attention head dim (keys and values)"),
    "--kda-conv-kernel-size": ("kda_conv_kernel", int, "width of KDA's short causal convolutions"),
    "--attention-residuals": ("attention_residuals", str,
                              "Attention Residuals: each layer's input is a learned softmax mixture of the embedding "
                              "and earlier layer outputs (full) or block sums (block); none: plain residuals"),
    "--attn-res-block-size": ("attn_res_block_size", int,
                              "--attention-residuals block: sublayers per block, attention and MLP counting one "
                              "each (0: about 8 blocks)"),
}
# Boolean fields, set by --FLAG / --no-FLAG.
ARCH_SWITCHES = {"moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
                 "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
                 "mla_nope": "--mla-nope"}


def field_flag(field: str) -> str:
    """The flag that sets a ModelPreset field."""
    for flag, (name, _, _) in ARCH_FLAGS.items():
        if name == field:
            return flag
    return ARCH_SWITCHES[field]


@dataclass(frozen=True)
class ModelPreset:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int  # dense layers
    num_attention_heads: int
    vocab_size: int
    # MLA
    q_lora_rank: Optional[int]  # None: plain q projection (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_head_dim: int  # the "nope" part
    qk_pos_emb_head_dim: int  # the rope part
    v_head_dim: int
    # MoE
    num_experts: Optional[int]
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_shared_expert_intermediate_size: Optional[int]
    first_k_dense: int  # the first k layers use a dense MLP
    moe_router_topk_scaling_factor: float
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 1e-4
    # positions
    rotary_base: float = 10000.0
    rope_type: str = "yarn"
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    max_position_embeddings: int = 4096
    # norms and the rest
    norm_epsilon: float = 1e-6
    untie_embeddings_and_output_weights: bool = True
    mtp_num_layers: int = 0
    seq_length: int = 4096
    # Kimi Linear hybrid (models/kda.py): 'K' (Kimi Delta Attention) or 'M' (MLA) per layer; None: all MLA
    hybrid_layer_pattern: Optional[str] = None
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_kernel: int = 4
    mla_nope: bool = False  # MLA layers without positional encoding
    # Attention Residuals (models/attn_residuals.py): None, "full" or "block"; block size in sublayers (0: ~8 blocks)
    attention_residuals: Optional[str] = None
    attn_res_block_size: int = 0

    def replace(self, **changes) -> "ModelPreset":
        return dataclasses.replace(self, **changes)

    @property
    def moe_layer_pattern(self) -> list[int]:
        if not self.num_experts:
            return [0] * self.num_layers
        return [0] * self.first_k_dense + [1] * (self.num_layers - self.first_k_dense)


KIMI_K2_5 = ModelPreset(
    num_layers=61,
    hidden_size=7168,
    ffn_hidden_size=18432,
    num_attention_heads=64,
    vocab_size=163840,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    num_experts=384,
    moe_router_topk=8,
    moe_ffn_hidden_size=2048,
    moe_shared_expert_intermediate_size=2048,
    first_k_dense=1,
    moe_router_topk_scaling_factor=2.827,
    moe_router_num_groups=1,
    moe_router_group_topk=1,
    rotary_base=50000.0,
    rotary_scaling_factor=64.0,
    original_max_position_embeddings=4096,
    # Copies of the K2 config disagree on beta_fast (1 vs 32); K2's own config.json says 1. --beta-fast overrides.
    beta_fast=1.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
    max_position_embeddings=262144,
    # Early K2 configs say 1e-6, later copies 1e-5; a converted checkpoint's config.json wins (--norm-epsilon).
    norm_epsilon=1e-5,
    mtp_num_layers=0,
    seq_length=32768,
)

# Every architectural feature of K2.5 at CPU size: q/kv LoRA with latent norms, decoupled rope, YaRN, a first
# dense layer, sigmoid routing with expert bias, top-k scaling, a shared expert, untied output, MTP.
TINY = ModelPreset(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    vocab_size=1024,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
    num_experts=8,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    first_k_dense=1,
    moe_router_topk_scaling_factor=2.5,
    rotary_base=50000.0,
    rotary_scaling_factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=1.0,
    beta_slow=1.0,
    max_position_embeddings=1024,
    norm_epsilon=1e-5,
    mtp_num_layers=1,
    seq_length=64,
)

# No q LoRA (q_lora_rank None) and two dense layers: the DeepSeek-V2-Lite-style corner of the same family.
TINY_NO_QLORA = TINY.replace(q_lora_rank=None, first_k_dense=2)

# Kimi-Linear-48B-A3B: KDA layers with MLA at layers 4, 8, ..., 24 and the last (1-indexed), no positional encoding
# in MLA, 256 experts top-8 + 1 shared, first layer dense.
KIMI_LINEAR_48B = ModelPreset(
    num_layers=27,
    hidden_size=2304,
    ffn_hidden_size=9216,
    num_attention_heads=32,
    vocab_size=163840,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_head_dim=128,
    qk_pos_emb_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    moe_router_topk=8,
    moe_ffn_hidden_size=1024,
    moe_shared_expert_intermediate_size=1024,
    first_k_dense=1,
    moe_router_topk_scaling_factor=2.446,
    rope_type="rope",
    max_position_embeddings=1048576,
    norm_epsilon=1e-5,
    seq_length=4096,
    hybrid_layer_pattern="KKKM" * 6 + "KKM",
    kda_num_heads=32,
    kda_head_dim=128,
    kda_conv_kernel=4,
    mla_nope=True,
)

# Every feature of the hybrid at CPU size: KDA and position-free MLA layers, a dense first layer, MoE, MTP.
TINY_KIMI_LINEAR = TINY.replace(q_lora_rank=None, rope_type="rope", rotary_scaling_factor=1.0,
                                hybrid_layer_pattern="KKKM", kda_num_heads=4, kda_head_dim=16, kda_conv_kernel=4,
                                mla_nope=True)

PRESETS: dict[str, ModelPreset] = {
    "kimi-k2.5": KIMI_K2_5,
    "tiny": TINY,
    "tiny-no-qlora": TINY_NO_QLORA,
    "kimi-linear-48b": KIMI_LINEAR_48B,
    "tiny-kimi-linear": TINY_KIMI_LINEAR,
}


def parse_layer_pattern(text: str, num_layers: int, flag: str = "--hybrid-layer-pattern") -> str:
    """'KKKM...' or 'KDA KDA KDA MLA ...' (spaces ignored, case-insensitive) -> one 'K'/'M' per layer."""
    words = text.upper().split()
    if words and all(w in ("KDA", "MLA") for w in words):
        pattern = "".join(w[0] if w == "KDA" else "M" for w in words)
    else:
        pattern = "".join(words)
    bad = sorted(set(pattern) - {"K", "M"})
    if bad:
        raise ValueError(f"{flag} {text!r}: unknown layer kind(s) {bad}; use K (Kimi Delta Attention) and M (MLA), "
                         "e.g. 'KKKM' or 'KDA KDA KDA MLA'")
    if len(pattern) != num_layers:
        raise ValueError(f"{flag} {text!r} names {len(pattern)} layers but --num-layers is {num_layers}; give one "
                         "K or M per layer")
    return pattern


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"--model {name!r} is not a known preset; choose one of {sorted(PRESETS)}") from None


def attention_params(p: ModelPreset) -> int:
    h, n = p.hidden_size, p.num_attention_heads
    q_head = p.qk_head_dim + p.qk_pos_emb_head_dim
    if p.q_lora_rank:
        q = h * p.q_lora_rank + p.q_lora_rank + p.q_lora_rank * n * q_head  # down, latent norm, up
    else:
        q = h * n * q_head
    kv = h * (p.kv_lora_rank + p.qk_pos_emb_head_dim) + p.kv_lora_rank  # down (+rope key), latent norm
    kv += p.kv_lora_rank * n * (p.qk_head_dim + p.v_head_dim)  # up
    out = n * p.v_head_dim * h
    return q + kv + out + h  # + input norm


def _kda_params(p: ModelPreset) -> int:
    h, n, d = p.hidden_size, p.kda_num_heads, p.kda_head_dim
    qkv = 3 * h * n * d + 3 * n * d * p.kda_conv_kernel  # projections, short convolutions
    gates = 2 * (h * d + d * n * d) + n * d + n + h * n  # forget and output gates (low rank), dt_bias, A_log, beta
    return qkv + gates + d + n * d * h + h  # + output norm, output projection, input norm


def _layer_attention_params(p: ModelPreset, i: int) -> int:
    if p.hybrid_layer_pattern and p.hybrid_layer_pattern[i] == "K":
        return _kda_params(p)
    return attention_params(p)


def mlp_params(h: int, ffn: int) -> int:
    return 3 * h * ffn  # gated (SwiGLU): gate, up, down


def moe_params(p: ModelPreset, experts: int) -> int:
    h = p.hidden_size
    shared = mlp_params(h, p.moe_shared_expert_intermediate_size or 0)
    return p.num_experts * h + experts * mlp_params(h, p.moe_ffn_hidden_size) + shared


def parameter_counts(p: ModelPreset, include_mtp: bool = True) -> tuple[int, int]:
    """(total, active per token) learnable parameters, embeddings and output layer included.

    Active counts the routed experts a token visits (top-k) instead of all of them. MTP layers count towards
    the total (they are trained) but not towards the active parameters of a forward pass for the main head.
    """
    h = p.hidden_size
    total = active = 0
    for i, is_moe in enumerate(p.moe_layer_pattern):
        attn = _layer_attention_params(p, i)
        post_norm = h
        if is_moe:
            total += attn + post_norm + moe_params(p, p.num_experts)
            active += attn + post_norm + moe_params(p, p.moe_router_topk)
        else:
            dense = attn + post_norm + mlp_params(h, p.ffn_hidden_size)
            total += dense
            active += dense
    embeddings = p.vocab_size * h * (2 if p.untie_embeddings_and_output_weights else 1)
    final_norm = h
    total += embeddings + final_norm
    active += embeddings + final_norm
    if p.attention_residuals:  # a pseudo-query per attention, per MLP and for the final norm
        total += (2 * p.num_layers + 1) * h
        active += (2 * p.num_layers + 1) * h
    if include_mtp and p.mtp_num_layers:
        last_is_moe = p.moe_layer_pattern[-1]
        layer = _layer_attention_params(p, p.num_layers - 1) + h + (moe_params(p, p.num_experts) if last_is_moe
                                             else mlp_params(h, p.ffn_hidden_size))
        # enorm, hnorm, eh_proj (2h -> h), the transformer layer, a final norm; embedding and head are shared
        total += p.mtp_num_layers * (2 * h + 2 * h * h + layer + h)
    return total, active
