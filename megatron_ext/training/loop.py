"""The pretraining loop: steps, schedules, logging, evaluation, checkpoints, fault handling.

Entry scripts pass their forward step and data providers; everything else (Megatron-style log lines and
TensorBoard scalars, periodic and final checkpoints, resume, skipping NaN/Inf steps, saving on SIGTERM) is here.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_ext import platform
from megatron_ext.training.checkpointing import checkpoint_dir, load_checkpoint, save_checkpoint
from megatron_ext.training.step import build_scheduler, eval_step, setup_model_and_optimizer, train_step


class TrainingAborted(RuntimeError):
    """Training cannot go on (e.g. too many consecutive NaN steps); the message says where and why."""


def print_args(args: argparse.Namespace, log=print):
    log("------------------------ arguments ------------------------")
    for key in sorted(vars(args)):
        if key == "arch":
            continue
        log(f"  {key} {'.' * max(1, 48 - len(key))} {getattr(args, key)}")
    log("-------------------- end of arguments ---------------------")
    arch = getattr(args, "arch", None)
    if dataclasses.is_dataclass(arch):  # the architecture the flags resolved to (preset, checkpoint, overrides)
        log("---------------------- architecture -----------------------")
        for field in dataclasses.fields(arch):
            log(f"  {field.name} {'.' * max(1, 48 - len(field.name))} {getattr(arch, field.name)}")
        log("------------------- end of architecture -------------------")


# SIGTERM: preemption, or torchrun passing one on. SIGUSR1: SLURM's early warning before the time limit
# (`--signal=USR1@900`, forwarded by torchrun --signals-to-handle), which leaves time for a step and a save.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class SigtermWatcher:
    """Remembers a preemption signal (SIGTERM, SLURM's SIGUSR1) so a loop (this one, RL's) can save and exit cleanly
    at the next step boundary; `any_rank()` agrees on it over all ranks, `restore()` puts the previous handlers
    back."""

    def __init__(self):
        self.received = False
        self.name = "SIGTERM"
        self._previous = {sig: signal.signal(sig, self._handle) for sig in PREEMPTION_SIGNALS}

    def _handle(self, signum, frame):
        self.received = True
        self.name = signal.Signals(signum).name

    def any_rank(self) -> bool:
        # On the process group's device: NCCL rejects host tensors.
        flag = torch.tensor([1.0 if self.received else 0.0], device=platform.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def inject_nan(forward_step_func: Callable) -> Callable:
    """--inject-nan-iterations: the step's loss becomes NaN (tests of the skip logic, here and in RL)."""
    def forward_step(data_iterator, model):
        output, loss_func = forward_step_func(data_iterator, model)
        return output * float("nan"), loss_func
    return forward_step


