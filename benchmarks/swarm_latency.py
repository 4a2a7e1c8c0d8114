"""Wall-clock, critical steps and total steps of an N-part task: a serial agent against an orchestrator with N
sub-agents, every model turn (orchestrator, sub-agent, serial agent) delayed by a fixed latency standing in for
generation. The task has N independent functions kit/pI.py::fI (hidden tests check all); each part takes one agent
three turns (read, edit, run), so the serial agent takes 3N + 1 turns and the swarm (create + assign + wait in one
turn, merge + finish in the next) (1 + 4) + 1 = 6 critical steps whatever N. Scripted agents: the figures measure
the swarm's scheduling, the sandboxes and grading, not a model.

    python benchmarks/swarm_latency.py [--parts 2 4 8] [--latency 0 1] [--repeats 1]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.env.agents import ScriptAgent  # noqa: E402
from megatron_ext.env.episode import EpisodeConfig, run_episode  # noqa: E402
from megatron_ext.env.sandbox import BubblewrapConfig  # noqa: E402
from megatron_ext.env.swarm import Delayed, ScriptedPolicy, SwarmConfig, run_swarm_episode  # noqa: E402
from megatron_ext.env.tasks import load_task  # noqa: E402

STUB = "    raise NotImplementedError\n"


def parts_task(root: str, n: int):
    """The task file and the scripts: serial, orchestrator, {sub-agent name: script}."""
    os.makedirs(os.path.join(root, "repo", "kit"))
    os.makedirs(os.path.join(root, "hidden", "tests_hidden"))
    open(os.path.join(root, "repo", "kit", "__init__.py"), "w").close()
    tests, parts = [], {}
    for i in range(n):
        path = f"kit/p{i}.py"
        with open(os.path.join(root, "repo", path), "w") as f:
            f.write(f"def f{i}(x):\n{STUB}")
        tests.append(f"def test_f{i}():\n    from kit.p{i} import f{i}\n    assert f{i}(2) == {2 * i + 1}\n")
        parts[f"part{i}"] = [
            {"name": "read_file", "arguments": {"path": path}},
            {"name": "edit_file", "arguments": {"path": path, "old_text": STUB,
                                                "new_text": f"    return x * {i} + 1\n"}},
            {"name": "run_command", "arguments": {"command": f"python -c 'from kit.p{i} import f{i}; print(f{i}(2))'"}}]
    with open(os.path.join(root, "hidden", "tests_hidden", "test_kit.py"), "w") as f:
        f.write("\n\n".join(tests))
    task = {"id": f"kit-{n}-parts", "repo": "repo", "hidden_tests": "hidden", "timeout_s": 300,
            "instruction": f"Implement f{{i}}(x) = x * i + 1 in kit/p{{i}}.py for i = 0..{n - 1}.",
            "test_command": "python -m pytest -q -p no:cacheprovider tests_hidden", "max_turns": 3 * n + 5}
    with open(os.path.join(root, "task.json"), "w") as f:
        json.dump(task, f)
    finish = {"name": "finish", "arguments": {"message": "Implemented every part; checked each by running it."}}
    serial = [a for script in parts.values() for a in script] + [finish]
    orchestrator = [[{"name": "create_subagent", "arguments": {"name": p, "instructions": "implement one part"}}
                     for p in parts] + [{"name": "assign_task", "arguments": {"subagent": p, "task": p}} for p in parts]
                    + [{"name": "wait", "arguments": {}}],
                    [{"name": "merge", "arguments": {"subagent": p}} for p in parts] + [finish]]
    return os.path.join(root, "task.json"), serial, orchestrator, parts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--latency", type=float, nargs="+", default=[0.0, 1.0], help="seconds per model turn")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'parts':>5} {'latency s':>9} | {'serial wall s':>13} {'steps':>5} | {'swarm wall s':>12} "
          f"{'critical':>8} {'total':>5} {'peak':>4} | {'wall speedup':>12} | correct")
    for n in args.parts:
        with tempfile.TemporaryDirectory() as root:
            path, serial_script, orchestrator, parts = parts_task(root, n)
            task = load_task(path)
            config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=os.path.join(root, "boxes")))
            for latency in args.latency:
                serial, swarm = [], []
                for _ in range(args.repeats):
                    serial.append(run_episode(task, Delayed(ScriptAgent(serial_script), latency), config))
                    swarm.append(run_swarm_episode(task, Delayed(ScriptAgent(orchestrator), latency),
                                                   ScriptedPolicy(parts, latency), config, SwarmConfig(max_subagents=n)))
                ws, wp = statistics.median(r.wall_s for r in serial), statistics.median(r.wall_s for r in swarm)
                correct = all(r.reward["correctness"] == 1.0 for r in serial + swarm)
                s = swarm[0]
                print(f"{n:>5} {latency:>9.2f} | {ws:>13.2f} {serial[0].counts['turns']:>5} | {wp:>12.2f} "
                      f"{s.critical_steps:>8} {s.total_steps:>5} {s.swarm['peak_concurrency']:>4} | "
                      f"{ws / wp:>11.2f}x | {correct}", flush=True)


if __name__ == "__main__":
    main()
