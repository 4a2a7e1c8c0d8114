"""Sandbox start and command latency (p50/p95) and scripted episodes per second at concurrency 1 and 2.

    python benchmarks/env_latency.py [--commands 50] [--episodes 6] [--baseline REV]

--baseline REV also loads megatron_ext/env/sandbox.py as it was at git revision REV (before the hardening of
issue 23: 48fd0dd) and alternates the two sandboxes start by start and command by command, so both see the same
load on a shared machine.

The episode is megatron_ext/env/demo.py's task with its oracle script (six tool calls, grading runs pytest in a
fresh sandbox); concurrency runs episodes on threads (each episode's time is spent in subprocesses)."""

import argparse
import importlib.util
import os
import statistics
import subprocess
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


def baseline_sandbox(rev: str, folder: str):
    """The BubblewrapSandbox class of megatron_ext/env/sandbox.py at git revision rev (it imports nothing of ours)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", f"{rev}:megatron_ext/env/sandbox.py"], check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(folder, "baseline_sandbox.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("baseline_sandbox", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.BubblewrapSandbox


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--commands", type=int, default=50)
    p.add_argument("--episodes", type=int, default=6)
    p.add_argument("--baseline", default=None, help="git revision whose sandbox to time alongside this one")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        task = load_task(make_task(root))
        kinds = {"hardened": BubblewrapSandbox}
        if args.baseline:
            kinds[f"baseline {args.baseline}"] = baseline_sandbox(args.baseline, root)
        starts, commands = {k: [] for k in kinds}, {k: [] for k in kinds}
        for _ in range(args.commands):
            for kind, cls in kinds.items():
                t = time.perf_counter()
                box = cls(task.repo)
                starts[kind].append(time.perf_counter() - t)
                box.exec("true")
                for _ in range(3):  # a sandbox serves many commands: the first one pays the page cache
                    t = time.perf_counter()
                    assert box.exec("true").ok
                    commands[kind].append(time.perf_counter() - t)
                box.close()
        for kind in kinds:
            print(f"{kind}: sandbox start (copy, tmpfs, cgroups) p50 %.1f ms, p95 %.1f ms" % percentiles(starts[kind]))
            print(f"{kind}: command (bwrap /bin/true)            p50 %.1f ms, p95 %.1f ms" %
                  percentiles(commands[kind]))
        if args.episodes <= 0:
            return
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
