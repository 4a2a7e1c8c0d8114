"""Continued pretraining of Kimi K2.5 (and its tiny CPU variants) on Megatron-Core.

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
from megatron.core import parallel_state

from megatron_ext.arguments import ArgumentError, parse_args, require_dataset
from megatron_ext.data.indexed import DataError
from megatron_ext.data.provider import DataSources, build_data, mock_sources
from megatron_ext.data.sft import packed_batch
from megatron_ext.data.tokenizers import TokenizerError
from megatron_ext.models import context_parallel
from megatron_ext.models.provider import print_parameter_counts
from megatron_ext.training.checkpointing import CheckpointError
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training import stages
from megatron_ext.training.loop import TrainingAborted, pretrain


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses and the token count; the schedule divides, the logger averages."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}
    if context_parallel.cp_size() > 1:
        # A rank holds part of each sequence: divide by the whole sequence's token count, times CP because
        # gradients are averaged over context-parallel ranks like data-parallel ones.
        num_tokens = num_tokens.clone()
        torch.distributed.all_reduce(num_tokens, group=parallel_state.get_context_parallel_group())
        loss = loss * context_parallel.cp_size()
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    batch, packed_seq_params = packed_batch(next(data_iterator))  # packed SFT rows: one THD sequence
    batch = context_parallel.shard_batch(batch, packed_seq_params)  # this rank's chunks under CP
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    return output, partial(loss_func, batch["loss_mask"])


def train_data_iterator(args, iteration: int, data: DataSources | None = None):
    """The micro-batches of `iteration` for this rank's data-parallel slot (mock data unless `data` is given)."""
    return (data or mock_sources(args)).microbatches("train", iteration, args)


def valid_data_iterator(args, k: int, data: DataSources | None = None):
    """The k-th validation batch: the validation split, or mock samples from a stream disjoint from training's."""
    return (data or mock_sources(args)).microbatches("validation", k, args)


def main(argv=None):
    try:
        args = parse_args(argv, description=__doc__)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_parameter_counts(args)
        return 0
    try:
        require_dataset(args)
    except ArgumentError as e:
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
