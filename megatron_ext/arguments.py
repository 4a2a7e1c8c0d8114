"""Command-line flags shared by every entry script, with Megatron-LM's names where the meaning is the same.

`--model PRESET` picks an architecture (models/presets.py); any architecture flag given explicitly overrides the
preset's field. `validate_args` checks flag combinations before anything is built and names the flag to fix.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Iterable, Optional

from megatron_ext import gpu, platform
from megatron_ext.training import stages
from megatron_ext.models import attn_residuals
from megatron_ext.models.presets import ARCH_FLAGS, ARCH_SWITCHES, PRESETS, ModelPreset, get_preset, parse_layer_pattern


class ArgumentError(ValueError):
    """A bad flag or flag combination; the message names the flag and the fix."""


# Architecture flags live with the preset fields they set (models/presets.py), so that checkpointing can name
# them without importing this module.
_ARCH_FLAGS = ARCH_FLAGS


def _add_model_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("model", "architecture; --model picks a preset, other flags override it")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="architecture preset")
    for flag, (_, typ, help_) in _ARCH_FLAGS.items():
        g.add_argument(flag, type=typ, default=None, help=help_ + " (default: from --model)")
    g.add_argument("--moe-router-enable-expert-bias", dest="moe_router_enable_expert_bias",
                   action=argparse.BooleanOptionalAction, default=None,
                   help="aux-loss-free balancing: a non-learned per-expert bias used only to select experts")
    g.add_argument("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="separate output layer (default: from --model)")
    g.add_argument("--mla-nope", action=argparse.BooleanOptionalAction, default=None,
                   help="MLA layers without positional encoding, as in Kimi Linear (default: from --model)")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall", choices=["allgather", "alltoall", "flex"],
                   help="how tokens reach their experts under expert parallelism (flex: DeepEP / HybridEP kernels, "
                        "--moe-flex-dispatcher-backend)")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="grouped GEMM experts (GPU)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="step size of the expert-bias update")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times the tensor-parallel size")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal weight init")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="dropout on attention probabilities")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout after attention and MLP")
    g.add_argument("--transformer-impl", default=None, choices=["transformer_engine", "local"],
                   help="module backend (default: transformer_engine where importable with CUDA, else local)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="weight of the summed MTP losses relative to the main LM loss")
    g.add_argument("--mtp-loss", default="self-distill", choices=["self-distill", "ce"],
                   help="MTP objective: KL to the main head's distribution at the target position (the Composer 2 "
                        "recipe) or Megatron-Core's hard-label cross-entropy")
    g.add_argument("--mtp-distill-temperature", type=float, default=1.0,
                   help="temperature of both distributions in the MTP self-distillation KL")
    g.add_argument("--mtp-detach-trunk", action="store_true",
                   help="keep MTP gradients inside the MTP layers (trunk, embedding and head untouched; used in RL)")


def _add_parallel_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("parallelism", "data parallelism is what remains of the world size")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="shard activations along the sequence between tensor-parallel ranks (needs TP > 1)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="pipeline stages")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="expert-parallel ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside each expert (default: 1 when EP > 1, else the TP size)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="context-parallel ranks, each holding two load-balanced chunks of every sequence; with "
                        "--transformer-impl local the MLA KV latent is all-gathered (any process-group backend), "
                        "with transformer_engine Transformer Engine's attention does it")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state and master weights across data-parallel ranks")


def _add_precision_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations, fp32 master weights")
    g.add_argument("--fp8-format", default=None, choices=["e4m3", "hybrid"],
                   help="FP8 through Transformer Engine (GPU only)")
    g.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
                   help="FP8 scaling recipe")


def _add_training_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2, help="samples per micro-batch per rank")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: micro batch size x data-parallel size)")
    g.add_argument("--train-iters", type=int, default=None, help="optimizer steps (or give --train-samples)")
    g.add_argument("--train-samples", type=int, default=None, help="samples to train on; sets --train-iters")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving if --save is set) when the iteration is a multiple of this")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                   help="adam is AdamW (decoupled weight decay)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay")
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine", "WSD",
                                                                  "inverse-square-root"],
                   help="learning-rate schedule after warm-up")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="decay steps (default: --train-iters)")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"], help="WSD's final decay shape")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD: steps of the final decay")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0: off)")
    g.add_argument("--max-skipped", type=int, default=10,
                   help="abort after this many consecutive steps skipped for a NaN/Inf loss or grad norm")
    g.add_argument("--seed", type=int, default=1234, help="random seed")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of a dataset")
    g.add_argument("--dry-run", action="store_true",
                   help="print the configuration and parameter counts without building the model")
    g.add_argument("--eval-interval", type=int, default=None, help="iterations between validation runs")
    g.add_argument("--eval-iters", type=int, default=10, help="validation batches per evaluation")
    stages.add_stage_args(g)


def _add_checkpoint_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("checkpointing", "Megatron-Core dist_checkpointing, reshardable across layouts")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    g.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; optimizer, scheduler and iteration start fresh")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the random-number-generator state")
    g.add_argument("--no-save-optim", action="store_true", help="save model weights only")
    g.add_argument("--mtp-attach", action="store_true",
                   help="load a checkpoint without MTP layers and add --mtp-num-layers fresh ones (weights only)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the architecture from the --load checkpoint (e.g. one made by "
                        "tools/convert_checkpoint.py import); other architecture flags still override it")
    _add_checkpoint_safety_args(g)
    _add_checkpoint_format_args(g)


def _add_checkpoint_format_args(g):
    """Megatron-LM's checkpoint-format flags and defaults (issue 27 item 9)."""
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="save the distributed optimizer's state per parameter, loadable under any TP/PP/EP/DP, by "
                        "gathering each data-parallel group's state on one rank at every save (default: "
                        "dp_reshardable, each rank writes its own buffer shards; only the DP size may change)")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false",
                   help="let the first data-parallel replica write all of its shards instead of spreading the "
                        "writes over every data-parallel rank")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="each data-parallel rank reads a part of the checkpoint and the ranks exchange the rest "
                        "(fewer reads of shared storage on large runs)")


