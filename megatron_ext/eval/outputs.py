"""What a run directory holds once results are in: episodes.jsonl (every finished episode: transcript, tool
calls, grading, token counts and usage, reward parts), summary.json (metrics.py) and the report (report.py).
All are rewritten from the per-episode files each time, atomically, so they always agree with them."""

from __future__ import annotations

import json
import os

from megatron_ext.atomic import atomic_output
from megatron_ext.env.tasks import Task
from megatron_ext.eval import report
from megatron_ext.eval.harness import RunDir
from megatron_ext.eval.metrics import summarise
from megatron_ext.eval.usage import Prices


def publish(run: RunDir, tasks: list[Task], passes: int, prices: Prices, token_counter: str) -> dict:
    """Write episodes.jsonl, summary.json, report.md/.html (+ figures); returns the summary."""
    records = run.records(tasks, passes)
    with atomic_output(os.path.join(run.root, "episodes.jsonl")) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    manifest = run.manifest() or {}
    summary = summarise(tasks, records, passes, prices, token_counter)
    summary = {**{k: manifest.get(k) for k in ("suite_spec", "agent", "model")}, **summary}
    with atomic_output(os.path.join(run.root, "summary.json")) as f:
        json.dump(summary, f, indent=1)
    title = f"Evaluation: {manifest.get('agent', '?')} on {manifest.get('suite_spec', '?')}"
    report.build(summary, title).write(run.root, "report")
    return summary


def load_summary(run_dir: str) -> dict:
    path = os.path.join(run_dir, "summary.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--compare {run_dir}: no summary.json (not a finished evaluation run; run or "
                                "resume it with tools/run_eval.py first)") from None
