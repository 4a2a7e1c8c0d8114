"""Overhead of pretrain_composer.py's training step over a bare Megatron-Core GPTModel step.

Both steps run in the same process on the same tiny config and the same micro-batches:

* ours: `megatron_ext.training.step.train_step` with the LM step pretrain_composer.py trains with
  (megatron_ext.training.lm): Megatron-Core DDP buffers, `get_forward_backward_func`, the Megatron optimizer with the NaN/Inf guard, loss reduction, MoE/MTP trackers);
* bare: the GPTModel alone, forward + backward per micro-batch, `torch.nn.utils.clip_grad_norm_`,
  `torch.optim.AdamW`.

Blocks of steps alternate between the two so drifts in machine speed hit both; the figure is the ratio of
median per-step times after warm-up. Goal: <= 1.05.

    python benchmarks/step_overhead.py [--steps 20] [--rounds 5] [--micro-batch-size 4] [--global-batch-size 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_ext.training import lm  # noqa: E402
from megatron_ext.arguments import parse_args  # noqa: E402
from megatron_ext.training.initialize import destroy, initialize_distributed  # noqa: E402
from megatron_ext.training.step import build_model, setup_model_and_optimizer, train_step  # noqa: E402


def bare_step(model, optimizer, batches, clip: float):
    optimizer.zero_grad(set_to_none=True)
    for batch in batches:
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                    loss_mask=batch["loss_mask"])
        mask = batch["loss_mask"]
        loss = (out.float() * mask).sum() / mask.sum() / len(batches)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=5, help="alternating blocks of each kind")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)

    args = parse_args(["--model", "tiny", "--mock-data", "--micro-batch-size", str(opts.micro_batch_size),
                       "--global-batch-size", str(opts.global_batch_size), "--seq-length", str(opts.seq_length),
                       "--lr-decay-style", "constant"], world_size=1)
    initialize_distributed(args)
    ours_model, ours_opt = setup_model_and_optimizer(args)
    bare_model = build_model(args, wrap_ddp=False)[0]
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_eps, weight_decay=args.weight_decay)
    nmb = args.global_batch_size // args.micro_batch_size
    batches = list(lm.train_data_iterator(args, 0))

    def run_ours(n):
        for _ in range(n):
            train_step(lm.forward_step, iter(batches), ours_model, ours_opt, args, nmb)

    def run_bare(n):
        for _ in range(n):
            bare_step(bare_model, bare_opt, batches, args.clip_grad)

    run_ours(opts.warmup)
    run_bare(opts.warmup)
    ours, bare = [], []
    for _ in range(opts.rounds):
        for fn, out in ((run_ours, ours), (run_bare, bare)):
            t0 = time.perf_counter()
            fn(opts.steps)
            out.append((time.perf_counter() - t0) / opts.steps * 1000)
    o, b = statistics.median(ours), statistics.median(bare)
    print(f"config: tiny, micro batch {args.micro_batch_size}, global batch {args.global_batch_size}, "
          f"seq {args.seq_length}, {opts.threads} threads, {opts.rounds} x {opts.steps} steps each")
    print(f"ours (pretrain_composer train_step): {o:.2f} ms/step  (blocks: {', '.join(f'{x:.2f}' for x in ours)})")
    print(f"bare (GPTModel + torch AdamW):       {b:.2f} ms/step  (blocks: {', '.join(f'{x:.2f}' for x in bare)})")
    print(f"overhead ratio: {o / b:.3f} (goal <= 1.05)")
    destroy()


if __name__ == "__main__":
    main()