def _add_checkpoint_safety_args(g):
    """Resume intent and integrity (issue 11): what to do when flags and checkpoint disagree."""
    g.add_argument("--load-optional", action="store_true",
                   help="a --load directory that does not exist means: start from scratch (without this, a "
                        "missing --load is an error unless it is also --save, the usual resumable-job setup)")
    g.add_argument("--override-save", action="store_true",
                   help="start over in a --save directory that already holds checkpoints (without --load of that "
                        "directory): this run's checkpoints replace those of the same iteration. Without it such a "
                        "run is refused, as it would overwrite them")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on resume, take the learning-rate schedule (--lr, --min-lr, --lr-*) from the flags "
                        "instead of the checkpoint")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on resume, keep the checkpoint's learning-rate schedule even where the flags differ")
    g.add_argument("--skip-checkpoint-checksums", action="store_true",
                   help="on load, check only the sizes of the checkpoint's files, not their CRC-32 (saves reading "
                        "the whole checkpoint once, e.g. for very large checkpoints on trusted storage)")


def _add_logging_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1, help="iterations between log lines")
    g.add_argument("--tensorboard-dir", default=None, help="write TensorBoard scalars here")
    g.add_argument("--inject-nan-iterations", type=int, nargs="*", default=[],
                   help="fault injection: make the loss NaN at these iterations (tests the skip logic)")


