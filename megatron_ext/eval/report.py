"""report.md / report.html of one run, from its summary.json (metrics.py): the overall numbers, the suite's
shape next to CursorBench's, pass@k, code quality, efficiency (with total and critical steps and wall-clock),
interaction, the agent swarm's statistics (swarm runs), a per-task table, and three figures:
accuracy with intervals, accuracy against tokens (or cost, when prices were given) with its Pareto frontier, and
the task x pass correctness heatmap."""

from __future__ import annotations

import numpy as np

from megatron_ext.eval import plots
from megatron_ext.eval.document import Document, fmt, interval
from megatron_ext.eval.usage import CATEGORIES


def cost_axis(summary: dict) -> tuple[str, str]:
    """(efficiency key, axis label) the Pareto view uses: cost when priced, else total tokens."""
    if summary.get("prices_per_million_tokens"):
        return "cost", "mean cost per episode"
    return "total_tokens", "mean tokens per episode (input + cached input + output)"


def overview_rows(summary: dict) -> list:
    eff = summary["efficiency"]
    rows = [["accuracy", fmt(summary["accuracy"]),
             f"{interval(summary['accuracy_ci'])} ({summary['accuracy_ci_method']})"],
            ["accuracy, Wilson", fmt(summary["accuracy"]), f"{interval(summary['accuracy_wilson'])} "
                                                           f"({summary['accuracy_wilson_method']})"],
            *[[f"pass@{k}", fmt(v), "unbiased estimator 1 - C(n-c,k)/C(n,k), mean over tasks"]
              for k, v in summary["pass_at_k"].items()],
            [f"best-of-{summary['best_of_k']['passes']}: tasks solved", fmt(summary["best_of_k"]["accuracy"]),
             "share of tasks with at least one correct pass"],
            [f"best-of-{summary['best_of_k']['passes']}: reward", fmt(summary["best_of_k"]["reward"]),
             "mean over tasks of the best pass's total reward"],
            ["mean reward", fmt(summary["reward"]), "weighted sum of the reward parts"],
            ["tests passed (fraction)", fmt(summary["tests_fraction"]),
             "expected hidden tests passed, from per-test outcomes (docs/grading.md)"],
            ["episodes", fmt(summary["episodes"]), f"{summary['tasks_run']} of {summary['tasks']} tasks x "
                                                   f"{summary['passes']} passes; complete: {fmt(summary['complete'])}"],
            ["statuses", ", ".join(f"{k} {v}" for k, v in sorted(summary["statuses"].items())) or "-", ""]]
    if summary.get("prices_per_million_tokens"):
        rows.append(["cost, total", fmt(eff["cost_total"], 4), f"prices per million tokens: "
                                                                 f"{summary['prices_per_million_tokens']}"])
    return rows


