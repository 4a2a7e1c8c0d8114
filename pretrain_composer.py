r"""Continued pretraining of Kimi K2.5 (and its tiny CPU variants) on Megatron-Core.

    torchrun --nproc-per-node 2 pretrain_composer.py --model tiny --mock-data --tensor-model-parallel-size 2
    python pretrain_composer.py --model tiny --data-path data/stdlib_text_document --split 98,1,1 \
        --tokenizer-type HFTokenizer --tokenizer-model data/tokenizer
    python pretrain_composer.py --model kimi-k2.5 --dry-run
    torchrun --nproc-per-node 2 pretrain_composer.py --stage extend --load ckpt/pretrain --save ckpt/extend \
        --seq-length 1024 --context-parallel-size 2 ...      (stages: examples/*.args)
"""

from __future__ import annotations

import sys
from functools import partial

import torch

import megatron_ext  # noqa: F401  (installs the CPU bridges before Megatron-Core is used)

from megatron_ext.arguments import ArgumentError, parse_args, require_dataset
from megatron_ext.data.indexed import DataError
from megatron_ext.data.provider import build_data
from megatron_ext.data.tokenizers import TokenizerError
from megatron_ext.env.arguments import add_agent_prompt_args, sft_agent_prompt
from megatron_ext.models.provider import print_parameter_counts
from megatron_ext.training.checkpointing import CheckpointError, check_save_target
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training import stages
from megatron_ext.training.lm import forward_step, train_data_iterator, valid_data_iterator  # the LM step
from megatron_ext.training.loop import TrainingAborted, pretrain, print_args


def main(argv=None):
    try:
        args = parse_args(argv, description=__doc__, extra=(add_agent_prompt_args,))
        sft_agent_prompt(args)
    except (ArgumentError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:  # the resolved configuration (flags and architecture) and the sizes; nothing is built
        print_args(args)
        print_parameter_counts(args)
        return 0
    try:
        require_dataset(args)
        check_save_target(args)
    except (ArgumentError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    initialize_distributed(args)
    log = print if torch.distributed.get_rank() == 0 else (lambda *a, **k: None)
    print_parameter_counts(args, log)
    log(stages.describe(args, args.stage_previous_arch))
    try:
        data = build_data(args, log)  # checks every file before the model is built
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        destroy()
        return 1
    valid = partial(valid_data_iterator, args, data=data) if data.has("validation") else None
    try:
        pretrain(args, forward_step, partial(train_data_iterator, args, data=data), valid, log=log)
    except (TrainingAborted, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        destroy()
        return 1
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
