"""GPU-only features with Megatron-LM's flag names: overlapped gradient/parameter communication, activation
recomputation, uneven pipeline stages, fused kernels, FP8.

Everything here maps flags onto Megatron-Core's `TransformerConfig` and `DistributedDataParallelConfig`; nothing is
reimplemented. Each feature is switched on only where the machine can run it (fusions that need Transformer
Engine only with TE, none of them on the CPU path), and combinations a GPU cannot run are refused up front, naming
the flag and the fix.
"""

from __future__ import annotations

import argparse
from typing import Optional

from megatron_ext import platform

RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")

# FP8 recipe -> the lowest CUDA compute capability whose tensor cores run it (Transformer Engine's requirements).
FP8_MIN_CAPABILITY = {
    "delayed": (8, 9),  # Ada / Hopper and later
    "tensorwise": (8, 9),
    "blockwise": (9, 0),  # Hopper's 1x128 / 128x128 block scaling (DeepSeek-V3 style)
    "mxfp8": (10, 0),  # MX block scaling needs Blackwell tensor cores
}


def add_gpu_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("gpu", "communication overlap, recomputation, pipeline split, fusions (GPU)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the data-parallel gradient reduce(-scatter) with the backward pass")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with the next forward pass "
                        "(needs --use-distributed-optimizer and --overlap-grad-reduce)")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="activation recomputation: whole layers (full) or the modules in --recompute-modules")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="full recomputation: checkpoint groups of --recompute-num-layers layers (uniform) or only "
                        "the first --recompute-num-layers layers of each stage (block)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputation group (uniform) or recomputed layers per stage (block)")
    g.add_argument("--recompute-modules", nargs="+", default=None, choices=RECOMPUTE_MODULES,
                   help="selective recomputation: which submodules recompute their outputs in the backward pass "
                        "(default core_attn)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers on the first pipeline stage (the rest split evenly); for layer counts the "
                        "pipeline size does not divide, e.g. 61")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers on the last pipeline stage, which also holds the output layer and MTP layers")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="accumulate weight gradients outside the GEMM (fused by default with Transformer Engine "
                        "when apex's fused_weight_gradient_mlp_cuda kernel imports)")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="unfused SwiGLU (fused by default on a GPU)")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="unfused residual dropout-add (fused by default on a GPU)")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="Transformer Engine's fused token permute/unpermute in the MoE dispatcher")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="run the shared expert on a side stream while the alltoall dispatcher moves tokens")
    g.add_argument("--moe-flex-dispatcher-backend", default="deepep", choices=["deepep", "hybridep"],
                   help="kernels of --moe-token-dispatcher-type flex (the deep_ep package, or hybrid_ep)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused vocabulary-parallel cross-entropy for the LM loss")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"],
                   help="which fused cross-entropy: Megatron-Core's own or Transformer Engine's")
    g.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap tensor-parallel communication with GEMMs (refused: see the message)")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false",
                   help="unfused rotary embedding (fused by default with Transformer Engine for YaRN presets: "
                        "Megatron-Core's fused MLA RoPE exists only for YaRN)")


def compute_capability() -> Optional[tuple[int, int]]:
    """The local GPU's CUDA compute capability, or None without a usable GPU."""
    if platform.bridge_needed():
        return None
    import torch

    return tuple(torch.cuda.get_device_capability())


def fp8_support_error(recipe: str, capability: Optional[tuple[int, int]]) -> Optional[str]:
    """Why this GPU cannot run FP8 recipe `recipe` (None: it can, or there is no GPU to ask)."""
    if capability is None:
        return None
    need = FP8_MIN_CAPABILITY[recipe]
    if tuple(capability) < need:
        hint = ("use --fp8-recipe blockwise or tensorwise on Hopper" if recipe == "mxfp8"
                else "drop --fp8-format (bf16) on this GPU")
        return (f"--fp8-recipe {recipe} needs a GPU of compute capability {need[0]}.{need[1]} or newer; this one is "
                f"{capability[0]}.{capability[1]}: {hint}")
    return None


