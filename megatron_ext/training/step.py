"""Model and optimizer set-up and one training step, all through Megatron-Core.

`setup_model_and_optimizer` builds this rank's pipeline stage with `model_provider`, wraps it in Megatron-Core's
`DistributedDataParallel` and builds `get_megatron_optimizer` (optionally the distributed optimizer);
`train_step` runs `get_forward_backward_func` over the micro-batches of one global batch, lets
`finalize_model_grads` reduce gradients (DP, SP-marked norms, tied embeddings, expert bias) and steps.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker,
                                                     track_moe_metrics)
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from megatron_ext import gpu
from megatron_ext.models.provider import model_provider, transformer_config
from megatron_ext.mtp import distill


def build_model(args: argparse.Namespace, wrap_ddp: bool = True,
                init_fn: Callable[[torch.nn.Module], None] | None = None) -> list[torch.nn.Module]:
    """This rank's model chunk; `init_fn` may rewrite its weights before DDP copies them into its buffers."""
    config = transformer_config(args)
    # Megatron-Core sizes its process-wide aux-loss tracker by the first model's layer count; a later model in the
    # same process (MTP attached, a reference policy, tests) may have more MoE layers.
    get_moe_layer_wise_logging_tracker().clear()
    model = model_provider(
        args,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        config=config,
    )
    if init_fn is not None:
        init_fn(model)
    if not wrap_ddp:
        return [model]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        **gpu.ddp_config_kwargs(args),
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    ddp.broadcast_params()  # identical data-parallel replicas even if initialisation drew different numbers
    return [ddp]


def build_optimizer(args: argparse.Namespace, model: list[torch.nn.Module]):
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model)


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Megatron-Core's scheduler, counted in samples as Megatron-LM does (it steps by the global batch)."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=max(args.lr_decay_iters, 1) * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(args.train_iters, 1) * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=(args.lr_wsd_decay_iters or 0) * gbs or None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def setup_model_and_optimizer(args: argparse.Namespace, init_fn=None):
    model = build_model(args, init_fn=init_fn)
    optimizer = build_optimizer(args, model)
    cfg = model[0].config
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = optimizer.scale_loss
    if getattr(args, "overlap_grad_reduce", False):
        # As Megatron-LM's training loop: the schedule runs all but the last micro-batch under no_sync, so DDP
        # launches a bucket's reduce in the last backward whatever the step's micro-batch count (RL packs a
        # different number each step); without it DDP counts gradient arrivals against the first step's count.
        no_sync = [chunk.no_sync for chunk in model]
        grad_sync = [chunk.start_grad_sync for chunk in model]
        cfg.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
        cfg.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    return model, optimizer


def train_step(forward_step_func: Callable, data_iterator: Iterator, model: list[torch.nn.Module], optimizer,
               args: argparse.Namespace, num_microbatches: int) -> dict:
    """One optimizer step over a global batch.

    Returns the step's losses (global-batch means, the same on every rank), the gradient norm before clipping
    and whether the update was skipped: a NaN/Inf loss or gradient norm skips it, leaving weights and optimizer
    state untouched (Megatron-Core has already updated the expert bias from the step's routing counts).
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    outputs = run_schedule(forward_step_func, data_iterator, model, args, num_microbatches, forward_only=False)
    losses = step_losses(outputs, model[0].config, num_microbatches)
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    finite = not found_inf and math.isfinite(grad_norm) and all(math.isfinite(v) for v in losses.values())
    if finite:
        _clip_grads(optimizer, grad_norm)
        finite = optimizer.step_with_ready_grads()
    return {"losses": losses, "grad_norm": grad_norm, "skipped": not finite}


def run_schedule(forward_step_func, data_iterator, model, args, num_microbatches: int, forward_only: bool):
    """Megatron-Core's schedule for this pipeline layout over the micro-batches of one global batch; public for
    loops that run their own forward-only passes over a batch (RL's reference and old-policy log-probabilities)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )


def _clip_grads(optimizer, grad_norm: float):
    """Clip by the global norm already computed (what MegatronOptimizer.step does after its own norm)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, opt.config.clip_grad, grad_norm,
                                         opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


@torch.no_grad()
def eval_step(forward_step_func: Callable, data_iterator: Iterator, model: list[torch.nn.Module],
              args: argparse.Namespace, num_microbatches: int) -> dict[str, float]:
    """Forward-only losses over one global batch; auxiliary-loss trackers are left as they were found empty."""
    for chunk in model:
        chunk.eval()
    outputs = run_schedule(forward_step_func, data_iterator, model, args, num_microbatches, forward_only=True)
    for chunk in model:
        chunk.train()
    clear_aux_losses_tracker()
    losses = [None]
    if parallel_state.is_pipeline_last_stage():
        losses = [_token_means(outputs)]
    _broadcast_from_last_stage(losses)
    return losses[0]


def _token_means(outputs: list[dict]) -> dict[str, float]:
    """Each loss's (sum, tokens) over the micro-batches and data-parallel ranks as a mean: one all-reduce and one
    read back to the host for all of them (a read per loss is a device sync per loss on a GPU)."""
    names = sorted(outputs[0]) if outputs else []
    if not names:
        return {}
    sums = torch.stack([torch.stack([o[name] for o in outputs]).sum(0).float() for name in names])
    torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return dict(zip(names, (sums[:, 0] / sums[:, 1]).tolist()))


def _broadcast_from_last_stage(box: list):
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                                group=parallel_state.get_pipeline_model_parallel_group())


def step_losses(outputs: list[dict], config, num_microbatches: int) -> dict[str, float]:
    """The step's losses as Megatron logs them, identical on every rank.

    LM losses are token-weighted means over the micro-batches and data-parallel ranks; MoE load-balancing and
    MTP losses come from Megatron-Core's trackers, averaged over layers and micro-batches.
    """
    totals: dict = {}
    if config.num_moe_experts:
        # Collective over the model-parallel ranks: every rank takes part.
        track_moe_metrics(loss_scale=1.0 / num_microbatches, iteration=0, total_loss_dict=totals,
                          num_layers=config.num_layers, moe_layer_freq=config.moe_layer_freq,
                          mtp_num_layers=config.mtp_num_layers)
        clear_aux_losses_tracker()
    losses = [None]
    if parallel_state.is_pipeline_last_stage():
        totals.update(_token_means(outputs))
        if config.mtp_num_layers:
            MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0 / num_microbatches, iteration=0, writer=None,
                                                   total_loss_dict=totals)
            totals.update(distill.pop_metrics(num_microbatches))
        losses = [{k: float(v) for k, v in totals.items()}]
    _broadcast_from_last_stage(losses)
    return losses[0]
