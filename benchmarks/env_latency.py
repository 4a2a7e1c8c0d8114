"""Sandbox start and command latency (p50/p95) and scripted episodes per second at concurrency 1 and 2.

    python benchmarks/env_latency.py [--commands 50] [--episodes 6]

The episode is megatron_ext/env/demo.py's task with its oracle script (six tool calls, grading runs pytest in a
fresh sandbox); concurrency runs episodes on threads (each episode's time is spent in subprocesses)."""

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.env.agents import ScriptAgent  # noqa: E402
from megatron_ext.env.demo import ORACLE, make_task  # noqa: E402
from megatron_ext.env.episode import EpisodeConfig, run_episode  # noqa: E402
from megatron_ext.env.sandbox import BubblewrapSandbox  # noqa: E402
from megatron_ext.env.tasks import load_task  # noqa: E402


def percentiles(values):
    values = sorted(values)
    return values[len(values) // 2] * 1000, values[min(len(values) - 1, int(len(values) * 0.95))] * 1000


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--commands", type=int, default=50)
    p.add_argument("--episodes", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        task = load_task(make_task(root))
        starts, commands = [], []
        for _ in range(args.commands):
            t = time.perf_counter()
            box = BubblewrapSandbox(task.repo)
            starts.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert box.exec("true").ok
            commands.append(time.perf_counter() - t)
            box.close()
        print("sandbox start (copy + cgroup) p50 %.1f ms, p95 %.1f ms" % percentiles(starts))
        print("command (bwrap /bin/true)      p50 %.1f ms, p95 %.1f ms" % percentiles(commands))
        for workers in (1, 2):
            t = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                results = list(pool.map(lambda _: run_episode(task, ScriptAgent(ORACLE), EpisodeConfig()),
                                        range(args.episodes)))
            elapsed = time.perf_counter() - t
            assert all(r.reward["correctness"] == 1.0 for r in results)
            print(f"episodes at concurrency {workers}: {args.episodes / elapsed:.2f} episodes/s "
                  f"(median episode {statistics.median(r.wall_s for r in results):.2f} s)")


if __name__ == "__main__":
    main()
