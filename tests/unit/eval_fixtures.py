"""A tiny evaluation suite for the eval tests: the demo calc repository (hidden tests outside it) under several
task ids, each with its own reference diff size, and script-agent folders (oracle, no-op)."""

from __future__ import annotations

import importlib.util
import json
import os

from megatron_ext.env.demo import ORACLE, make_task

REFERENCE_DIFF_LINES = {"add-a": 2, "add-b": 6, "add-c": 40}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_suite(root: str, ids=("add-a", "add-b")) -> str:
    """root/suite/suite.jsonl holding one task per id (same repo and hidden tests); returns its path."""
    template = json.load(open(make_task(os.path.join(root, "suite"))))
    os.remove(os.path.join(root, "suite", "task.json"))
    path = os.path.join(root, "suite", "suite.jsonl")
    with open(path, "w") as f:
        for i, task_id in enumerate(ids):
            record = {**template, "id": task_id, "instruction": template["instruction"] + " " * i,
                      "metadata": {**template["metadata"], "reference_diff_lines": REFERENCE_DIFF_LINES[task_id]}}
            f.write(json.dumps(record) + "\n")
    return path


def script_dir(root: str, name: str, actions_by_id: dict) -> str:
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    for task_id, actions in actions_by_id.items():
        with open(os.path.join(folder, f"{task_id}.json"), "w") as f:
            json.dump(actions, f)
    return folder


def oracle_dir(root: str, ids=("add-a", "add-b")) -> str:
    return script_dir(root, "oracle", {i: ORACLE for i in ids})


def run_eval_main():
    """tools/run_eval.py's main(), imported (no new interpreter)."""
    spec = importlib.util.spec_from_file_location("run_eval", os.path.join(ROOT, "tools", "run_eval.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main
