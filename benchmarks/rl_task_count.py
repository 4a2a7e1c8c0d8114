"""Held-out success against the number of distinct tasks RL trained on (issue 26): a figure and a table from
`tools/run_eval.py` output directories, one series per held-out task set.

    python benchmarks/rl_task_count.py --out docs/agentic_learning_task_count.png \
        --eval "seed 5" 0=/work/runs/rl640/eval/s5_sft 320=/work/runs/rl640/eval/s5_rl320 \
                        640=/work/runs/rl640/eval/heldout_s5 960=/work/runs/rl960/eval/s5_rl960 \
        --eval "seed 7" 0=/work/runs/rl960/eval/s7_sft 960=/work/runs/rl960/eval/s7_rl960

Each point is a checkpoint's success on the set (the mean over tasks of each task's share of passes solved),
with a 95% percentile-bootstrap interval over tasks, and pass@K (the share of tasks solved in any of its
passes); each point's p-value is the paired sign-flip permutation test over the tasks both it and the series'
first point (the number of tasks 0: the SFT checkpoint) evaluated.
"All sets" pools the tasks of every series at the task counts all series have (per-task means, so sets with
different pass counts weigh each task alike). Reads each directory's summary.json ("per_task": {task:
{"correct": [...]}}), the file run_eval.py writes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.eval.stats import bootstrap_mean, paired_permutation  # noqa: E402


def per_task(directory: str) -> dict[str, tuple[float, bool]]:
    """{task: (share of passes solved, solved in any pass)} from a run_eval.py output directory."""
    path = os.path.join(directory, "summary.json")
    try:
        per = json.load(open(path))["per_task"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{path}: not a run_eval.py summary with per-task results ({e})")
    out = {}
    for task, entry in per.items():
        correct = entry.get("correct") or []
        if not correct:
            raise SystemExit(f"{path}: task {task} has no passes")
        out[task] = (sum(bool(c) for c in correct) / len(correct), any(correct))
    return out


def parse_series(items: list[list[str]]) -> list[tuple[str, list[tuple[int, str]]]]:
    series = []
    for item in items:
        label, points = item[0], []
        for spec in item[1:]:
            count, sep, directory = spec.partition("=")
            if not sep or not count.isdigit():
                raise SystemExit(f"--eval {label}: expected TASKS=DIR, got {spec!r}")
            points.append((int(count), directory))
        if not points or points[0][0] != 0:
            raise SystemExit(f"--eval {label}: the first point must be 0=DIR (the checkpoint RL started from)")
        if [c for c, _ in points] != sorted({c for c, _ in points}):
            raise SystemExit(f"--eval {label}: task counts must increase")
        series.append((label, points))
    return series


def point(base: dict, run: dict) -> dict:
    shared = [t for t in run if t in base]
    values = [run[t][0] for t in shared]
    low, high = bootstrap_mean(values)
    p = paired_permutation([run[t][0] - base[t][0] for t in shared])[0] if run is not base else None
    return {"tasks": len(shared), "mean": sum(values) / len(values), "low": low, "high": high, "p": p,
            "pass_at_k": sum(run[t][1] for t in shared) / len(shared)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--eval", nargs="+", action="append", required=True, metavar="LABEL TASKS=DIR",
                    help="a held-out set: its label, then TASKS=DIR per checkpoint (0=DIR first)")
    ap.add_argument("--out", default=None, help="figure (.png); the table is printed either way")
    a = ap.parse_args(argv)
    series = parse_series(a.eval)
    loaded = [(label, [(n, per_task(d)) for n, d in points]) for label, points in series]
    counts = sorted(set.intersection(*({n for n, _ in pts} for _, pts in loaded)))
    if len(loaded) > 1 and len(counts) > 1:  # 0 is in every series
        pooled = [(n, {f"{label}/{t}": v for label, pts in loaded for m, runs in pts if m == n
                       for t, v in runs.items()}) for n in counts]
        loaded.append(("all sets", pooled))
    figure = []
    print("| held-out set | RL tasks | tasks | success | 95% CI | p against 0 | pass@K (K: the set's passes) |")
    print("|---|---|---|---|---|---|---|")
    for label, pts in loaded:
        base = pts[0][1]
        line = []
        for n, runs in pts:
            r = point(base, runs)
            line.append((n, r))
            p = "-" if r["p"] is None else f"{r['p']:.3g}"
            print(f"| {label} | {n} | {r['tasks']} | {r['mean']:.3f} | [{r['low']:.3f}, {r['high']:.3f}] | {p} | "
                  f"{r['pass_at_k']:.3f} |")
        figure.append((label, line))
    if a.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        for i, (label, line) in enumerate(figure):
            shift = (i - (len(figure) - 1) / 2) * 12  # side by side at each task count
            xs = [n + shift for n, _ in line]
            ys = [r["mean"] for _, r in line]
            err = [[r["mean"] - r["low"] for _, r in line], [r["high"] - r["mean"] for _, r in line]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, lw=2.2 if label == "all sets" else 1.2,
                        label=f"{label} ({line[0][1]['tasks']} tasks)")
        ax.set_xlabel("distinct training tasks RL has seen (each once, 8 episodes)")
        ax.set_ylabel("held-out success (95% CI)")
        ax.set_title("Held-out program shapes: success after RL on more tasks", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        fig.savefig(a.out, dpi=120)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
