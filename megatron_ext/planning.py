"""Parallel layouts for a model on a GPU cluster: which fit, and which should train fastest.

An analytic model, not a profiler. For every TP/PP/VPP/EP/ETP/CP/DP layout and recomputation choice it estimates
the memory of the most loaded GPU (weights, gradients, the distributed optimizer's shards, activations, MoE
dispatch buffers, the logits of the output layer) and the step time (GEMM and attention FLOPs at an achieved
fraction of the GPU's peak, pipeline bubble, exposed expert-parallel all-to-all, tensor-, context- and
data-parallel communication), then MFU. The constants are stated below with where they come from; tests compare
the estimates with published layouts and throughputs and state the error.

Assumptions that match this code base: bf16 weights, fp32 gradient buffers (`grad_reduce_in_fp32`), Megatron-Core's
distributed optimizer (fp32 master weights and Adam moments sharded over data-parallel ranks, over
expert-data-parallel ranks for experts), 1F1B pipeline schedule, sequence parallelism whenever TP > 1, dropless
alltoall token dispatch, 8 GPUs per node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

from megatron_ext.models import presets
from megatron_ext.models.presets import ModelPreset, parameter_counts

GIB = 1024 ** 3


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # usable HBM
    bf16_tflops: float  # dense peak
    fp8_tflops: float
    nvlink_gbs: float  # per-GPU NVLink bandwidth, one direction, GB/s
    network_gbs: float  # per-GPU scale-out bandwidth (InfiniBand/RoCE), one direction, GB/s
    capability: tuple[int, int]
    gpus_per_node: int = 8


# Vendor datasheet figures (dense tensor-core peaks; NVLink per GPU one direction; 400 Gb/s NIC per GPU).
GPUS = {
    "h100": GPU("h100", 80, 989, 1979, 450, 50, (9, 0)),
    "h800": GPU("h800", 80, 989, 1979, 200, 50, (9, 0)),  # DeepSeek-V3's cluster: NVLink cut to 400 GB/s both ways
    "h200": GPU("h200", 141, 989, 1979, 450, 50, (9, 0)),
    "b200": GPU("b200", 180, 2250, 4500, 900, 50, (10, 0)),
}

# Achieved fraction of the dense peak for this model's GEMMs (large bf16 GEMMs reach ~70 % on H100; grouped expert
# GEMMs with 2048-wide experts and uneven token counts less) and the end-to-end gain of FP8 over bf16 GEMMs (well
# below 2x: quantisation, amax and transposes, and the unquantised attention).
GEMM_EFFICIENCY = 0.60
GEMM_HALF_ROWS = 256  # GEMMs with this many rows (tokens) reach half that: small per-expert batches are slow
ATTENTION_EFFICIENCY = 0.45  # flash-attention style fused kernels on long sequences
FP8_GEMM_SPEEDUP = 1.45
# Fraction of each communication that is not hidden behind compute.
EXPOSED = {"ep": 0.5, "tp": 0.5, "cp": 0.3, "pp": 1.0, "dp_overlapped": 0.15, "dp": 1.0}
COMM_EFFICIENCY = 0.75  # achieved / nominal link bandwidth for NCCL collectives
FRAMEWORK_GIB = 6.0  # CUDA context, NCCL buffers, allocator slack
FRAGMENTATION = 1.10  # caching-allocator fragmentation on top of live tensors
ALLTOALL_IMBALANCE = 1.3  # the busiest rank's share of routed tokens (dropless routing is never balanced)

RECOMPUTE_CHOICES = ("none", "selective", "full")
SELECTIVE_MODULES = ("mla_up_proj", "moe", "layernorm")


# --------------------------------------------------------------------------------------------------------
# The model, per token
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Sizes the estimates need, derived from a preset."""

    p: ModelPreset

    @property
    def moe_layers(self) -> int:
        return sum(self.p.moe_layer_pattern)

    @property
    def dense_layers(self) -> int:
        return self.p.num_layers - self.moe_layers

    def attention_params(self) -> int:
        """MLA with its latent norms, plus the layer's input and pre-MLP norms (presets.py counts the same)."""
        return presets.attention_params(self.p) + self.p.hidden_size

    def routed_params(self) -> int:
        """All routed experts of one MoE layer."""
        return presets.moe_params(self.p, self.p.num_experts) - self.moe_other_params() if self.p.num_experts else 0

    def moe_other_params(self) -> int:
        """Router and shared expert of one MoE layer."""
        return presets.moe_params(self.p, 0) if self.p.num_experts else 0

    def dense_mlp_params(self) -> int:
        return presets.mlp_params(self.p.hidden_size, self.p.ffn_hidden_size)

    def embedding_params(self) -> int:
        return self.p.vocab_size * self.p.hidden_size

    def mtp_params(self) -> tuple[int, int]:
        """(non-expert, routed) parameters of all MTP layers (each: norms, eh_proj and a copy of the last layer)."""
        h, k = self.p.hidden_size, self.p.mtp_num_layers
        last_moe = bool(self.p.num_experts) and self.p.moe_layer_pattern[-1]
        mlp = self.moe_other_params() if last_moe else self.dense_mlp_params()
        return k * (3 * h + 2 * h * h + self.attention_params() + mlp), k * (self.routed_params() if last_moe else 0)

    # FLOPs of one token's forward pass
    def layer_gemm_flops(self, moe: bool) -> float:
        """2 x the weights a token multiplies with in one layer (top-k experts for MoE)."""
        p = self.p
        attn = self.attention_params() - 2 * p.hidden_size - p.kv_lora_rank - (p.q_lora_rank or 0)
        if moe:
            mlp = p.num_experts * p.hidden_size + 3 * p.hidden_size * (
                p.moe_router_topk * p.moe_ffn_hidden_size + (p.moe_shared_expert_intermediate_size or 0))
        else:
            mlp = self.dense_mlp_params()
        return 2.0 * (attn + mlp)

    def attention_flops(self, seq_length: int) -> float:
        """Causal scores and weighted values: on average a token attends to half the sequence."""
        p = self.p
        return 2.0 * p.num_attention_heads * (p.qk_head_dim + p.qk_pos_emb_head_dim + p.v_head_dim) * seq_length / 2

    def head_flops(self) -> float:
        return 2.0 * self.p.vocab_size * self.p.hidden_size

    def forward_flops_per_token(self, seq_length: int, with_mtp: bool = True) -> float:
        """Model FLOPs of one token's forward pass (the basis of MFU; recomputation not counted)."""
        p = self.p
        layers = self.dense_layers * self.layer_gemm_flops(False) + self.moe_layers * self.layer_gemm_flops(True)
        total = layers + p.num_layers * self.attention_flops(seq_length) + self.head_flops()
        if with_mtp and p.mtp_num_layers:
            last_moe = bool(p.num_experts) and p.moe_layer_pattern[-1]
            per = self.layer_gemm_flops(last_moe) + self.attention_flops(seq_length) + self.head_flops()
            total += p.mtp_num_layers * (per + 2.0 * 2 * p.hidden_size * p.hidden_size)
        return total

    def cp_kv_bytes_per_token(self, tp: int) -> float:
        """What Transformer Engine's context-parallel ring sends per token and layer: the keys and values of this
        TP rank's heads in bf16 (MLA's latent is up-projected before attention, so ~36x the 576-wide latent the
        local backend's all-gather moves at TP1 for K2.5)."""
        p = self.p
        return 2 * p.num_attention_heads / tp * (p.qk_head_dim + p.qk_pos_emb_head_dim + p.v_head_dim)

    # Activations of one token in one layer, bytes (bf16 unless noted), split into the part tensor parallelism
    # divides (sequence parallel / head-parallel) and the expert part (routed tokens)
    def activation_bytes(self, moe: bool, recompute: str, tp: int) -> float:
        p, h = self.p, self.p.hidden_size
        n, dqk, dv = p.num_attention_heads, p.qk_head_dim + p.qk_pos_emb_head_dim, p.v_head_dim
        latents = 2 * ((p.q_lora_rank or 0) * 2 + (p.kv_lora_rank + p.qk_pos_emb_head_dim) + p.kv_lora_rank)
        norms = 2 * 2 * h  # inputs of the two norms
        up = 2 * n * (dqk + p.qk_head_dim + dv)  # q and kv up-projection outputs
        core = 2 * n * (2 * dqk + dv) + 4 * n  # rope'd q and k, v, softmax statistics (fp32)
        out = 2 * n * dv  # attention output, which is also the output projection's saved input (one tensor)
        residual = 2 * h
        if moe:
            k, f = p.moe_router_topk, p.moe_ffn_hidden_size
            s = p.moe_shared_expert_intermediate_size or 0
            router = 2 * h + 4 * p.num_experts * 2  # input, fp32 logits and scores
            experts = 2 * k * (h + 2 * f + f + h)  # permuted input, fc1 out, activation, fc2 out (per top-k copy)
            shared = 2 * (h + 3 * s)
            mlp_norm_in, mlp_rest = norms / 2, router + shared
        else:
            experts = 0
            mlp_rest = 2 * (h + 3 * p.ffn_hidden_size)
            mlp_norm_in = norms / 2
        if recompute == "full":
            return 2 * h / tp  # only the layer input is kept (sequence-parallel shard)
        if recompute == "selective":  # SELECTIVE_MODULES: MLA up-projections, the MoE block, the norms
            # the up-projection checkpoint keeps only its inputs: q latent, kv latent and rope key (the latent
            # norms run inside it, fused into TE's up-projections)
            latents = 2 * ((p.q_lora_rank or 0) + p.kv_lora_rank + p.qk_pos_emb_head_dim)
            up = core = 0
            norms = mlp_norm_in = 0
            if moe:
                experts, mlp_rest = 0, 2 * h
        attn = latents + norms + up + core + out + residual
        # with sequence parallelism each TP rank dispatches only its own tokens' routed copies
        return (attn + mlp_norm_in + mlp_rest + experts) / tp


