"""The language-model step: one micro-batch through the model and its masked next-token loss.

`forward_step(data_iterator, model)` is what Megatron-Core's `get_forward_backward_func` calls (the Megatron-LM
entry-script contract): it takes the next micro-batch (token rows, or packed SFT rows with `cu_seqlens` made one
THD sequence), moves it to the model's device, keeps this rank's chunks under context parallelism, runs the model
and returns its per-token losses with `loss_func` bound to the batch's loss mask. Entry scripts
(pretrain_composer.py) and trainers that add their own loss (RL) reuse it; `loss_func` is the reduction the
schedule and the logger expect: (masked loss sum, token count, {"lm loss": [sum, count]}).

`window_loss` evaluates saved weights on given (tokens, labels) windows on one rank (benchmarks use it).
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Iterable, Optional

import torch
from megatron.core import parallel_state

from megatron_ext import platform
from megatron_ext.data.provider import DataSources, mock_sources
from megatron_ext.data.sft import packed_batch
from megatron_ext.models import context_parallel


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


def to_device(batch: dict, packed_seq_params=None, device: Optional[torch.device] = None):
    """The batch's tensors (and the packed sequence's cu_seqlens) on `device` (default: this process's device)."""
    device = device or platform.device()
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    if packed_seq_params is not None:
        for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            value = getattr(packed_seq_params, name, None)
            if torch.is_tensor(value):
                setattr(packed_seq_params, name, value.to(device, non_blocking=True))
    return batch, packed_seq_params


def prepare_batch(raw: dict):
    """A data source's micro-batch as the model takes it: packed rows made one THD sequence, on this process's
    device, cut to this rank's chunks under context parallelism. Returns (batch, packed_seq_params or None)."""
    batch, packed_seq_params = packed_batch(raw)  # packed SFT rows: one THD sequence
    batch, packed_seq_params = to_device(batch, packed_seq_params)
    batch = context_parallel.shard_batch(batch, packed_seq_params)  # this rank's chunks under CP
    return batch, packed_seq_params


def forward_step(data_iterator, model):
    batch, packed_seq_params = prepare_batch(next(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    return output, partial(loss_func, batch["loss_mask"])


def train_data_iterator(args: argparse.Namespace, iteration: int, data: Optional[DataSources] = None):
    """The micro-batches of `iteration` for this rank's data-parallel slot (mock data unless `data` is given)."""
    return (data or mock_sources(args)).microbatches("train", iteration, args)


def valid_data_iterator(args: argparse.Namespace, k: int, data: Optional[DataSources] = None):
    """The k-th validation batch: the validation split, or mock samples from a stream disjoint from training's."""
    return (data or mock_sources(args)).microbatches("validation", k, args)


def window_loss(flags: list[str], path: str, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean per-token loss of the weights under `path`, built with `flags` on one rank, over (tokens, labels)
    batches: e.g. how YaRN changes what a model does at the context it was trained for."""
    from megatron_ext.arguments import parse_args
    from megatron_ext.training.checkpointing import load_weights
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(flags, world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)
        load_weights(args, model, path, log=lambda *a: None)
        model[0].eval()
        device = platform.device()
        total, count = 0.0, 0
        with torch.no_grad():
            for tokens, labels in batches:
                tokens, labels = tokens.to(device), labels.to(device)
                position_ids = torch.arange(tokens.size(1), device=device).expand_as(tokens)
                losses = model[0](tokens, position_ids, None, labels=labels)
                total, count = total + float(losses.sum()), count + losses.numel()
        return total / count
    finally:
        destroy()
