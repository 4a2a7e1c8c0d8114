"""Continued pretraining of Kimi K2.5 (and its tiny CPU variants) on Megatron-Core.

    torchrun --nproc-per-node 2 pretrain_composer.py --model tiny --mock-data --tensor-model-parallel-size 2
    python pretrain_composer.py --model kimi-k2.5 --dry-run
"""

from __future__ import annotations

import sys
import time
from functools import partial

import torch

import megatron_ext  # noqa: F401  (installs the CPU bridges before Megatron-Core is used)
from megatron.core import parallel_state

from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.data.mock import mock_microbatches
from megatron_ext.models.provider import print_parameter_counts
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import setup_model_and_optimizer, train_step


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
    """Mock micro-batches for this rank's data-parallel slot (real datasets arrive with the data pipeline)."""
    return mock_microbatches(iteration, args.global_batch_size, args.micro_batch_size,
                             parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                             args.seq_length, args.vocab_size, args.seed)


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
    rank = torch.distributed.get_rank()
    log = print if rank == 0 else (lambda *a, **k: None)
    print_parameter_counts(args, log)
    model, optimizer = setup_model_and_optimizer(args)
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    for iteration in range(args.train_iters):
        t0 = time.perf_counter()
        result = train_step(forward_step, train_data_iterator(args, iteration), model, optimizer, args,
                            num_microbatches)
        elapsed = (time.perf_counter() - t0) * 1000
        if (iteration + 1) % args.log_interval == 0:
            losses = " | ".join(f"{k}: {v:.6E}" for k, v in result["losses"].items())
            log(f" iteration {iteration + 1:8d}/{args.train_iters:8d} | consumed samples: "
                f"{(iteration + 1) * args.global_batch_size} | elapsed time per iteration (ms): {elapsed:.1f} | "
                f"learning rate: {args.lr:.6E} | global batch size: {args.global_batch_size} | {losses} | "
                f"grad norm: {result['grad_norm']:.3f} | number of skipped iterations: {int(result['skipped'])}",
                flush=True)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
