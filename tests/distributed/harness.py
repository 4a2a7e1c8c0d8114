"""Run the library's LM step (megatron_ext.training.lm, which pretrain_composer.py trains with) under a parallel
layout in gloo worker processes.

Every run starts from the same layout-invariant weights (megatron_ext.testing) and sees the same global batches,
so any two layouts must produce the same losses and gradient norms up to floating-point reassociation.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import warnings
from functools import partial

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int):
    """Make this spawned process rank `rank` of a `world`-rank gloo job, as torchrun would (one thread each)."""
    warnings.filterwarnings("ignore")
    sys.path.insert(0, ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def invariant_model(flags: list[str], world: int, seed: int):
    """Parsed flags and this rank's shard of the layout-invariant model (no DDP wrapper), process groups up."""
    import megatron_ext  # noqa: F401
    from megatron_ext.arguments import parse_args
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(flags, world_size=world)
    initialize_distributed(args)
    return args, build_model(args, wrap_ddp=False, init_fn=partial(init_layout_invariant_, seed=seed))[0]


def _worker(rank: int, world: int, port: int, flags: list[str], steps: int, out: str, init_seed: int,
            batches: list | None = None, param_grads: bool = False, full_grads: bool = False):
    join(rank, world, port)
    import megatron_ext  # noqa: F401
    from megatron_ext.arguments import parse_args
    from megatron_ext.testing import gather_full_gradients, init_layout_invariant_
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.lm import forward_step, train_data_iterator
    from megatron_ext.training.step import setup_model_and_optimizer, train_step

    args = parse_args(flags, world_size=world)
    initialize_distributed(args)
    model, optimizer = setup_model_and_optimizer(args, init_fn=partial(init_layout_invariant_, seed=init_seed))
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    results = []
    for iteration in range(steps):
        data = iter(batches[iteration]) if batches else train_data_iterator(args, iteration)
        r = train_step(forward_step, data, model, optimizer, args, num_microbatches)
        results.append({"losses": r["losses"], "grad_norm": float(r["grad_norm"])})
        if param_grads:  # rank 0's reduced gradient of each parameter (whole when nothing shards it)
            results[-1]["param_grads"] = {name: float(p.main_grad.double().norm())
                                          for name, p in model[0].named_parameters()}
        if full_grads:  # every parameter's reduced gradient at its one-rank shape, keyed by checkpoint key
            grads = gather_full_gradients(model[0].module)
            if rank == 0:
                torch.save(grads, f"{out}.grads{iteration}.pt")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    destroy()


def run_layout(flags: list[str], world: int, steps: int = 2, init_seed: int = 1,
               batches: list | None = None, param_grads: bool = False, full_grads: bool = False) -> list[dict]:
    """Train `steps` steps with `flags` on `world` gloo ranks; returns per-step losses and grad norms.

    `batches[i]` (optional) lists the micro-batches of step i, given to every rank (layouts without data
    parallelism); otherwise the entry script's mock data is used. `param_grads` adds rank 0's gradient norm of
    every parameter per step; `full_grads` adds "full_grads": {checkpoint key: the step's reduced gradient at its
    one-rank shape} (gathered over all ranks; not with the distributed optimizer, whose buffers hold a shard)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(world, _free_port(), flags, steps, out, init_seed, batches, param_grads,
                                          full_grads), nprocs=world, join=True, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
        if full_grads:
            for iteration, r in enumerate(results):
                r["full_grads"] = torch.load(f"{out}.grads{iteration}.pt")
        return results


def _entry_worker(rank: int, world: int, port: int, argv: list[str]):
    join(rank, world, port)
    import contextlib
    import io

    import pretrain_composer as entry

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = entry.main(argv)
    if code:
        raise RuntimeError(f"rank {rank}: pretrain_composer.main exited with {code}: {err.getvalue()}")


def run_entry(argv: list[str], world: int):
    """pretrain_composer.main(argv) on `world` gloo ranks, as torchrun would run it."""
    mp.start_processes(_entry_worker, args=(world, _free_port(), argv), nprocs=world, join=True,
                       start_method="spawn")
