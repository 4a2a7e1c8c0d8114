"""Static against continuous batching in one Ray rollout worker's engine, measured with the real code on this
machine (issue 29): `rl/workers.Batcher` (per-turn batches that end with their longest row) and
`rl/workers.ContinuousBatcher` (turns join the decode batch between steps and return when their own rows finish),
both over `EngineGenerate` on the tiny preset.

C request threads run at once, as a worker with --rl-worker-concurrency C runs them. Each request has E episodes
and T turns; a turn is one call of E rows (run_groups' `many`), whose lengths are drawn from a lognormal (median
--length-median, --length-sigma, cut at --max-length: no stop token, so a row decodes exactly its length), with
--tool-s seconds of tool time after each turn. Both modes get the very same lengths, prompts and seeds, and draw
the same tokens (checked). Rounds alternate between the two modes; medians are reported.

What it shows: the wall time of the whole workload, each request's latency, and the rows decoded per engine
forward. On a CPU a decode step's cost grows with its rows much faster than on a GPU, so the ratio here is not the
cluster's; the request latencies show the mechanism the simulation (`rl_async_sim.py --continuous-batching`)
models.

    python benchmarks/worker_batching.py [--requests 4] [--episodes 2] [--turns 3] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _workload(a: argparse.Namespace):
    """Per request, per turn: the E calls (prompt, 1 sample, Sampling) of that turn."""
    from megatron_ext.rl.rollout import Sampling

    rng = np.random.default_rng(a.seed)
    out = []
    for r in range(a.requests):
        turns = []
        for t in range(a.turns):
            lengths = np.minimum(np.maximum(1, np.round(rng.lognormal(np.log(a.length_median), a.length_sigma,
                                                                       a.episodes))), a.max_length).astype(int)
            turns.append([([rng.integers(0, 1000, a.prompt_length).tolist()], 1,
                           Sampling(max_tokens=int(n), temperature=1.0, seed=int(rng.integers(1 << 30))))
                          for n in lengths])
        out.append(turns)
    return out


def _run(batcher, workload, tool_s: float) -> dict:
    latencies, tokens = [0.0] * len(workload), [None] * len(workload)

    def request(i):
        t0 = time.perf_counter()
        got = []
        batcher.hold(1)  # as RolloutWorker.rollout: the static batcher waits for every request it holds
        try:
            for calls in workload[i]:
                got.append([s.token_ids for out in batcher.many(calls) for g in out for s in g])
                time.sleep(tool_s)
        finally:
            batcher.hold(-1)
        latencies[i], tokens[i] = time.perf_counter() - t0, got
    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(workload))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall": time.perf_counter() - t0, "latencies": latencies, "tokens": tokens}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4, help="C: requests the worker runs at once")
    p.add_argument("--episodes", type=int, default=2, help="E: rows per request per turn")
    p.add_argument("--turns", type=int, default=3, help="T: turns per request")
    p.add_argument("--length-median", type=float, default=24.0)
    p.add_argument("--length-sigma", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=192)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--tool-s", type=float, default=0.0, help="seconds of tool time after each turn")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each mode (after one warm-up each)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if min(a.requests, a.episodes, a.turns, a.rounds, a.prompt_length, a.max_length) < 1:
        p.error("--requests, --episodes, --turns, --rounds, --prompt-length and --max-length must be >= 1")
    import torch

    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.rl.rollout import EngineGenerate
    from megatron_ext.rl.workers import Batcher, ContinuousBatcher
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    torch.set_num_threads(a.threads)
    context = a.prompt_length + a.max_length
    args = parse_args(["--model", "tiny", "--mock-data", "--seq-length", str(context), "--max-position-embeddings",
                       str(context)], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=1))[0]
        model.eval()
        gen = EngineGenerate(InferenceEngine(model))
        modes = {"static": lambda: Batcher(gen.many, lambda: None, wait_s=0.05),
                 "continuous": lambda: ContinuousBatcher(gen, lambda: None)}
        workload = _workload(a)
        rows = sum(len(calls) for turns in workload for calls in turns)
        decoded = sum(c[2].max_tokens for turns in workload for calls in turns for c in calls)
        print(f"{a.requests} requests x {a.turns} turns x {a.episodes} rows: {rows} rows, {decoded} tokens "
              f"(lengths lognormal, median {a.length_median:g}, sigma {a.length_sigma:g}, cap {a.max_length}); "
              f"tool {a.tool_s:g} s per turn; torch threads {a.threads}", flush=True)
        runs = {m: [] for m in modes}
        for rnd in range(a.rounds + 1):  # round 0 warms up
            for m, make in modes.items():
                gen.batch_rows.clear()
                gen.step_rows.clear()
                out = _run(make(), workload, a.tool_s)
                out["forwards"] = sum(gen.batch_rows.values()) if m == "static" else sum(gen.step_rows.values())
                if rnd:
                    runs[m].append(out)
                    print(f"round {rnd} {m}: {out['wall']:.2f} s", flush=True)
        if runs["static"][0]["tokens"] != runs["continuous"][0]["tokens"]:
            raise SystemExit("the two modes drew different tokens: the comparison is void")
        print("\n| mode | wall s (median) | tokens/s | request latency s, mean / max | engine calls or steps |")
        print("|---|---|---|---|---|")
        walls = {}
        for m, rs in runs.items():
            walls[m] = statistics.median(r["wall"] for r in rs)
            lat = [statistics.median(r["latencies"][i] for r in rs) for i in range(a.requests)]
            print(f"| {m} | {walls[m]:.2f} | {decoded / walls[m]:.0f} | {statistics.mean(lat):.2f} / {max(lat):.2f} "
                  f"| {rs[0]['forwards']} |")
        ratio = [s["wall"] / c["wall"] for s, c in zip(runs["static"], runs["continuous"])]
        print(f"\nstatic / continuous wall time: {statistics.median(ratio):.2f} (paired rounds "
              f"{min(ratio):.2f}-{max(ratio):.2f}); the same tokens in both modes")
    finally:
        destroy()


if __name__ == "__main__":
    main()
