"""From episode records to the numbers a report shows: per task and overall.

An episode counts as correct when its `correctness` reward part is 1 (the hidden test command exited 0).

* correctness: accuracy = mean over tasks of the task's mean over its passes, with a 95 % percentile bootstrap
  interval over tasks (passes of a task resampled together; `stats.bootstrap_mean`) and, for reference, the Wilson
  interval over all episodes (which treats passes as independent); per task, the Wilson interval over its passes;
  pass@k (unbiased estimator) for k up to the passes every task has; best-of-K: the share of tasks with at least
  one correct pass, and the mean over tasks of the best total reward;
* code quality: the `style` part (new ruff diagnostics on changed lines), the agent's diff size (added plus
  removed lines, grading.diff_lines) and its ratio to the reference solution's (metadata.reference_diff_lines);
* efficiency: tokens by category (usage.py: input, cached input, output; the episode's thinking, tool-call,
  tool-output and message tokens), tool calls, turns, wall time, cost under the given prices, and agent-swarm
  critical steps where episodes report them (`critical_steps`, next to total turns);
* interaction: the `communication` part, the penalties (invalid/repeated calls, unfinished todos, forbidden edits)
  and the length penalty.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np

from megatron_ext.env.tasks import Task
from megatron_ext.eval.stats import bootstrap_mean, median, pass_at_k, wilson
from megatron_ext.eval.tasks import suite_statistics
from megatron_ext.eval.usage import CATEGORIES, Prices

COUNT_CATEGORIES = ("thinking_tokens", "tool_call_tokens", "tool_output_tokens", "message_tokens")
INTERACTION_PARTS = ("communication", "invalid_calls", "repeated_calls", "unfinished_todos", "forbidden_edits",
                     "length")
BOOTSTRAP = "95% percentile bootstrap over tasks (10000 resamples, seed 0)"
WILSON = "95% Wilson score interval"


def correct(record: dict) -> bool:
    return record["reward"].get("correctness", 0.0) == 1.0


def critical_steps(record: dict) -> Optional[float]:
    value = record.get("critical_steps", record.get("counts", {}).get("critical_steps"))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def episode_row(record: dict, prices: Prices) -> dict:
    """The per-episode numbers every aggregate is a mean of."""
    usage, counts, reward = record["usage"], record["counts"], record["reward"]
    row = {"correct": float(correct(record)), "reward": float(reward.get("total", 0.0)),
           "style": float(reward.get("style", 0.0)), "tests_fraction": float(reward.get("tests_fraction", 0.0)),
           "diff_lines": float(record["grading"].get("diff_lines", 0)),
           "tool_calls": float(counts.get("tool_calls", 0)), "turns": float(counts.get("turns", 0)),
           "wall_s": float(record.get("wall_s", 0.0)), "cost": prices.cost(usage),
           **{c: float(usage[c]) for c in CATEGORIES}, **{c: float(counts.get(c, 0)) for c in COUNT_CATEGORIES},
           **{p: float(reward.get(p, 0.0)) for p in INTERACTION_PARTS}}
    row["total_tokens"] = sum(row[c] for c in CATEGORIES)
    steps = critical_steps(record)
    if steps is not None:
        row["critical_steps"] = steps
    return row


def _mean(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return float(np.mean(values)) if values else None


def task_summary(task: Task, records: list[dict], prices: Prices) -> dict:
    rows = [episode_row(r, prices) for r in records]
    n, c = len(rows), int(sum(r["correct"] for r in rows))
    reference = task.metadata.get("reference_diff_lines")
    reference = reference if isinstance(reference, (int, float)) and reference > 0 else None
    diff = _mean(rows, "diff_lines")
    out = {"passes": n, "correct": [int(r["correct"]) for r in rows], "pass_indices": [r["pass"] for r in records],
           "accuracy": c / n if n else None, "accuracy_ci": list(wilson(c, n)) if n else None,
           "pass_at_k": {str(k): pass_at_k(n, c, k) for k in range(1, n + 1)},
           "best_reward": max((r["reward"] for r in rows), default=None),
           "reward": _mean(rows, "reward"), "tests_fraction": _mean(rows, "tests_fraction"),
           "statuses": dict(Counter(r["status"] for r in records)),
           "code_quality": {"style": _mean(rows, "style"), "diff_lines": diff, "reference_diff_lines": reference,
                            "diff_to_reference": diff / reference if reference and diff is not None else None},
           "efficiency": {k: _mean(rows, k) for k in (*CATEGORIES, *COUNT_CATEGORIES, "total_tokens", "tool_calls",
                                                      "turns", "critical_steps", "wall_s", "cost")},
           "interaction": {p: _mean(rows, p) for p in INTERACTION_PARTS},
           "instruction_chars": len(task.instruction)}
    if out["efficiency"]["critical_steps"] is None:
        del out["efficiency"]["critical_steps"]
    return out


def pass_ks(passes: int) -> list[int]:
    """1, 2, 4, ... up to passes, and passes itself."""
    ks, k = [], 1
    while k < passes:
        ks.append(k)
        k *= 2
    return ks + [passes] if passes else []


def summarise(tasks: list[Task], records: list[dict], passes: int, prices: Optional[Prices] = None,
              token_counter: str = "estimate: 4 bytes a token") -> dict:
    """summary.json: overall numbers, then per-task results keyed by task id."""
    prices = prices or Prices()
    by_task = {t.id: [] for t in tasks}
    for r in records:
        by_task[r["task"]].append(r)
    per_task = {t.id: task_summary(t, by_task[t.id], prices) for t in tasks}
    ran = [t.id for t in tasks if per_task[t.id]["passes"]]
    accuracies = [per_task[i]["accuracy"] for i in ran]
    rows = [episode_row(r, prices) for r in records]
    total_correct = int(sum(r["correct"] for r in rows))
    full = min((per_task[i]["passes"] for i in ran), default=0)
    rewards = [per_task[i]["best_reward"] for i in ran]
    efficiency = {k: _mean(rows, k) for k in (*CATEGORIES, *COUNT_CATEGORIES, "total_tokens", "tool_calls", "turns",
                                              "critical_steps", "wall_s", "cost")}
    if efficiency["critical_steps"] is None:
        del efficiency["critical_steps"]
    efficiency["cost_total"] = float(sum(r["cost"] for r in rows))
    efficiency["wall_s_total"] = float(sum(r["wall_s"] for r in rows))
    reference_ratios = [per_task[i]["code_quality"]["diff_to_reference"] for i in ran
                        if per_task[i]["code_quality"]["diff_to_reference"] is not None]
    return {
        "accuracy": float(np.mean(accuracies)) if accuracies else None,
        "accuracy_ci": list(bootstrap_mean(accuracies)) if accuracies else None,
        "accuracy_ci_method": BOOTSTRAP,
        "accuracy_wilson": list(wilson(total_correct, len(rows))) if rows else None,
        "accuracy_wilson_method": WILSON + " over all episodes (treats passes as independent)",
        "pass_at_k": {str(k): float(np.mean([pass_at_k(per_task[i]["passes"], sum(per_task[i]["correct"]), k)
                                             for i in ran])) for k in pass_ks(full)},
        "best_of_k": {"passes": full, "accuracy": float(np.mean([a > 0 for a in accuracies])) if ran else None,
                      "reward": float(np.mean(rewards)) if ran else None},
        "reward": _mean(rows, "reward"),
        "tests_fraction": _mean(rows, "tests_fraction"),
        "episodes": len(rows), "tasks": len(tasks), "tasks_run": len(ran), "passes": passes,
        "complete": len(rows) == len(tasks) * passes,
        "statuses": dict(Counter(r["status"] for r in records)),
        "code_quality": {"style": _mean(rows, "style"), "diff_lines": _mean(rows, "diff_lines"),
                         "diff_lines_median": median([r["diff_lines"] for r in rows]),
                         "diff_to_reference_median": median(reference_ratios)},
        "efficiency": efficiency,
        "interaction": {p: _mean(rows, p) for p in INTERACTION_PARTS},
        "suite": suite_statistics(tasks),
        "prices_per_million_tokens": prices.to_json() if prices.given else None,
        "token_counter": token_counter,
        "per_task": per_task,
    }
