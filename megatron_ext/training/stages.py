"""Continued-pretraining stages as flags: `--stage pretrain | extend | sft`.

pretrain   trains on token data (the recipe's 32K stage); `--load` resumes it.
extend     continues from the previous stage's checkpoint (`--load`) at a longer `--seq-length` (the 256K stage):
           the architecture comes from the checkpoint, YaRN is set so that original_max_position_embeddings x
           rotary_scaling_factor covers the new length (Megatron-Core derives the attention scale from the factor
           and mscale_all_dim), and the optimizer state and schedule start fresh unless --stage-keep-optimizer.
sft        continues from the previous stage's checkpoint on a chat JSONL file (loss on assistant tokens, packed).

A stage that was interrupted resumes from its own `--save` directory (optimizer, schedule, iteration) rather than
restarting from the previous stage; this is decided once, here, before the model is built.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

STAGES = ("pretrain", "extend", "sft")


class StageError(ValueError):
    pass


def add_stage_args(group: argparse._ArgumentGroup):
    group.add_argument("--stage", default=None, choices=STAGES,
                       help="continued-pretraining stage: pretrain (token data), extend (longer --seq-length with "
                            "YaRN, from --load), sft (chat JSONL, from --load); see examples/")
    group.add_argument("--stage-keep-optimizer", action="store_true",
                       help="extend/sft: continue the previous stage's optimizer state and iteration count instead "
                            "of starting them fresh")


def prepare(args: argparse.Namespace):
    """Before the architecture is resolved: check the stage's prerequisites, decide where to load from.

    Returns the previous stage's architecture (extend/sft), which then serves as the base that flags override."""
    from megatron_ext.training.checkpointing import CheckpointError, checkpoint_arch, read_tracker

    args.stage_resume = False
    args.stage_previous = None
    stage = args.stage
    if stage is None or args.dry_run:  # a dry run shows the configuration: no data or previous stage needed
        return None
    if stage == "pretrain":
        if args.sft:
            raise StageError("--stage pretrain trains on token data; for chat data use --stage sft")
        if not (args.mock_data or args.data_path):
            raise StageError("--stage pretrain needs data: --data-path PREFIX (tools/preprocess_data.py) with "
                             "--tokenizer-model, or --mock-data")
        return None
    if not args.load:
        raise StageError(f"--stage {stage} continues the previous stage: give its checkpoint with --load DIR")
    if stage == "sft":
        if args.mock_data or not args.data_path:
            raise StageError("--stage sft needs --data-path CHAT.jsonl (one conversation per line) and "
                             "--tokenizer-model")
        args.sft = True
    elif args.sft:
        raise StageError("--stage extend trains on token data; --sft belongs to --stage sft")
    elif not (args.mock_data or args.data_path):
        raise StageError("--stage extend needs data: --data-path PREFIX with --tokenizer-model, or --mock-data")
    if args.finetune:
        raise StageError(f"--stage {stage} already starts from the weights of --load; drop --finetune")
    if args.save and os.path.abspath(args.save) != os.path.abspath(args.load) and read_tracker(args.save):
        # This stage was interrupted: its own checkpoints carry the optimizer, schedule and iteration.
        args.stage_previous, args.load, args.stage_resume = args.load, args.save, True
        args.mtp_attach = False  # MTP layers attached at this stage's start are in its own checkpoints
    else:
        if read_tracker(args.load) is None:
            raise StageError(f"--stage {stage}: no checkpoint under --load {args.load} (no "
                             "latest_checkpointed_iteration.txt); run the previous stage with --save there first")
        args.stage_previous = args.load
        args.finetune = not args.stage_keep_optimizer
    try:
        return checkpoint_arch(args.load)
    except CheckpointError as e:
        raise StageError(f"--stage {stage}: {e}") from e