def validate_gpu_args(args: argparse.Namespace, fail, capability: Optional[tuple[int, int]] = None):
    """Flag combinations of this group; `fail(msg)` raises. `capability` defaults to the local GPU's."""
    capability = capability if capability is not None else compute_capability()
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        fail("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce")
    if args.recompute_granularity == "full":
        if args.recompute_method is None or args.recompute_num_layers is None:
            fail("--recompute-granularity full needs --recompute-method uniform|block and --recompute-num-layers N "
                 "(e.g. --recompute-method uniform --recompute-num-layers 1)")
        if args.recompute_modules:
            fail("--recompute-modules belongs to --recompute-granularity selective, not full")
    elif args.recompute_method is not None or args.recompute_num_layers is not None:
        fail("--recompute-method/--recompute-num-layers need --recompute-granularity full")
    if args.recompute_modules and args.recompute_granularity != "selective":
        fail("--recompute-modules needs --recompute-granularity selective")
    if args.recompute_num_layers is not None and args.recompute_num_layers < 1:
        fail(f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")
    if args.recompute_modules and not args.arch.num_experts and \
            {"moe", "moe_act", "shared_experts"} & set(args.recompute_modules):
        fail("--recompute-modules moe/moe_act/shared_experts need an MoE model (--num-experts)")
    if args.arch.num_experts and args.pipeline_model_parallel_size > 1:
        try:
            sizes = pipeline_layers(args.arch.num_layers, args.pipeline_model_parallel_size,
                                    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
        except ValueError:
            sizes = None  # reported by the pipeline check
        pattern = args.arch.moe_layer_pattern
        for stage, start in enumerate([sum(sizes[:i]) for i in range(len(sizes))] if sizes else []):
            if not any(pattern[start:start + sizes[stage]]):
                fail(f"pipeline stage {stage} would hold only dense layers ({sizes[stage]} of the first "
                     f"{args.arch.first_k_dense} dense ones): Megatron-Core's MoE metrics need an MoE layer on every "
                     "stage; give the first stage more layers with --decoder-first-pipeline-num-layers")
    modules = set(args.recompute_modules or ())
    if "moe_act" in modules and not args.moe_grouped_gemm:
        fail("--recompute-modules moe_act needs --moe-grouped-gemm (Megatron-Core recomputes the grouped experts' "
             "activation only); use moe instead")
    if args.fp8_format and args.fp8_recipe == "delayed" and {"moe_act", "layernorm"} & modules:
        fail("--recompute-modules moe_act/layernorm do not work with --fp8-recipe delayed; use tensorwise, "
             "blockwise or mxfp8")
    if args.transformer_impl == "local" and args.context_parallel_size > 1 and "mla_up_proj" in modules:
        fail(f"--recompute-modules mla_up_proj with --context-parallel-size {args.context_parallel_size} needs "
             "--transformer-impl transformer_engine: the local backend's context-parallel MLA up-projects the "
             "gathered KV latent itself and cannot recompute it; drop mla_up_proj from --recompute-modules "
             "(or use Transformer Engine)")
    if getattr(args, "tp_comm_overlap", False):
        fail("--tp-comm-overlap does nothing for MLA models in Megatron-Core 0.16.1: Transformer Engine's userbuffers "
             "exist only for qkv/proj/fc1/fc2, and the first MLA projection (q_down_proj) switches the model's "
             "tp_comm_overlap off; drop the flag")
    te_only = [flag for flag, on in (("--moe-permute-fusion", getattr(args, "moe_permute_fusion", False)),
                                     ("--cross-entropy-fusion-impl te", getattr(args, "cross_entropy_loss_fusion", False)
                                      and getattr(args, "cross_entropy_fusion_impl", "native") == "te")) if on]
    if te_only and args.transformer_impl != "transformer_engine":
        fail(f"{te_only[0]} needs --transformer-impl transformer_engine (a Transformer Engine kernel); drop it on "
             "this machine")
    dispatcher = getattr(args, "moe_token_dispatcher_type", "alltoall")
    if getattr(args, "moe_shared_expert_overlap", False) and dispatcher != "alltoall":
        fail(f"--moe-shared-expert-overlap works with --moe-token-dispatcher-type alltoall only, not {dispatcher}")
    if getattr(args, "moe_shared_expert_overlap", False) and "shared_experts" in modules:
        fail("--moe-shared-expert-overlap cannot be combined with --recompute-modules shared_experts")
    if dispatcher == "flex":
        package = {"deepep": "deep_ep", "hybridep": "hybrid_ep"}[args.moe_flex_dispatcher_backend]
        if args.transformer_impl != "transformer_engine":
            fail("--moe-token-dispatcher-type flex needs --transformer-impl transformer_engine")
        if not getattr(args, "dry_run", False) and not platform.module_importable(package):
            fail(f"--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend "
                 f"{args.moe_flex_dispatcher_backend} needs the {package} package on this machine; use alltoall")
    if args.moe_grouped_gemm and args.transformer_impl != "transformer_engine":
        fail("--moe-grouped-gemm needs --transformer-impl transformer_engine (Transformer Engine's grouped GEMM); "
             "drop it on this machine")
    if args.fp8_format:
        problem = fp8_support_error(args.fp8_recipe, capability)
        if problem:
            fail(problem)


def pipeline_layers(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> list[int]:
    """Layers per pipeline stage, or ValueError naming the flags: the stages between the first and last get
    equal shares."""
    first_n = first if first is not None else None
    last_n = last if last is not None else None
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return [num_layers]
    middle_stages = pp - (first_n is not None) - (last_n is not None)
    rest = num_layers - (first_n or 0) - (last_n or 0)
    if min(first_n if first_n is not None else 1, last_n if last_n is not None else 1) < 1 or rest < 0:
        raise ValueError(f"--decoder-first/last-pipeline-num-layers ({first}, {last}) must be >= 1 and leave "
                         f"layers for the other stages of {num_layers}")
    if middle_stages == 0:
        if rest:
            raise ValueError(f"--decoder-first-pipeline-num-layers {first} + --decoder-last-pipeline-num-layers "
                             f"{last} must sum to --num-layers {num_layers} with 2 pipeline stages")
        return [first_n, last_n]
    if rest % middle_stages or rest == 0:
        raise ValueError(f"--num-layers {num_layers} does not split over --pipeline-model-parallel-size {pp}: "
                         f"{rest} layers for {middle_stages} stages; set --decoder-first-pipeline-num-layers and/or "
                         "--decoder-last-pipeline-num-layers so the remaining stages get equal shares")
    each = rest // middle_stages
    return ([first_n] if first_n is not None else []) + [each] * middle_stages + ([last_n] if last_n is not None else [])


def transformer_config_kwargs(args: argparse.Namespace) -> dict:
    """The TransformerConfig fields of this group; fusions only where the backend runs them."""
    gpu = not platform.bridge_needed()
    te = args.transformer_impl == "transformer_engine" and platform.te_available()
    out = dict(
        bias_activation_fusion=gpu and getattr(args, "bias_swiglu_fusion", True),
        bias_dropout_fusion=gpu and getattr(args, "bias_dropout_fusion", True),
        apply_rope_fusion=rope_fusion(args, te),
        gradient_accumulation_fusion=gradient_accumulation_fusion(args, te),
        recompute_granularity=getattr(args, "recompute_granularity", None),
        recompute_method=getattr(args, "recompute_method", None),
        recompute_num_layers=getattr(args, "recompute_num_layers", None),
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
    )
    out.update(cross_entropy_loss_fusion=gpu and getattr(args, "cross_entropy_loss_fusion", False),
               cross_entropy_fusion_impl=getattr(args, "cross_entropy_fusion_impl", "native"))
    if args.arch.num_experts:
        out.update(moe_permute_fusion=te and getattr(args, "moe_permute_fusion", False),
                   moe_shared_expert_overlap=getattr(args, "moe_shared_expert_overlap", False),
                   moe_flex_dispatcher_backend=getattr(args, "moe_flex_dispatcher_backend", "deepep"))
    if getattr(args, "recompute_granularity", None) == "selective":
        out["recompute_modules"] = list(args.recompute_modules or ["core_attn"])
    if args.fp8_format and args.arch.num_experts:
        out["moe_router_padding_for_fp8"] = True  # expert token counts padded to FP8 GEMM alignment
    return out


def rope_fusion(args: argparse.Namespace, te: bool) -> bool:
    """TE's fused RoPE where Megatron-Core has one: MLATransformerConfig refuses it for MLA without YaRN (Kimi
    Linear's position-free / plain-RoPE MLA), and the local backend has no fused kernel to call."""
    return te and getattr(args, "rope_fusion", True) and args.arch.rope_type == "yarn"


_SAID: set[str] = set()


def _say_once(line: str):
    import torch.distributed as dist

    if line not in _SAID and (not dist.is_initialized() or dist.get_rank() == 0):
        _SAID.add(line)
        print(f"megatron_ext: {line}", flush=True)


def gradient_accumulation_fusion(args: argparse.Namespace, te: bool) -> bool:
    """Fused weight-gradient accumulation only where every linear can run it: TE's modules fuse on their own, but
    the output layer is Megatron's ColumnParallelLinear, which needs apex's kernel (as Megatron-LM, switched off
    with a line when it does not import)."""
    if not (te and getattr(args, "gradient_accumulation_fusion", True)):
        return False
    if not platform.grad_accum_fusion_kernel():
        _say_once("gradient-accumulation fusion off: apex's fused_weight_gradient_mlp_cuda does not import "
                  "(Megatron's output layer needs it; install apex with --cpp_ext --cuda_ext to turn it on)")
        return False
    return True


def ddp_config_kwargs(args: argparse.Namespace) -> dict:
    return dict(overlap_grad_reduce=getattr(args, "overlap_grad_reduce", False),
                overlap_param_gather=getattr(args, "overlap_param_gather", False))