# --------------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp: int = 1
    first_stage_layers: Optional[int] = None  # uneven pipeline split (Megatron-LM's --decoder-first/last-...)
    last_stage_layers: Optional[int] = None
    recompute: str = "none"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks that hold the same experts."""
        return self.world // (self.pp * self.ep * self.etp)

    def flags(self) -> list[str]:
        """This layout as Megatron-LM flags (data parallelism is what remains of the world size)."""
        out = ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp),
               "--expert-model-parallel-size", str(self.ep), "--expert-tensor-parallel-size", str(self.etp),
               "--context-parallel-size", str(self.cp)]
        if self.tp > 1:
            out.append("--sequence-parallel")
        if self.vpp > 1:
            out += ["--virtual-pipeline-model-parallel-size", str(self.vpp)]
        if self.first_stage_layers is not None:
            out += ["--decoder-first-pipeline-num-layers", str(self.first_stage_layers)]
        if self.last_stage_layers is not None:
            out += ["--decoder-last-pipeline-num-layers", str(self.last_stage_layers)]
        if self.recompute == "full":
            out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        elif self.recompute == "selective":
            out += ["--recompute-granularity", "selective", "--recompute-modules", *SELECTIVE_MODULES]
        return out

    def describe(self) -> str:
        split = ""
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            split = f"({self.first_stage_layers or '-'}..{self.last_stage_layers or '-'})"
        return (f"TP{self.tp} PP{self.pp}{split}" + (f" VPP{self.vpp}" if self.vpp > 1 else "")
                + f" EP{self.ep} ETP{self.etp} CP{self.cp} DP{self.dp} recompute={self.recompute}")


def stage_layers(num_layers: int, layout: Layout) -> list[int]:
    from megatron_ext.gpu import pipeline_layers

    return pipeline_layers(num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)


def balanced_split(num_layers: int, pp: int) -> tuple[Optional[int], Optional[int]]:
    """First/last stage sizes for a layer count pp does not divide: equal middle stages, the remainder on the
    first and last stage (the last one lighter: it also computes the output layer and the MTP layers)."""
    if pp == 1 or num_layers % pp == 0:
        return None, None
    each = math.ceil(num_layers / pp)
    rest = num_layers - each * (pp - 2)
    if rest < 2:
        each -= 1
        rest = num_layers - each * (pp - 2)
    last = rest // 2
    return rest - last, last


# --------------------------------------------------------------------------------------------------------
# Estimates
# --------------------------------------------------------------------------------------------------------


@dataclass
class Estimate:
    layout: Layout
    memory_gib: dict = field(default_factory=dict)  # the most loaded GPU, by part
    step_time_s: float = 0.0
    time_s: dict = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    tflops_per_gpu: float = 0.0
    fits: bool = False
    notes: list = field(default_factory=list)

    @property
    def total_gib(self) -> float:
        return self.memory_gib.get("total", 0.0)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layout"] = dataclasses.asdict(self.layout)
        d["flags"] = self.layout.flags()
        d["describe"] = self.layout.describe()
        return d


@dataclass(frozen=True)
class Workload:
    seq_length: int
    global_batch_size: int  # sequences per step
    micro_batch_size: int = 1
    fp8: bool = False
    distributed_optimizer: bool = True
    overlap_dp: bool = True  # --overlap-grad-reduce / --overlap-param-gather
    headroom: float = 0.10  # fraction of GPU memory left free


def _link(group_span: int, gpu: GPU) -> float:
    """Bytes/s of a collective over a group spanning `group_span` consecutive ranks."""
    bw = gpu.nvlink_gbs if group_span <= gpu.gpus_per_node else gpu.network_gbs
    return bw * 1e9 * COMM_EFFICIENCY


def estimate(model: ModelPreset, layout: Layout, gpu: GPU, work: Workload) -> Estimate:
    shape = ModelShape(model)
    est = Estimate(layout)
    L = layout
    p = model
    layers = stage_layers(p.num_layers, L)
    pattern = p.moe_layer_pattern
    bounds = [sum(layers[:i]) for i in range(len(layers) + 1)]
    micro = work.global_batch_size // (work.micro_batch_size * L.dp)
    tokens = work.micro_batch_size * work.seq_length // L.cp  # one micro-batch on one CP rank
    mtp_dense, mtp_routed = shape.mtp_params()

    worst_mem, worst = None, None
    stage_times = []
    for stage in range(L.pp):
        moe_n = sum(pattern[bounds[stage]:bounds[stage + 1]])
        dense_n = layers[stage] - moe_n
        first, last = stage == 0, stage == L.pp - 1
        # parameters this GPU holds: non-expert ones split by TP, routed experts by EP x ETP
        nonexpert = layers[stage] * shape.attention_params() + moe_n * shape.moe_other_params() \
            + dense_n * shape.dense_mlp_params()
        nonexpert += shape.embedding_params() * (int(first) + int(last and p.untie_embeddings_and_output_weights))
        expert = moe_n * shape.routed_params()
        if last:
            nonexpert, expert = nonexpert + mtp_dense, expert + mtp_routed
        nonexpert_local, expert_local = nonexpert / L.tp, expert / (L.ep * L.etp)
        local = nonexpert_local + expert_local
        weights = 2 * local
        grads = 4 * local
        if work.distributed_optimizer:
            optim = 12 * (nonexpert_local / (L.dp * L.cp) + expert_local / L.edp)
        else:
            optim = 12 * local
        # activations: 1F1B keeps (pp - stage) micro-batches in flight on stage `stage` (more with VPP)
        in_flight = min(micro, (L.pp - stage) + (L.pp - 1) * (L.vpp - 1) // max(L.vpp, 1))
        per_mb = tokens * (dense_n * shape.activation_bytes(False, L.recompute, L.tp)
                           + moe_n * shape.activation_bytes(True, L.recompute, L.tp))
        if L.recompute != "none":  # the one layer being recomputed holds its full activations
            per_mb_peak = tokens * shape.activation_bytes(moe_n > 0, "none", L.tp)
        else:
            per_mb_peak = 0
        acts = in_flight * per_mb + per_mb_peak
        dispatch = 0.0
        if moe_n:  # alltoall send/receive buffers and permuted copies, for the busiest rank
            dispatch = 4 * ALLTOALL_IMBALANCE * tokens / L.tp * p.moe_router_topk * p.hidden_size * 2
        logits = 0.0
        if last:  # bf16 logits, fp32 softmax and its gradient, per head (main + MTP self-distillation)
            logits = (1 + p.mtp_num_layers) * tokens * p.vocab_size / L.tp * (2 + 4 + 4)
        parts = {"weights": weights, "grads": grads, "optimizer": optim, "activations": acts,
                 "moe_dispatch": dispatch, "logits": logits}
        total = sum(parts.values()) * FRAGMENTATION + FRAMEWORK_GIB * GIB
        if worst_mem is None or total > worst_mem:
            worst_mem, worst = total, dict(parts, total=total, stage=stage)

        # compute per micro-batch on this stage's GPUs
        gemm = (dense_n * shape.layer_gemm_flops(False) + moe_n * shape.layer_gemm_flops(True)) * tokens / L.tp
        # routed tokens arrive unevenly: the busiest expert rank sets the pace
        routed = moe_n * 2.0 * 3 * p.hidden_size * p.moe_ffn_hidden_size * p.moe_router_topk * tokens / L.tp
        gemm += routed * (ALLTOALL_IMBALANCE - 1)
        routed_share = routed * ALLTOALL_IMBALANCE
        attn = layers[stage] * shape.attention_flops(work.seq_length) * tokens / L.tp
        if last:
            gemm += (1 + p.mtp_num_layers) * shape.head_flops() * tokens / L.tp
            if p.mtp_num_layers:
                gemm += p.mtp_num_layers * shape.layer_gemm_flops(bool(pattern[-1])) * tokens / L.tp
                attn += p.mtp_num_layers * shape.attention_flops(work.seq_length) * tokens / L.tp
        passes = 3.0 + (1.0 if L.recompute == "full" else 0.0)
        gemm_rate = gpu.bf16_tflops * 1e12 * GEMM_EFFICIENCY * (FP8_GEMM_SPEEDUP if work.fp8 else 1.0)
        # rows of the GEMMs: a micro-batch's tokens on this CP rank (all-gathered over TP), and per local expert
        # the tokens routed to it from the whole expert-parallel group
        expert_rows = tokens * L.ep * p.moe_router_topk / p.num_experts if p.num_experts else tokens
        rate_dense = gemm_rate * _row_efficiency(tokens)
        rate_expert = gemm_rate * _row_efficiency(expert_rows)
        t_compute = passes * ((gemm - routed_share) / rate_dense + routed_share / rate_expert) \
            + passes * attn / (gpu.bf16_tflops * 1e12 * ATTENTION_EFFICIENCY * _row_efficiency(tokens))
        if L.recompute == "selective":  # MoE block and MLA up-projections forward again
            t_compute += routed_share / rate_expert + (moe_n * shape.layer_gemm_flops(True) * tokens / L.tp
                                                        - routed) / rate_dense
        # communication per micro-batch
        t_ep = 0.0
        if moe_n and L.ep > 1:
            vol = tokens / L.tp * p.moe_router_topk * p.hidden_size * 2 * (L.ep - 1) / L.ep * ALLTOALL_IMBALANCE
            a2a = 4 + (2 if L.recompute in ("full", "selective") else 0)  # dispatch + combine, fwd and bwd
            t_ep = moe_n * a2a * vol / _link(L.ep * L.etp, gpu) * EXPOSED["ep"]
        t_tp = 0.0
        if L.tp > 1:
            vol = tokens * p.hidden_size * 2 * (L.tp - 1) / L.tp
            t_tp = layers[stage] * 8 * vol / _link(L.tp, gpu) * EXPOSED["tp"]
        t_cp = 0.0
        if L.cp > 1:  # TE's CP ring passes this rank's heads' full K and V around the ring, dK/dV too backward
            vol = tokens * shape.cp_kv_bytes_per_token(L.tp) * (L.cp - 1)
            t_cp = layers[stage] * 3 * vol / _link(L.tp * L.cp, gpu) * EXPOSED["cp"]
        t_pp = 0.0
        if L.pp > 1:
            t_pp = 2 * tokens / L.tp * p.hidden_size * 2 / _link(L.world, gpu) * EXPOSED["pp"]
        stage_times.append((t_compute + t_ep + t_tp + t_cp + t_pp, dict(compute=t_compute, ep=t_ep, tp=t_tp,
                                                                      cp=t_cp, pp=t_pp), local, expert_local,
                            nonexpert_local))

    slowest = max(stage_times, key=lambda s: s[0])
    per_mb = slowest[0]
    bubble = (L.pp - 1) / L.vpp * per_mb
    # data-parallel gradient reduce-scatter + parameter all-gather, per step
    dp_bytes = 4 * slowest[4] * (L.dp * L.cp - 1) / max(L.dp * L.cp, 1) \
        + 4 * slowest[3] * (L.edp - 1) / max(L.edp, 1)
    dp_bytes *= 1.5  # + bf16 parameter all-gather
    t_dp = dp_bytes / gpu.network_gbs / 1e9 / COMM_EFFICIENCY
    t_dp *= EXPOSED["dp_overlapped"] if work.overlap_dp else EXPOSED["dp"]
    step = micro * per_mb + bubble + t_dp
    est.step_time_s = step
    est.time_s = {**{k: v * micro for k, v in slowest[1].items()}, "bubble": bubble, "dp": t_dp}
    tokens_step = work.global_batch_size * work.seq_length
    est.tokens_per_s = tokens_step / step
    model_flops = 3 * shape.forward_flops_per_token(work.seq_length) * tokens_step
    est.tflops_per_gpu = model_flops / step / L.world / 1e12
    est.mfu = est.tflops_per_gpu / gpu.bf16_tflops
    est.memory_gib = {k: (v / GIB if k != "stage" else v) for k, v in worst.items()}
    est.fits = worst["total"] <= gpu.memory_gib * GIB * (1 - work.headroom)
    if L.vpp > 1:
        est.notes.append("virtual pipeline stages: not built by training/step.py yet")
    return est


def _row_efficiency(rows: float) -> float:
    return rows / (rows + GEMM_HALF_ROWS)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelPreset, world: int, work: Workload, gpu: GPU,
            recompute: tuple[str, ...] = RECOMPUTE_CHOICES, max_vpp: int = 1) -> Iterator[Layout]:
    """Every layout the training code accepts for `world` GPUs (the same rules as arguments.validate_args)."""
    experts = model.num_experts or 1
    for tp in [d for d in (1, 2, 4, 8) if d <= gpu.gpus_per_node and model.num_attention_heads % d == 0]:
        for cp in [c for c in _divisors(world) if work.seq_length % (2 * c) == 0 or c == 1]:
            for pp in _divisors(world // (tp * cp) if world % (tp * cp) == 0 else 1):
                if world % (tp * cp * pp):
                    continue
                if pp > model.num_layers // 2 and pp > 1:
                    continue
                first, last = balanced_split(model.num_layers, pp)
                try:
                    stage_layers(model.num_layers, Layout(pp=pp, first_stage_layers=first, last_stage_layers=last))
                except ValueError:
                    continue
                dp = world // (tp * cp * pp)
                if work.global_batch_size % (work.micro_batch_size * dp):
                    continue
                for ep in [e for e in _divisors(experts) if (world // pp) % e == 0]:
                    for etp in sorted({1, tp}):
                        if (world // pp) % (ep * etp):
                            continue
                        for vpp in range(1, max_vpp + 1):
                            if vpp > 1 and (first is not None or model.num_layers % (pp * vpp) or pp == 1):
                                continue
                            for rc in recompute:
                                yield Layout(tp, pp, vpp, ep, etp, cp, dp, first, last, rc)


def plan(model: ModelPreset, gpu: GPU, world: int, work: Workload, fits_only: bool = True,
         **kwargs) -> list[Estimate]:
    """Estimates for all valid layouts, fastest first (those that fit before those that do not)."""
    out = [estimate(model, layout, gpu, work) for layout in layouts(model, world, work, gpu, **kwargs)]
    if fits_only:
        out = [e for e in out if e.fits]
    return sorted(out, key=lambda e: (not e.fits, -e.tokens_per_s))


# --------------------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------------------


def serving_memory(model: ModelPreset, tp: int, pp: int, ep: int, batch: int, context: int,
                   weight_bytes: float = 2.0, cache_bytes: float = 2.0) -> dict:
    """GiB per GPU when serving: weights, and the MLA latent cache (kv_lora_rank + rope dims per token and layer,
    what DeepSeek-V3 caches; replicated over tensor-parallel ranks, split over pipeline stages)."""
    shape = ModelShape(model)
    nonexpert = model.num_layers * shape.attention_params() + shape.moe_layers * shape.moe_other_params() \
        + shape.dense_layers * shape.dense_mlp_params() + 2 * shape.embedding_params()
    expert = shape.moe_layers * shape.routed_params()
    weights = weight_bytes * (nonexpert / (tp * pp) + expert / (ep * pp))
    cache = batch * context * (model.num_layers / pp) * (model.kv_lora_rank + model.qk_pos_emb_head_dim) * cache_bytes
    return {"weights": weights / GIB, "latent_cache": cache / GIB, "total": (weights + cache) / GIB + FRAMEWORK_GIB}


def rollout_replica_gpus(model: ModelPreset, gpu_memory_gib: float, batch: int = 16, context: int = 32768,
                         headroom: float = 0.10) -> tuple[int, dict]:
    """GPUs one rollout (inference) replica needs: the fewest GPUs (TP = EP within a node of 8, pipeline stages
    across nodes, which also split the latent cache) whose per-GPU serving memory fits with `headroom`.
    (gpus, serving_memory of that layout)."""
    gpus = 1
    while True:
        tp = min(gpus, 8)
        mem = serving_memory(model, tp, max(1, gpus // 8), tp, batch, context)
        if mem["total"] <= gpu_memory_gib * (1 - headroom) or gpus >= 4096:
            return gpus, mem
        gpus *= 2


def layout_of(args) -> Layout:
    """The layout parsed flags (arguments.parse_args) describe, as the planner sees it."""
    modules = set(args.recompute_modules or ["core_attn"])
    recompute = {"full": "full", None: "none"}.get(args.recompute_granularity)
    if args.recompute_granularity == "selective":
        recompute = "selective" if set(SELECTIVE_MODULES) <= modules else "none"
    return Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, vpp=1,
                  ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                  cp=args.context_parallel_size, dp=args.data_parallel_size,
                  first_stage_layers=args.decoder_first_pipeline_num_layers,
                  last_stage_layers=args.decoder_last_pipeline_num_layers, recompute=recompute)


def counts(model: ModelPreset) -> tuple[int, int]:
    """(total, active) parameters as the dry run prints them (presets.parameter_counts)."""
    return parameter_counts(model)