class _Parser(argparse.ArgumentParser):
    """Reads flag files given as @FILE (examples/*.args): whitespace-separated flags, '#' starts a comment."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        return arg_line.split("#", 1)[0].split()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help`: the description keeps its line breaks (the usage examples), and a flag's default is shown only
    when there is one (not None/False) and its help does not already say it (e.g. "from --model")."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "(default:" in text or not action.option_strings or default is None
                or default is False or default == argparse.SUPPRESS or default == []):
            return text
        return text + " (default: %(default)s)"


def build_parser(description: str = "", extra: Iterable[Callable[[argparse.ArgumentParser], None]] = ()):
    parser = _Parser(description=description, allow_abbrev=False, fromfile_prefix_chars="@",
                     formatter_class=HelpFormatter)
    for add in (_add_model_args, _add_parallel_args, _add_precision_args, _add_training_args,
                _add_checkpoint_args, _add_logging_args, _add_data_args, gpu.add_gpu_args, *extra):
        add(parser)
    return parser


def resolve_preset(args: argparse.Namespace, base: Optional[ModelPreset] = None) -> ModelPreset:
    """The effective architecture: the preset (or `base`, e.g. read from a HF config) with every explicitly
    given flag applied."""
    preset = base or get_preset(args.model)
    changes = {}
    for flag, (field, _, _) in _ARCH_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            changes[field] = value
    for field in ARCH_SWITCHES:
        if getattr(args, field, None) is not None:
            changes[field] = getattr(args, field)
    # 0 switches optional parts off, as a flag cannot say None.
    for field in ("q_lora_rank", "num_experts", "moe_shared_expert_intermediate_size"):
        if changes.get(field) == 0:
            changes[field] = None
    if changes.get("attention_residuals") == "none":
        changes["attention_residuals"] = None
    return preset.replace(**changes)


def parse_args(argv: Optional[list[str]] = None, description: str = "", extra=(),
               world_size: Optional[int] = None, base_arch: Optional[ModelPreset] = None) -> argparse.Namespace:
    """Parse, fill in the preset, derive sizes, validate. Raises ArgumentError on a bad combination."""
    parser = build_parser(description, extra)
    args = parser.parse_args(argv)
    finalize_args(args, world_size, base_arch)
    return args


def finalize_args(args: argparse.Namespace, world_size: Optional[int] = None,
                  base_arch: Optional[ModelPreset] = None) -> argparse.Namespace:
    _validate_ranges(args)
    if getattr(args, "use_checkpoint_args", False) and base_arch is None:
        if not args.load:
            _fail("--use-checkpoint-args needs --load DIR")
        from megatron_ext.training.checkpointing import CheckpointError, checkpoint_arch

        _validate_load_dir(args)
        try:
            base_arch = checkpoint_arch(args.load)
        except CheckpointError as e:
            _fail(str(e))
    try:
        previous = stages.prepare(args)  # extend/sft: the previous stage's checkpoint and architecture
        args.stage_previous_arch = previous
        if previous is not None:
            base_arch = previous
        _apply_tokenizer(args, base_arch)  # data: the tokenizer fixes the vocabulary size
        arch = stages.configure(args, resolve_preset(args, base_arch), previous)
    except stages.StageError as e:
        _fail(str(e))
    args.arch = arch
    # Expose the effective architecture under the flag names, so code reads args.hidden_size etc.
    for flag, (field, _, _) in _ARCH_FLAGS.items():
        setattr(args, flag[2:].replace("-", "_"), getattr(arch, field))
    args.moe_router_enable_expert_bias = arch.moe_router_enable_expert_bias
    args.untie_embeddings_and_output_weights = arch.untie_embeddings_and_output_weights
    args.mla_nope = arch.mla_nope
    if args.transformer_impl is None:
        args.transformer_impl = platform.default_transformer_impl()
    args.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = 1 if args.expert_model_parallel_size > 1 else args.tensor_model_parallel_size
    validate_args(args)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    _validate_batch(args)
    _validate_training(args)
    _validate_data(args)
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    return args


def _validate_training(args: argparse.Namespace):
    if args.train_samples is not None:
        if args.train_iters is not None:
            _fail("give either --train-iters or --train-samples, not both")
        args.train_iters = -(-args.train_samples // args.global_batch_size)
    if args.train_iters is None:
        args.train_iters = 10
    if args.train_iters < 0:
        _fail(f"--train-iters must be >= 0, got {args.train_iters}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters > args.lr_decay_iters:
        _fail(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters {args.lr_decay_iters}")
    if args.lr_decay_style == "WSD" and not args.lr_wsd_decay_iters:
        _fail("--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final decay)")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if args.save_interval is not None and args.save is None:
        _fail("--save-interval needs --save DIR")
    for flag in ("save_interval", "exit_interval", "eval_interval", "log_interval"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            _fail(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.finetune and not args.load:
        _fail("--finetune needs --load DIR (the weights to start from)")
    _validate_load_dir(args)
    if args.max_skipped < 1:
        _fail(f"--max-skipped must be >= 1, got {args.max_skipped}")


def _validate_ranges(args: argparse.Namespace):
    """Values that would otherwise fail deep inside (ZeroDivisionError, a misleading --min-lr message)."""
    for flag in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad"):
        value = getattr(args, flag)
        if not math.isfinite(value) or value < 0:
            _fail(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}"
                  + (" (0 switches clipping off)" if flag == "clip_grad" else ""))
    for flag in ("micro_batch_size", "global_batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            _fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "override_opt_param_scheduler", False) and \
            getattr(args, "use_checkpoint_opt_param_scheduler", False):
        _fail("--override-opt_param-scheduler (use the flags) and --use-checkpoint-opt_param-scheduler (use the "
              "checkpoint) exclude each other; pick one")


def _validate_load_dir(args: argparse.Namespace):
    """A --load that does not exist is a typo more often than a first run: refuse it unless the intent is clear."""
    if args.load and not os.path.isdir(args.load) and not getattr(args, "load_optional", False) and \
            not getattr(args, "dry_run", False) and not (args.save and os.path.abspath(args.save) == os.path.abspath(args.load)):
        what = "is not a directory" if os.path.exists(args.load) else "does not exist"
        _fail(f"--load {args.load} {what}: check the path, or pass --load-optional to start from scratch when "
              "it is missing (a --load that equals --save may be missing on a job's first run)")


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _fail(msg: str):
    raise ArgumentError(msg)


def validate_args(args: argparse.Namespace):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, etp, cp = args.expert_model_parallel_size, args.expert_tensor_parallel_size, args.context_parallel_size
    world = args.world_size
    arch: ModelPreset = args.arch
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--vocab-size", "--seq-length",
                 "--max-position-embeddings"):
        value = getattr(arch, _ARCH_FLAGS[flag][0])
        if value < 1:
            _fail(f"{flag} must be >= 1, got {value}")
    # A dry run has no launcher: the number of ranks the flags are meant for comes from WORLD_SIZE.
    ranks = ("the number of ranks (a --dry-run reads it from WORLD_SIZE, e.g. WORLD_SIZE=512)"
             if getattr(args, "dry_run", False) and "WORLD_SIZE" not in os.environ else "the number of ranks")
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp),
                        ("--context-parallel-size", cp)):
        if value < 1:
            _fail(f"{flag} must be >= 1, got {value}")
    if world % (tp * pp * cp):
        _fail(f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
              f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {tp * pp * cp}; "
              f"change the parallel sizes or {ranks}")
    if world % (ep * etp * pp):
        _fail(f"world size {world} is not divisible by --expert-model-parallel-size {ep} x "
              f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size {pp} = {ep * etp * pp}; "
              f"change the expert-parallel sizes or {ranks}")
    if cp > 1:
        if arch.seq_length % (2 * cp):
            _fail(f"--seq-length {arch.seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp} "
                  "(each rank holds two load-balanced chunks)")
        if arch.mtp_num_layers and arch.seq_length // (2 * cp) < \
                arch.mtp_num_layers:
            _fail(f"--seq-length {arch.seq_length} / (2 x CP) is shorter than --mtp-num-layers "
                  f"{arch.mtp_num_layers}: the MTP targets must lie in the next chunk at most")
    if tp > 1 and not args.sequence_parallel:
        # Megatron-Core refuses MoE + TP without SP, and the local MLA's replicated down projections
        # (models/specs.py) have their gradients summed over TP only on the sequence-parallel path.
        _fail(f"--tensor-model-parallel-size {tp} needs --sequence-parallel for MLA and MoE layers; "
              "add --sequence-parallel")
    if args.sequence_parallel and tp == 1:
        _fail("--sequence-parallel needs --tensor-model-parallel-size > 1; drop --sequence-parallel or raise TP")
    if arch.num_attention_heads % tp:
        _fail(f"--num-attention-heads {arch.num_attention_heads} is not divisible by "
              f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count")
    try:
        gpu.pipeline_layers(arch.num_layers, pp, args.decoder_first_pipeline_num_layers,
                            args.decoder_last_pipeline_num_layers)
    except ValueError as e:
        _fail(str(e))
    if args.sequence_parallel and arch.seq_length % (tp * cp):
        _fail(f"--seq-length {arch.seq_length} must be divisible by --tensor-model-parallel-size {tp}"
              + (f" x --context-parallel-size {cp}" if cp > 1 else "") + " under --sequence-parallel")
    if arch.num_experts:
        if arch.num_experts % ep:
            _fail(f"--expert-model-parallel-size {ep} does not divide --num-experts {arch.num_experts}; "
                  "pick an EP size that divides the expert count")
        if not 1 <= arch.moe_router_topk <= arch.num_experts:
            _fail(f"--moe-router-topk {arch.moe_router_topk} must be between 1 and --num-experts "
                  f"{arch.num_experts}")
        if arch.moe_router_enable_expert_bias and arch.moe_router_score_function != "sigmoid":
            _fail("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        if not 0 <= arch.first_k_dense <= arch.num_layers:
            _fail(f"--first-k-dense-replace {arch.first_k_dense} must be between 0 and --num-layers")
    elif ep > 1:
        _fail(f"--expert-model-parallel-size {ep} needs an MoE model; set --num-experts or use EP 1")
    if arch.mtp_num_layers < 0:
        _fail(f"--mtp-num-layers must be >= 0, got {arch.mtp_num_layers}")
    if arch.rope_type not in ("rope", "yarn"):
        _fail(f"--position-embedding-type {arch.rope_type!r}: MLA supports 'rope' and 'yarn'")
    here = not getattr(args, "dry_run", False)  # a dry run checks flags meant for another machine, not this one
    if here and args.fp8_format and not platform.te_available():
        _fail(f"--fp8-format {args.fp8_format} needs Transformer Engine on a CUDA GPU; drop --fp8-format "
              "on this machine")
    if args.fp8_format and args.transformer_impl != "transformer_engine":
        _fail("--fp8-format needs --transformer-impl transformer_engine")
    if here and args.transformer_impl == "transformer_engine" and not platform.te_available():
        _fail("--transformer-impl transformer_engine needs Transformer Engine and CUDA; use "
              "--transformer-impl local")
    gpu.validate_gpu_args(args, _fail)
    attn_residuals.validate_args(args, _fail)
    if arch.seq_length > arch.max_position_embeddings:
        _fail(f"--seq-length {arch.seq_length} exceeds --max-position-embeddings {arch.max_position_embeddings}")
    _validate_hybrid(args)


def _validate_hybrid(args: argparse.Namespace):
    """The Kimi Linear flags: a pattern with one K/M per layer, KDA heads that split over TP."""
    arch: ModelPreset = args.arch
    if arch.mla_nope and arch.rope_type != "rope":
        _fail("--mla-nope needs --position-embedding-type rope (YaRN rescales positions MLA no longer uses)")
    if not arch.hybrid_layer_pattern:
        return
    try:
        pattern = parse_layer_pattern(arch.hybrid_layer_pattern, arch.num_layers)
    except ValueError as e:
        _fail(str(e))
    args.arch = arch = arch.replace(hybrid_layer_pattern=pattern)
    args.hybrid_layer_pattern = pattern
    if "K" not in pattern:
        return
    for flag in ("--kda-num-heads", "--kda-head-dim", "--kda-conv-kernel-size"):
        value = getattr(arch, _ARCH_FLAGS[flag][0])
        if value < 1:
            _fail(f"{flag} must be >= 1 for KDA layers in --hybrid-layer-pattern, got {value}")
    if arch.kda_num_heads % args.tensor_model_parallel_size:
        _fail(f"--kda-num-heads {arch.kda_num_heads} is not divisible by --tensor-model-parallel-size "
              f"{args.tensor_model_parallel_size}")


def _validate_batch(args: argparse.Namespace):
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        _fail(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
              f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}")
    if args.pipeline_model_parallel_size > 1 and args.global_batch_size // per_step < 1:
        _fail("pipeline parallelism needs at least one micro-batch per step")


# --------------------------------------------------------------------------------------------------------
# data: datasets and tokenizers (megatron_ext/data/)
# --------------------------------------------------------------------------------------------------------


def _add_data_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("data", "real datasets: tools/build_corpus.py -> tools/train_tokenizer.py -> "
                                          "tools/preprocess_data.py -> --data-path (or --mock-data)")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefixes (PREFIX.bin/.idx), optionally weighted: '0.7 a 0.3 b'; "
                        "with --sft one chat JSONL file")
    g.add_argument("--split", default="969,30,1",
                   help="train,validation,test shares of each dataset's documents, e.g. 98,1,1")
    g.add_argument("--data-cache-path", default=None,
                   help="where dataset index caches go (None: next to each dataset)")
    g.add_argument("--tokenizer-type", default=None, choices=["HFTokenizer", "TikTokenizer", "HuggingFaceTokenizer"],
                   help="tokenizer file format (None: inferred from --tokenizer-model's files)")
    g.add_argument("--tokenizer-model", default=None,
                   help="tokenizer.json / tiktoken.model or its directory; sets --vocab-size")
    g.add_argument("--sft", action="store_true",
                   help="--data-path is chat JSONL: Kimi-style template, loss on assistant tokens only, "
                        "conversations packed into --seq-length rows without attending across them")
    g.add_argument("--data-on-error", default="fail", choices=["fail", "skip"],
                   help="--sft: stop at a malformed conversation (naming its line) or skip and report it")


def _apply_tokenizer(args: argparse.Namespace, base_arch: Optional[ModelPreset] = None):
    """--tokenizer-model fixes the vocabulary: --vocab-size defaults to the tokenizer's and may not be smaller."""
    if args.tokenizer_model is None:
        if args.tokenizer_type is not None:
            _fail("--tokenizer-type needs --tokenizer-model PATH (the tokenizer file or its directory)")
        return
    from megatron_ext.data.tokenizers import TokenizerError, build_tokenizer, normalize_tokenizer_type

    try:
        args.tokenizer_type = normalize_tokenizer_type(args.tokenizer_type, args.tokenizer_model)
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    except TokenizerError as e:
        _fail(f"--tokenizer-model {args.tokenizer_model}: {e}")
    model_vocab = args.vocab_size if args.vocab_size is not None else getattr(base_arch, "vocab_size", None)
    if model_vocab is None:
        args.vocab_size = tokenizer.vocab_size
    elif model_vocab < tokenizer.vocab_size:
        _fail(f"--vocab-size {model_vocab} is smaller than the {tokenizer.vocab_size} ids of --tokenizer-model "
              f"{args.tokenizer_model}; drop --vocab-size to take the tokenizer's, or raise it")


