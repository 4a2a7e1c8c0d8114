"""`--compare RUN_A RUN_B ...`: runs side by side, each later run against the first (the baseline).

Per task: the accuracy of both runs, the difference, and the two-sided Fisher exact test of the task's pooled
passes (correct/wrong x run A/run B), Holm-adjusted over the tasks compared; a task is significant when its
adjusted p < ALPHA. Overall: the difference in accuracy over the tasks both runs ran, and the paired sign-flip
permutation test of the per-task accuracy differences (exact up to 16 differing tasks; with one pass per run this
is the exact McNemar test). Figures: accuracy with intervals per run, accuracy against tokens or cost with the
Pareto frontier, and a task x run accuracy heatmap.
"""

from __future__ import annotations

import numpy as np

from megatron_ext.eval import plots
from megatron_ext.eval.document import Document, fmt, interval
from megatron_ext.eval.report import cost_axis
from megatron_ext.eval.stats import fisher_exact, holm, paired_permutation

ALPHA = 0.05


def compare_pair(a: dict, b: dict) -> dict:
    """Run b against run a (summaries): per-task tests and the overall paired test over shared tasks."""
    shared = [i for i in a["per_task"] if i in b["per_task"] and a["per_task"][i]["passes"] and
              b["per_task"][i]["passes"]]
    tasks = {}
    for i in shared:
        ta, tb = a["per_task"][i], b["per_task"][i]
        tasks[i] = {"a": ta["accuracy"], "b": tb["accuracy"], "difference": tb["accuracy"] - ta["accuracy"],
                    "p": fisher_exact(sum(ta["correct"]), ta["passes"], sum(tb["correct"]), tb["passes"])}
    for i, adjusted in zip(shared, holm([tasks[i]["p"] for i in shared])):
        tasks[i]["p_holm"] = adjusted
        tasks[i]["significant"] = adjusted < ALPHA
    differences = [tasks[i]["difference"] for i in shared]
    p, method = paired_permutation(differences)
    return {"shared_tasks": len(shared),
            "only_in_a": sorted(set(a["per_task"]) - set(shared)),
            "only_in_b": sorted(set(b["per_task"]) - set(shared)),
            "accuracy_a": float(np.mean([tasks[i]["a"] for i in shared])) if shared else None,
            "accuracy_b": float(np.mean([tasks[i]["b"] for i in shared])) if shared else None,
            "difference": float(np.mean(differences)) if shared else None,
            "p": p, "test": method, "significant": p < ALPHA,
            "task_test": f"two-sided Fisher exact on pooled passes, Holm-adjusted over {len(shared)} tasks",
            "per_task": tasks}


def compare(runs: list[tuple[str, dict]]) -> dict:
    base_name, base = runs[0]
    return {"baseline": base_name, "alpha": ALPHA,
            "runs": {name: {k: s.get(k) for k in ("agent", "model", "accuracy", "accuracy_ci", "pass_at_k",
                                                   "episodes", "passes")} for name, s in runs},
            "against_baseline": {name: compare_pair(base, s) for name, s in runs[1:]}}


def build(runs: list[tuple[str, dict]], result: dict) -> Document:
    doc = Document("Evaluation comparison")
    key, label = cost_axis(runs[0][1]) if all(s.get("prices_per_million_tokens") for _, s in runs) else \
        ("total_tokens", "mean tokens per episode (input + cached input + output)")
    doc.heading("Runs")
    doc.table(["run", "agent", "accuracy", "95% CI (bootstrap over tasks)", "pass@1", "episodes", label, "wall s"],
              [[n, s.get("agent", "-"), fmt(s["accuracy"]), interval(s["accuracy_ci"]),
                fmt(s["pass_at_k"].get("1")), s["episodes"], fmt(s["efficiency"][key], 4 if key == "cost" else 0),
                fmt(s["efficiency"]["wall_s"], 1)] for n, s in runs])
    for name, pair in result["against_baseline"].items():
        doc.heading(f"{name} against {result['baseline']}")
        doc.paragraph(f"Over {pair['shared_tasks']} shared tasks: accuracy {fmt(pair['accuracy_a'])} -> "
                      f"{fmt(pair['accuracy_b'])} (difference {fmt(pair['difference'])}), p = {pair['p']:.4g} "
                      f"({pair['test']}): {'significant' if pair['significant'] else 'not significant'} at "
                      f"{ALPHA}. Per task: {pair['task_test']}.")
        if pair["only_in_a"] or pair["only_in_b"]:
            doc.paragraph(f"Not compared: only in {result['baseline']}: {pair['only_in_a'][:20]}; only in {name}: "
                          f"{pair['only_in_b'][:20]}.")
        rows = sorted(pair["per_task"].items(), key=lambda kv: (kv[1]["p_holm"], -abs(kv[1]["difference"])))
        doc.table(["task", result["baseline"], name, "difference", "Fisher p", "Holm p", "significant"],
                  [[i, fmt(t["a"]), fmt(t["b"]), f"{t['difference']:+.3f}", f"{t['p']:.4g}", f"{t['p_holm']:.4g}",
                    "yes" if t["significant"] else ""] for i, t in rows])
    names = [n for n, _ in runs]
    doc.heading("Figures")
    doc.figure("accuracy", plots.accuracy_intervals(names, [s["accuracy"] for _, s in runs],
                                                    [s["accuracy_ci"] for _, s in runs],
                                                    "Accuracy per run (bootstrap 95% over tasks)"),
               "Accuracy per run with 95% intervals")
    doc.figure("pareto", plots.pareto(names, [s["efficiency"][key] for _, s in runs], [s["accuracy"] for _, s in runs],
                                      label, "Accuracy against " + label,
                                      intervals=[s["accuracy_ci"] for _, s in runs]),
               f"Accuracy against {label}; dashed: Pareto frontier")
    tasks = sorted({i for _, s in runs for i, t in s["per_task"].items() if t["passes"]})[:plots.MAX_ROWS]
    grid = np.array([[s["per_task"][i]["accuracy"] if i in s["per_task"] and s["per_task"][i]["passes"] else np.nan
                      for _, s in runs] for i in tasks])
    doc.figure("heatmap", plots.heatmap(tasks, names, grid, "Accuracy per task and run",
                                        "accuracy over passes; blank: not run"), "Task x run accuracy")
    return doc
