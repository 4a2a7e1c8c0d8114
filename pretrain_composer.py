"""Continued pretraining of Kimi K2.5 (and its tiny CPU variants) on Megatron-Core.

    torchrun --nproc-per-node 2 pretrain_composer.py --model tiny --mock-data --tensor-model-parallel-size 2
    python pretrain_composer.py --model kimi-k2.5 --dry-run
"""

from __future__ import annotations

import sys
from functools import partial

import torch

import megatron_ext  # noqa: F401  (installs the CPU bridges before Megatron-Core is used)
from megatron.core import parallel_state

from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.data.mock import mock_microbatches
from megatron_ext.models.provider import print_parameter_counts
from megatron_ext.training.checkpointing import CheckpointError
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.loop import TrainingAborted, pretrain


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses and the token count; the schedule divides, the logger averages."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def train_data_iterator(args, iteration: int):
    """Mock micro-batches of `iteration` for this rank's data-parallel slot (real datasets: the data pipeline)."""
    return mock_microbatches(iteration, args.global_batch_size, args.micro_batch_size,
                             parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                             args.seq_length, args.vocab_size, args.seed)


def valid_data_iterator(args, k: int):
    """The k-th validation batch: mock samples from a stream disjoint from training's."""
    return mock_microbatches(k, args.global_batch_size, args.micro_batch_size,
                             parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                             args.seq_length, args.vocab_size, args.seed + 1_000_000)


def main(argv=None):
    try:
        args = parse_args(argv, description=__doc__)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_parameter_counts(args)
        return 0
    if not args.mock_data:
        print("error: no dataset given; pass --mock-data (real datasets arrive with the data pipeline)",
              file=sys.stderr)
        return 2
    initialize_distributed(args)
    log = print if torch.distributed.get_rank() == 0 else (lambda *a, **k: None)
    print_parameter_counts(args, log)
    try:
        pretrain(args, forward_step, partial(train_data_iterator, args), partial(valid_data_iterator, args),
                 log=log)
    except (TrainingAborted, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        destroy()
        return 1
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