def build(summary: dict, title: str) -> Document:
    doc = Document(title)
    setup = summary.get("swarm_setup")
    mode = (f"; agent swarm (sub-agents: {setup.get('subagent_policy')}, at most {setup.get('max_subagents')})"
            if summary.get("agent_mode") == "swarm" and setup else "")
    doc.paragraph(f"Suite: {summary.get('suite_spec', '-')}; agent: {summary.get('agent', '-')}"
                  f"{'; model: ' + summary['model'] if summary.get('model') else ''}{mode}. Token counts: "
                  f"{summary['token_counter']}" + (", orchestrator and sub-agents together" if mode else "") + ".")
    doc.heading("Overview")
    doc.table(["metric", "value", "how"], overview_rows(summary))

    suite = summary["suite"]
    doc.heading("Suite shape")
    doc.table(["statistic", "this suite", "CursorBench"],
              [["tasks", suite["tasks"], "-"],
               ["median changed lines of the reference solution", fmt(suite["median_reference_diff_lines"], 1),
                suite["cursorbench"]["median_reference_diff_lines"]],
               ["median instruction characters", fmt(suite["median_instruction_chars"], 1),
                suite["cursorbench"]["median_instruction_chars"]]])
    if suite["tasks_with_reference_diff"] < suite["tasks"]:
        doc.paragraph(f"{suite['tasks_with_reference_diff']} of {suite['tasks']} tasks state "
                      "metadata.reference_diff_lines.")

    eff, quality, inter = summary["efficiency"], summary["code_quality"], summary["interaction"]
    doc.heading("Code quality, efficiency, interaction (means per episode)")
    rows = [["style: new ruff diagnostics on changed lines", fmt(quality["style"])],
            ["diff size (added + removed lines)", fmt(quality["diff_lines"])],
            ["diff size, median", fmt(quality["diff_lines_median"])],
            ["diff size / reference diff size, median over tasks", fmt(quality["diff_to_reference_median"])]]
    rows += [[f"tokens: {c.replace('_tokens', '').replace('_', ' ')}", fmt(eff[c], 1)]
             for c in (*CATEGORIES, "thinking_tokens", "tool_call_tokens", "tool_output_tokens", "message_tokens")]
    rows += [["tool calls", fmt(eff["tool_calls"], 2)], ["turns (of the agent or orchestrator)", fmt(eff["turns"], 2)],
             ["total steps (every model turn, sub-agents included)", fmt(eff.get("total_steps"), 2)],
             ["critical steps (per stage: orchestrator turns + longest sub-agent)", fmt(eff.get("critical_steps"), 2)],
             ["wall-clock per episode, s (grading included)", fmt(eff["wall_s"], 2)],
             ["wall-clock, all episodes summed, s", fmt(eff.get("wall_s_total"), 1)], ["cost", fmt(eff["cost"], 5)]]
    rows += [[f"interaction: {p.replace('_', ' ')}", fmt(v)] for p, v in inter.items()]
    doc.table(["metric", "value"], rows)
    if summary.get("swarm"):
        doc.heading("Agent swarm (means per episode)")
        doc.table(["statistic", "value"], [[k.replace("_", " "), fmt(v, 2)] for k, v in summary["swarm"].items()])

    per_task = summary["per_task"]
    ids = [i for i, t in per_task.items() if t["passes"]]
    key, label = cost_axis(summary)
    doc.heading("Per task")
    doc.table(["task", "passes", "accuracy", "Wilson 95%", f"pass@{summary['passes']}", "best reward",
               "diff lines", "ref. diff", "total steps", "critical steps", "tokens", "wall s"],
              [[i, t["passes"], fmt(t["accuracy"]), interval(t["accuracy_ci"]),
                fmt(t["pass_at_k"].get(str(t["passes"]))), fmt(t["best_reward"]),
                fmt(t["code_quality"]["diff_lines"], 1), fmt(t["code_quality"]["reference_diff_lines"]),
                fmt(t["efficiency"].get("total_steps"), 1), fmt(t["efficiency"].get("critical_steps"), 1),
                fmt(t["efficiency"]["total_tokens"], 0), fmt(t["efficiency"]["wall_s"], 1)]
               for i, t in per_task.items()])

    if ids:
        doc.heading("Figures")
        shown = sorted(ids, key=lambda i: per_task[i]["accuracy"])[:plots.MAX_ROWS]
        labels = ["overall"] + shown
        values = [summary["accuracy"]] + [per_task[i]["accuracy"] for i in shown]
        cis = [summary["accuracy_ci"]] + [per_task[i]["accuracy_ci"] for i in shown]
        doc.figure("accuracy", plots.accuracy_intervals(labels, values, cis, "Accuracy (overall: bootstrap 95% over "
                                                        "tasks; tasks: Wilson 95% over passes)", highlight=[True]),
                   "Accuracy with 95% intervals" + (f" ({len(shown)} lowest of {len(ids)} tasks)"
                                                    if len(shown) < len(ids) else ""))
        xs = [eff[key]] + [per_task[i]["efficiency"][key] for i in ids]
        doc.figure("pareto", plots.pareto(["overall"] + ids, xs, [summary["accuracy"]] +
                                          [per_task[i]["accuracy"] for i in ids], label,
                                          "Accuracy against " + label, highlight=[True]),
                   f"Accuracy against {label}: the run (star) and each task; dashed: Pareto frontier")
        passes = max(max(per_task[i]["pass_indices"]) + 1 for i in ids)
        grid = np.full((len(shown), passes), np.nan)
        for row, i in enumerate(shown):
            grid[row, per_task[i]["pass_indices"]] = per_task[i]["correct"]
        doc.figure("heatmap", plots.heatmap(shown, [f"pass {k}" for k in range(passes)], grid,
                                            "Correctness per task and pass"), "Task x pass correctness")
    return doc
