"""Parallel layouts that fit a model on a GPU cluster, fastest first (estimates: megatron_ext/planning.py).

    python tools/plan_parallelism.py --model kimi-k2.5 --gpu h200 --gpus 512 --seq-length 32768
    python tools/plan_parallelism.py --model kimi-k2.5 --gpu h100 --gpus 1024 --seq-length 262144 \
        --global-batch-size 128 --json
    python tools/plan_parallelism.py --model kimi-k2.5 --gpu h200 --serve --tensor-model-parallel-size 8 \
        --expert-model-parallel-size 8 --batch 32 --context 131072
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_ext import planning
from megatron_ext.models.presets import PRESETS, get_preset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="kimi-k2.5", choices=sorted(PRESETS))
    ap.add_argument("--gpu", default="h100", choices=sorted(planning.GPUS))
    ap.add_argument("--gpus", type=int, default=None, help="GPUs in the job (8 per node)")
    ap.add_argument("--seq-length", type=int, default=None, help="tokens per sequence (default: the preset's)")
    ap.add_argument("--global-batch-size", type=int, default=1024, help="sequences per optimizer step")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--mtp-num-layers", type=int, default=None, help="MTP layers (default: the preset's)")
    ap.add_argument("--fp8", action="store_true", help="FP8 GEMMs (Transformer Engine)")
    ap.add_argument("--no-distributed-optimizer", action="store_true")
    ap.add_argument("--recompute", nargs="+", default=list(planning.RECOMPUTE_CHOICES),
                    choices=planning.RECOMPUTE_CHOICES, help="recomputation choices to consider")
    ap.add_argument("--max-vpp", type=int, default=1, help="consider virtual pipeline sizes up to this")
    ap.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory to leave free")
    ap.add_argument("--top", type=int, default=10, help="layouts to show")
    ap.add_argument("--all", action="store_true", help="also list layouts that do not fit")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--serve", action="store_true", help="serving memory of one layout instead of a plan")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=8)
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--expert-model-parallel-size", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16, help="--serve: concurrent sequences")
    ap.add_argument("--context", type=int, default=131072, help="--serve: tokens per sequence")
    args = ap.parse_args(argv)
    model = get_preset(args.model)
    if args.mtp_num_layers is not None:
        model = model.replace(mtp_num_layers=args.mtp_num_layers)
    gpu = planning.GPUS[args.gpu]

    if args.serve:
        mem = planning.serving_memory(model, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                      args.expert_model_parallel_size, args.batch, args.context)
        fits = mem["total"] <= gpu.memory_gib * (1 - args.headroom)
        if args.json:
            print(json.dumps({**mem, "fits": fits}, indent=1))
        else:
            print(f"serving {args.model} on {args.gpu}: weights {mem['weights']:.1f} GiB + MLA latent cache "
                  f"{mem['latent_cache']:.1f} GiB (+ runtime) = {mem['total']:.1f} GiB per GPU of "
                  f"{gpu.memory_gib} -> {'fits' if fits else 'does NOT fit'}")
            print(rollout_line(model, gpu, args.batch, args.context, args.headroom))
        return 0 if fits else 1

    if not args.gpus or args.gpus < 1:
        print("error: --gpus N is required (the job's GPU count)", file=sys.stderr)
        return 2
    seq = args.seq_length or model.seq_length
    work = planning.Workload(seq, args.global_batch_size, args.micro_batch_size, fp8=args.fp8,
                             distributed_optimizer=not args.no_distributed_optimizer, headroom=args.headroom)
    results = planning.plan(model, gpu, args.gpus, work, fits_only=not args.all, recompute=tuple(args.recompute),
                            max_vpp=args.max_vpp)
    total, active = planning.counts(model)
    if args.json:
        print(json.dumps({"model": args.model, "gpu": args.gpu, "gpus": args.gpus, "seq_length": seq,
                          "global_batch_size": args.global_batch_size, "total_parameters": total,
                          "active_parameters": active, "layouts": [e.as_dict() for e in results[:args.top]]},
                         indent=1))
        return 0 if results else 1
    print(f"{args.model}: {total / 1e9:.1f}B parameters ({active / 1e9:.1f}B active) on {args.gpus} x {args.gpu} "
          f"({gpu.memory_gib} GiB), seq {seq}, global batch {args.global_batch_size}"
          f"{', FP8' if args.fp8 else ''}: {len(results)} layouts {'considered' if args.all else 'fit'}")
    if not results:
        print("nothing fits: add GPUs, shorten --seq-length, or allow --recompute full")
        return 1
    print(f"{'layout':58s} {'GiB/GPU':>8s} {'step s':>8s} {'tok/s':>10s} {'MFU':>6s}  memory (weights/grads/optim/"
          "acts/dispatch/logits)")
    for e in results[:args.top]:
        m = e.memory_gib
        parts = "/".join(f"{m[k]:.0f}" for k in ("weights", "grads", "optimizer", "activations", "moe_dispatch",
                                                  "logits"))
        print(f"{e.layout.describe():58s} {e.total_gib:8.1f} {e.step_time_s:8.2f} {e.tokens_per_s:10.0f} "
              f"{e.mfu:6.1%}  {parts}{'  (does not fit)' if not e.fits else ''}"
              + "".join(f"  [{n}]" for n in e.notes))
    print("flags of the first:", " ".join(results[0].layout.flags()))
    print(rollout_line(model, gpu, 16, seq, args.headroom))
    return 0


def rollout_line(model, gpu, batch: int, context: int, headroom: float) -> str:
    """How many GPUs one RL rollout replica needs: one GPU is what --rl-workers engine workers get."""
    gpus, mem = planning.rollout_replica_gpus(model, gpu.memory_gib, batch, context, headroom)
    where = ("one-GPU engine workers (--rl-workers) can hold it" if gpus == 1 else
             "more than one GPU: run rollouts on tensor/expert-parallel inference servers (--rl-remote-servers)")
    return (f"rollout replica ({batch} sequences x {context} tokens): {gpus} x {gpu.name} "
            f"({mem['total']:.0f} GiB per GPU); {where}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `| head`: the reader has what it wanted; no traceback, and a success
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush goes nowhere
        sys.exit(0)
