"""Process groups, Megatron-Core parallel state and seeds."""

from __future__ import annotations

import argparse
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_ext import platform


def initialize_distributed(args: argparse.Namespace):
    """Join the job's process group (torchrun's environment; a one-rank group without it) and build
    Megatron-Core's tensor/pipeline/expert/context/data groups."""
    if not dist.is_initialized():
        if not platform.bridge_needed():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:  # torchrun / SLURM launcher
            dist.init_process_group(backend=platform.dist_backend(), timeout=timedelta(minutes=10))
        else:  # plain `python script.py`: a one-rank group, without leaking launcher variables to children
            dist.init_process_group(backend=platform.dist_backend(), init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timedelta(minutes=10))
    if dist.get_world_size() != args.world_size:
        raise RuntimeError(f"flags were validated for world size {args.world_size} but the job has "
                           f"{dist.get_world_size()} ranks")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    set_seed(args.seed)
    if getattr(args, "save", None):  # the first save need not wait for the writer's spawned helper
        from megatron_ext.training.checkpointing import start_writer_queue

        start_writer_queue()


def set_seed(seed: int):
    """Same seed on every rank; Megatron's tracker derives the tensor- and expert-parallel streams."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    # On the CPU the "CUDA" generator is the CPU one (platform.py); reseat it so initialisation starts from
    # the job seed whatever model_parallel_cuda_manual_seed left in it.
    torch.manual_seed(seed)


def destroy():
    """Tear down the process groups and the process-global loss trackers a run fills, so that another run in the
    same process (benchmarks, notebooks, tests) starts clean: Megatron-Core's MTP and MoE trackers keep losses that
    no step logged (a training-mode forward outside a step) and the groups they reduce over."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_ext.mtp import distill

    MTPLossLoggingHelper.tracker.clear()
    get_moe_layer_wise_logging_tracker().clear()
    distill.clear_metrics()
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