def _validate_data(args: argparse.Namespace):
    from megatron_ext.data.gpt import parse_data_path, parse_split

    if args.mock_data and args.data_path:
        _fail("--mock-data and --data-path exclude each other; drop one of them")
    try:
        shares = parse_split(args.split)
        prefixes, weights = parse_data_path(args.data_path) if args.data_path else ([], None)
    except ValueError as e:
        _fail(str(e))
    if args.data_path and not args.tokenizer_model:
        _fail("--data-path needs --tokenizer-model (the tokenizer the data was preprocessed with)")
    if args.sft:
        if len(prefixes) != 1 or weights:
            _fail("--sft takes exactly one chat JSONL file as --data-path")
        if args.pipeline_model_parallel_size > 1 and args.micro_batch_size > 1:
            _fail("--sft packs a micro-batch into one sequence; with --pipeline-model-parallel-size > 1 use "
                  "--micro-batch-size 1")
    if args.data_path:
        if shares[0] == 0 and args.train_iters > 0:
            _fail(f"--split {args.split} gives training no share; e.g. --split 98,1,1")
        if args.eval_interval and shares[1] == 0:
            _fail(f"--eval-interval needs a validation share in --split (got {args.split}); e.g. --split 98,1,1")


def require_dataset(args: argparse.Namespace):
    """Training needs data; dry runs and model tests do not, so this is the entry script's check."""
    if not (args.mock_data or args.data_path):
        _fail("no dataset given: pass --data-path PREFIX (from tools/preprocess_data.py) with --tokenizer-model, "
              "or --mock-data")