class TrainingLogger:
    """Megatron-shaped lines every --log-interval iterations; the same scalars to TensorBoard every iteration.
    Shared by every training loop (pretraining, RL) so their logs read alike: `step`, `scalar`, `writer`, `close`."""

    def __init__(self, args: argparse.Namespace, log):
        self.args, self.log = args, log
        self.writer = None
        if args.tensorboard_dir and dist.get_rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=100)
        self._reset()

    def _reset(self):
        self.sums, self.count, self.elapsed, self.iters = {}, 0, 0.0, 0

    def scalar(self, name: str, value: float, iteration: int):
        if self.writer is not None:
            self.writer.add_scalar(name, value, iteration)

    def step(self, iteration: int, result: dict, elapsed: float, lr: float, skipped_total: int):
        args = self.args
        tokens_per_s = args.global_batch_size * args.seq_length / elapsed / args.world_size
        self.scalar("learning-rate", lr, iteration)
        self.scalar("grad-norm", result["grad_norm"], iteration)
        self.scalar("skipped-iterations", skipped_total, iteration)
        self.scalar("iteration-time", elapsed, iteration)
        self.scalar("tokens-per-second-per-rank", tokens_per_s, iteration)
        if not result["skipped"]:
            for name, value in result["losses"].items():
                self.scalar(name, value, iteration)
                self.sums[name] = self.sums.get(name, 0.0) + value
            self.count += 1
        self.elapsed += elapsed
        self.iters += 1
        if iteration % args.log_interval:
            return
        parts = [f" iteration {iteration:8d}/{args.train_iters:8d}",
                 f"consumed samples: {result.get('consumed_samples', iteration * args.global_batch_size):12d}",
                 f"elapsed time per iteration (ms): {1000 * self.elapsed / self.iters:.1f}",
                 f"learning rate: {lr:.6E}",
                 f"global batch size: {args.global_batch_size:5d}"]
        parts += [f"{name}: {total / max(self.count, 1):.6E}" for name, total in self.sums.items()]
        parts += [f"grad norm: {result['grad_norm']:.3f}", f"number of skipped iterations: {skipped_total:3d}",
                  f"tokens per second per rank: {self.iters * args.global_batch_size * args.seq_length / self.elapsed / args.world_size:.1f}"]
        self.log(" | ".join(parts), flush=True)
        self._reset()

    def validation(self, iteration: int, losses: dict):
        parts = [f" validation loss at iteration {iteration}"]
        for name, value in losses.items():
            ppl = math.exp(min(20.0, value))
            parts.append(f"{name} value: {value:.6E} | {name} PPL: {ppl:.6E}")
            self.scalar(f"{name} validation", value, iteration)
        self.log(" | ".join(parts), flush=True)

    def close(self):
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def pretrain(args: argparse.Namespace, forward_step_func: Callable, train_iterator: Callable[[int], Iterator],
             valid_iterator: Callable[[int], Iterator] | None = None, init_fn=None, log=None) -> int:
    """Train until --train-iters (or --exit-interval, or SIGTERM). Returns the last iteration reached.

    `train_iterator(iteration)` gives the micro-batches of that iteration for this rank, so resuming at any
    iteration sees exactly the data an uninterrupted run would.
    """
    rank = dist.get_rank()
    log = log or (print if rank == 0 else (lambda *a, **k: None))
    print_args(args, log)
    model, optimizer = setup_model_and_optimizer(args, init_fn=init_fn)
    scheduler = build_scheduler(args, optimizer)
    iteration = 0
    if args.load:
        iteration, _ = load_checkpoint(args, model, optimizer, scheduler, log=log)
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    logger = TrainingLogger(args, log)
    sigterm = SigtermWatcher()

    def save(iteration: int):
        t = time.perf_counter()
        save_checkpoint(args, iteration, model, optimizer, scheduler)
        log(f"saved checkpoint at iteration {iteration} to {checkpoint_dir(args.save, iteration)} "
            f"({time.perf_counter() - t:.1f} s)", flush=True)

    skipped_total = skipped_in_row = 0
    saved_at = iteration if args.load else None
    try:
        while iteration < args.train_iters:
            step_fn = forward_step_func
            if iteration + 1 in args.inject_nan_iterations:
                step_fn = inject_nan(forward_step_func)
            t0 = time.perf_counter()
            result = train_step(step_fn, train_iterator(iteration), model, optimizer, args, num_microbatches)
            iteration += 1
            if result["skipped"]:
                skipped_total += 1
                skipped_in_row += 1
            else:
                skipped_in_row = 0
                scheduler.step(increment=args.global_batch_size)
            logger.step(iteration, result, time.perf_counter() - t0, optimizer.param_groups[0]["lr"], skipped_total)
            if skipped_in_row >= args.max_skipped:
                raise TrainingAborted(
                    f"iteration {iteration}: {skipped_in_row} consecutive steps had a NaN/Inf loss or gradient "
                    f"norm (--max-skipped {args.max_skipped}); resume from the last checkpoint with a lower --lr "
                    "or inspect the data at these iterations")
            if args.eval_interval and iteration % args.eval_interval == 0 and valid_iterator is not None:
                evaluate(args, forward_step_func, valid_iterator, model, num_microbatches, logger, iteration)
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                save(iteration)
                saved_at = iteration
            if sigterm.any_rank():
                if args.save and saved_at != iteration:
                    log(f"{sigterm.name} received: saving a checkpoint at iteration {iteration} and exiting",
                        flush=True)
                    save(iteration)
                else:
                    log(f"{sigterm.name} received: exiting at iteration {iteration}"
                        f"{' (saved)' if args.save else ' (no --save: nothing kept)'}", flush=True)
                return iteration
            if args.exit_interval and iteration % args.exit_interval == 0:
                log(f"exiting at iteration {iteration} (--exit-interval {args.exit_interval})", flush=True)
                break
        if args.save and saved_at != iteration:
            save(iteration)
        return iteration
    finally:
        sigterm.restore()
        logger.close()


def evaluate(args, forward_step_func, valid_iterator, model, num_microbatches, logger, iteration):
    totals: dict = {}
    for k in range(args.eval_iters):
        for name, value in eval_step(forward_step_func, valid_iterator(k), model, args, num_microbatches).items():
            totals[name] = totals.get(name, 0.0) + value / args.eval_iters
    logger.validation(iteration, totals)
    return totals
