"""Asynchronous RL: samples trained per second with Ray rollout workers, --rl-max-staleness K against 0.

    python benchmarks/rl_async.py --out runs/rl_async     # about 10 minutes on 2 CPU cores

Same configuration for both (tiny model after a short supervised warm-up on digit tasks, GRPO with
--rl-rollout-workers W), runs alternating sync / async --repeats times. Throughput counts the steps after the
first (the first includes starting Ray and the workers): samples trained / seconds. The breakdown per step (means)
explains it: seconds the trainer waited for its batch (idle), reference + training, weight publication, worker
utilisation. Also the reward of both runs against samples seen (docs/rl_async.png) and the publication time per
step against model size (rank 0 -> object store, changed tensors compared; no workers needed for this part).
Prints markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.rl_learning import sft_start  # noqa: E402
from megatron_ext.lifetime import run_tied  # noqa: E402
from megatron_ext.rl.env import digit_tasks, write_prompts  # noqa: E402

MODEL = ["--model", "tiny", "--vocab-size", "32", "--seq-length", "64", "--micro-batch-size", "8",
         "--grpo-max-response-length", "3"]
OPS = ["max", "min", "first", "last"]


def run(cmd, log_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        code = run_tied(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({code}); see {log_path}")
    return time.perf_counter() - t0


def steps(log_path) -> list[dict[str, float]]:
    """Every logged RL step's scalars."""
    out = []
    for line in open(log_path):
        if not line.lstrip().startswith("iteration"):
            continue
        rec = {"elapsed": float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", line).group(1)) / 1e3}
        for key, value in re.findall(r"\| ([a-z][a-z0-9 /_@.-]*?): ([-+\d.eE]+)", line):
            rec[key] = float(value)
        out.append(rec)
    return out


def summary(recs, samples_per_step):
    body = recs[1:]  # the first step waits for Ray and the workers to start
    secs = sum(r["elapsed"] for r in body)
    mean = lambda k: sum(r.get(k, 0.0) for r in body) / len(body)  # noqa: E731
    return {"samples/s": samples_per_step * len(body) / secs, "step s": secs / len(body),
            "wait s": mean("seconds generate"), "reference s": mean("seconds reference"),
            "train s": mean("seconds train"), "publish s": mean("seconds weight update"),
            "idle": mean("trainer idle fraction"), "util": mean("worker utilisation"),
            "stale": mean("staleness mean"), "stale max": max(r.get("staleness max", 0) for r in body),
            "spanning": mean("samples spanning versions"), "gate s": mean("seconds gate blocked")}


def publication_sizes(sizes):
    """Seconds to publish one version (compare with the previous, pack, put into the object store) per size."""
    import torch

    import megatron_ext  # noqa: F401
    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.engine import model_weights
    from megatron_ext.rl.workers import RayFleet, WorkerConfig, start_ray
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    start_ray(None, 2, log=lambda *a, **k: None)
    rows = []
    for hidden in sizes:
        flags = ["--model", "tiny", "--vocab-size", "32", "--seq-length", "64", "--hidden-size", str(hidden),
                 "--ffn-hidden-size", str(2 * hidden), "--moe-ffn-hidden-size", str(hidden // 2),
                 "--moe-shared-expert-intermediate-size", str(hidden // 2)]
        args = parse_args(flags, world_size=1)
        initialize_distributed(args)
        model = build_model(args, wrap_ddp=False)
        params = sum(p.numel() for p in model[0].parameters())
        weights = lambda: model_weights(model[0])  # noqa: E731
        for delta in (False, True):
            fleet = RayFleet(0, WorkerConfig(None), None, None, 0, weights, delta=delta)
            times = []
            for v in range(1, 4):
                with torch.no_grad():
                    for p in model[0].parameters():
                        p.add_(1e-3)  # every tensor changes, as after an Adam step
                t0 = time.perf_counter()
                stats = fleet.publish(v, weights)
                times.append(time.perf_counter() - t0)
            rows.append((hidden, params, delta, min(times), stats["publish bytes"]))
        destroy()
    import ray

    ray.shutdown()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/rl_async")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--staleness", type=int, default=1, help="K of the asynchronous runs")
    p.add_argument("--repeats", type=int, default=2, help="sync/async pairs after the warm-up (0: skip them)")
    p.add_argument("--rl-iters", type=int, default=16)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--sft-iters", type=int, default=100)
    p.add_argument("--scratch-length", type=int, default=24,
                   help="also time a generation-heavy pair: untrained model (every response runs to this length), "
                        "the same steps and prompts (0: skip)")
    p.add_argument("--sizes", type=int, nargs="*", default=[64, 128, 256, 512], help="hidden sizes for publication")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "rl_async.png"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    n_sft, n_rl = a.sft_iters * 32, a.rl_iters * a.prompts_per_step
    train = digit_tasks("train", n_sft + n_rl, seed=1, ops=OPS, min_len=5, max_len=8)
    files = {name: os.path.join(a.out, f"{name}.jsonl") for name in ("sft", "rl")}
    write_prompts(files["sft"], train[:n_sft])
    write_prompts(files["rl"], train[n_sft:])
    sft = os.path.join(a.out, "sft")
    start = sft_start(sft, a.sft_iters)
    if start is not None:
        run([sys.executable, "-W", "ignore", "rl_composer.py", *MODEL, *start, "--rl-prompts", files["sft"],
             "--rl-sft-warmup",
             "--grpo-prompts-per-step", "32", "--train-iters", str(a.sft_iters), "--lr", "5e-3", "--lr-decay-style",
             "constant", "--grpo-kl-beta", "0", "--save", sft, "--log-interval", "50"], os.path.join(a.out, "sft.log"))
    def pairs(name, model, start, repeats):
        results, curves = {0: [], a.staleness: []}, {}
        if not repeats:
            return curves
        for rep in range(repeats):
            for K in (0, a.staleness):  # alternating, so load changes on the machine hit both alike
                log = os.path.join(a.out, f"{name.split(',')[0].replace(' ', '_')}_k{K}_r{rep}.log")
                run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     "1", "rl_composer.py", *model, *start, "--rl-prompts", files["rl"],
                     "--train-iters", str(a.rl_iters), "--lr", "1e-3", "--lr-decay-style", "constant",
                     "--grpo-group-size", str(a.group_size), "--grpo-prompts-per-step", str(a.prompts_per_step),
                     "--rl-reward-weights", "exact=1,char_accuracy=0.5", "--log-interval", "1",
                     "--rl-rollout-workers", str(a.workers), "--rl-max-staleness", str(K)], log)
                recs = steps(log)
                results[K].append(summary(recs, a.prompts_per_step * a.group_size))
                curves.setdefault(K, []).append([r["reward mean"] for r in recs])
        keys = ["samples/s", "step s", "wait s", "reference s", "train s", "publish s", "idle", "util", "stale",
                "stale max", "spanning", "gate s"]
        print(f"\n{name}:\n\n| run | " + " | ".join(keys) + " |")
        print("|---" * (len(keys) + 1) + "|")
        for K in (0, a.staleness):
            for i, r in enumerate(results[K]):
                print(f"| K={K} #{i + 1} | " + " | ".join(f"{r[k]:.3f}" for k in keys) + " |")
        mean = {K: sum(r["samples/s"] for r in results[K]) / len(results[K]) for K in results}
        print(f"\n{name}: samples trained per second: sync (K=0) {mean[0]:.2f}, async (K={a.staleness}) "
              f"{mean[a.staleness]:.2f}: x{mean[a.staleness] / mean[0]:.2f}", flush=True)
        return curves

    curves = pairs("after warm-up", MODEL, ["--load", sft, "--finetune"], a.repeats)
    if a.scratch_length:
        scratch = [f if f != MODEL[-1] else str(a.scratch_length) for f in MODEL]
        pairs(f"untrained, {a.scratch_length}-token responses", scratch, [], 1)
    for K, runs in curves.items():
        n = min(len(c) for c in runs)
        avg = [sum(c[i] for c in runs) / len(runs) for i in range(n)]
        print(f"reward mean per step, K={K} (mean of {len(runs)} runs): " + " ".join(f"{x:.3f}" for x in avg))
    if a.plot and curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        per_step = a.prompts_per_step * a.group_size
        for K, runs in curves.items():
            for i, c in enumerate(runs):
                ax.plot([per_step * (s + 1) for s in range(len(c))], c, color="C0" if K == 0 else "C1",
                        alpha=0.8, label=(f"K={K} (sync)" if K == 0 else f"K={K} (async)") if i == 0 else None)
        ax.set_xlabel("samples trained")
        ax.set_ylabel("training reward mean (exact + 0.5 char accuracy)")
        ax.set_title(f"GRPO with {a.workers} Ray rollout workers, synchronous vs asynchronous\n"
                     "tiny K2.5 after a brief SFT on digit tasks, 2-core CPU", fontsize=9)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"plot: {a.plot}")
    if a.sizes:
        print("\n| hidden size | parameters | changed-only | publish s (best of 3) | bytes sent |")
        print("|---|---|---|---|---|")
        for hidden, params, delta, secs, nbytes in publication_sizes(a.sizes):
            print(f"| {hidden} | {params / 1e6:.2f} M | {'yes' if delta else 'no'} | {secs:.4f} "
                  f"| {nbytes / 1e6:.1f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