def configure(args: argparse.Namespace, arch, previous: Optional[object]):
    """After flags are applied to the previous stage's architecture: make the extension's YaRN consistent."""
    if args.stage != "extend" or args.stage_resume or previous is None:
        return arch
    if arch.seq_length <= previous.seq_length:
        raise StageError(f"--stage extend raises the context: --seq-length {arch.seq_length} must exceed the "
                         f"previous stage's {previous.seq_length}")
    original = arch.original_max_position_embeddings
    factor = arch.rotary_scaling_factor
    if args.rotary_scaling_factor is None and original * factor < arch.seq_length:
        factor = arch.seq_length / original
    if original * factor < arch.seq_length:
        raise StageError(f"--rotary-scaling-factor {factor:g} x --original-max-position-embeddings {original} = "
                         f"{original * factor:g} positions do not cover --seq-length {arch.seq_length}; drop "
                         "--rotary-scaling-factor to have it set, or raise it")
    if arch.mscale != arch.mscale_all_dim:
        raise StageError(f"--mscale {arch.mscale:g} differs from --mscale-all-dim {arch.mscale_all_dim:g}: the rotary "
                         "embedding would be rescaled by their ratio; keep them equal (Kimi/DeepSeek use 1.0)")
    max_positions = max(arch.max_position_embeddings, math.ceil(original * factor))
    return arch.replace(rope_type="yarn", rotary_scaling_factor=factor, max_position_embeddings=max_positions)


def serving_context(arch, length: int):
    """The architecture to serve with a context of `length` tokens (tools/serve.py --inference-max-seq-length), and
    a line saying what changed. Shorter than trained: only the limit. Longer: only for YaRN models, by YaRN's rule
    (as `configure` extends): the factor grows so that original_max_position_embeddings x factor covers `length`,
    which also raises the attention scale (`attention_scale_factor`). The model never trained at the new factor, so
    positions inside the trained context see slightly changed rotary frequencies: YaRN's inference-time extension,
    sound for modest factors; measure it with codebase NLL (tools/run_eval.py nll) at both settings when it
    matters. A plain-RoPE model is refused: positions past its trained context were never seen."""
    if length < 1:
        raise StageError(f"--inference-max-seq-length must be >= 1, got {length}")
    trained = arch.max_position_embeddings
    if length <= trained:
        return arch.replace(max_position_embeddings=length), f"serving context {length} tokens (trained: {trained})"
    if arch.rope_type != "yarn":
        raise StageError(f"--inference-max-seq-length {length} exceeds the model's trained context of {trained} "
                         "tokens and its rotary embedding is plain RoPE (--position-embedding-type rope): positions "
                         "past the trained context were never seen; serve at most that, or extend the model first "
                         "(--stage extend)")
    original, factor = arch.original_max_position_embeddings, arch.rotary_scaling_factor
    new_factor = max(factor, length / original)
    out = arch.replace(max_position_embeddings=length, rotary_scaling_factor=new_factor)
    return out, (f"serving context {trained} -> {length} tokens: YaRN factor {factor:g} -> {new_factor:g} (original "
                 f"{original}), attention scale x{attention_scale_factor(arch):.4f} -> "
                 f"x{attention_scale_factor(out):.4f}; the model was trained at factor {factor:g}")


def attention_scale_factor(arch) -> float:
    """YaRN's multiplier on MLA's softmax scale: (0.1 mscale_all_dim ln(factor) + 1)^2 (1 when factor <= 1)."""
    if arch.rope_type != "yarn" or arch.rotary_scaling_factor <= 1:
        return 1.0
    return (0.1 * arch.mscale_all_dim * math.log(arch.rotary_scaling_factor) + 1.0) ** 2


def describe(args: argparse.Namespace, previous) -> str:
    """One log line saying what the stage starts from and what it changed."""
    arch = args.arch
    if args.stage in (None, "pretrain"):
        return f"stage {args.stage or 'pretrain'}: seq length {arch.seq_length}"
    if args.stage_resume:
        return f"stage {args.stage}: resuming this stage from {args.load} (previous stage: {args.stage_previous})"
    parts = [f"stage {args.stage}: from {args.stage_previous}"]
    if args.stage == "extend":
        parts.append(f"seq length {previous.seq_length} -> {arch.seq_length}, YaRN factor "
                     f"{previous.rotary_scaling_factor:g} -> {arch.rotary_scaling_factor:g} (original "
                     f"{arch.original_max_position_embeddings}), attention scale x{attention_scale_factor(arch):.4f}")
    parts.append("optimizer state and schedule " + ("kept" if args.stage_keep_optimizer else "start fresh"))
    return "; ".join(parts)

