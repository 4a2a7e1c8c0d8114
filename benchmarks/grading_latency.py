"""What grading by test ids costs: the grading run's wall time (p50) for the demo task's oracle, graded by exit code
(the test command as written, as before issue 23) and by test ids (the grader's runner), and the one-time trusted
run on the untouched repository that lists the expected ids of a task without fail_to_pass and which of them fail
there (a collection only, before grader version 2).

    python benchmarks/grading_latency.py [--episodes 8]
"""

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.env import grading  # noqa: E402
from megatron_ext.env.agents import ScriptAgent  # noqa: E402
from megatron_ext.env.demo import ORACLE, TEST_COMMAND, make_task  # noqa: E402
from megatron_ext.env.episode import EpisodeConfig, run_episode  # noqa: E402
from megatron_ext.env.sandbox import BubblewrapConfig  # noqa: E402
from megatron_ext.env.tasks import load_task  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        task = load_task(make_task(root))
        config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=os.path.join(root, "boxes")))
        exit_code_task = dataclasses.replace(task, test_command=TEST_COMMAND + " && true")  # not a plain pytest command
        start = time.monotonic()
        grading.expected_tests(task, grading.parse_pytest_command(task.test_command), config.sandbox, None, 120)
        baseline_s = time.monotonic() - start
        modes = {"exit code (command as written)": exit_code_task, "test ids (grader's runner)": task}
        walls, totals = {name: [] for name in modes}, {name: [] for name in modes}
        for _ in range(args.episodes):  # interleaved, so machine load falls on both alike
            for name, t in modes.items():
                start = time.monotonic()
                r = run_episode(t, ScriptAgent(ORACLE), config)
                totals[name].append(time.monotonic() - start)
                walls[name].append(r.grading["wall_s"])
                assert r.reward["correctness"] == 1.0, r.grading
        rows = {name: (statistics.median(walls[name]) * 1000, statistics.median(totals[name]) * 1000)
                for name in modes}
    print(f"trusted run on the untouched repository (once per task, cached): {baseline_s * 1000:.0f} ms")
    for name, (wall, total) in rows.items():
        print(f"{name}: grading run p50 {wall:.0f} ms, whole oracle episode p50 {total:.0f} ms "
              f"({args.episodes} episodes)")


if __name__ == "__main__":
    main()
