"""The task format as a JSON Schema (docs/task.schema.json), and `tools/run_eval.py --validate TASKS`.

The schema states what megatron_ext/env/tasks.py's loader accepts, so other tools (editors, dataset converters,
CI of a task repository) can check tasks without this package; a unit test keeps the two in step. `--validate`
applies both: the schema (every error, with its JSON path) and the loader (what a schema cannot see: the repo and
hidden_tests paths exist, hidden tests lie outside the repo, ids are unique).

    python -m megatron_ext.eval.schema > docs/task.schema.json     # regenerate the published copy
"""

from __future__ import annotations

import json
import os
import sys

_POSITIVE = {"type": "number", "exclusiveMinimum": 0}

TASK_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "megatron_ext repository task",
    "description": "One task: a .json file holds one object or a list of them, a .jsonl file one object a line. "
                   "Relative paths are relative to the file holding the task.",
    "type": "object",
    "required": ["id", "repo", "instruction", "test_command", "timeout_s"],
    "additionalProperties": False,
    "properties": {
        "id": {"type": "string", "pattern": r"\S", "description": "unique within a suite"},
        "repo": {"type": "string", "description": "a directory or a .tar.gz/.tgz/.tar file; copied, never modified"},
        "instruction": {"type": "string", "pattern": r"\S", "description": "what the agent is asked to do"},
        "test_command": {"type": "string", "pattern": r"\S",
                         "description": "run by /bin/sh in the workspace after the episode; exit 0 = correct"},
        "timeout_s": {**_POSITIVE, "description": "wall-clock limit of test_command, seconds"},
        "hidden_tests": {"type": ["string", "null"],
                         "description": "a directory laid over the workspace only for grading (outside repo)"},
        "forbidden": {"type": "array", "items": {"type": "string", "minLength": 1},
                      "description": "globs ('*' crosses folders) of files the agent must not edit"},
        "max_turns": {"type": "integer", "minimum": 1, "description": "agent turns (default 30)"},
        "command_timeout_s": {**_POSITIVE, "description": "limit of one agent command, seconds (default 60)"},
        "environment": {"type": ["string", "null"],
                        "description": "the task's virtual environment (a folder with bin/python): its python "
                                       "runs the agent's commands and grading"},
        "metadata": {"type": "object", "description": "anything else: source, category, reference_diff_lines, "
                                                      "fail_to_pass, ..."},
    },
}


def _records(path: str) -> list[tuple[str, object]]:
    """(where, JSON value) of every task record in a task file; an unreadable file is one ('path', error) pair."""
    with open(path) as f:
        text = f.read()
    if path.endswith(".jsonl"):
        out = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append((f"{path}:{number}", json.loads(line)))
                except ValueError as e:
                    out.append((f"{path}:{number}", ValueError(f"invalid JSON ({e})")))
        return out
    try:
        value = json.loads(text)
    except ValueError as e:
        return [(path, ValueError(f"invalid JSON ({e})"))]
    return [(f"{path}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(path, value)]


def schema_errors(record) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(TASK_SCHEMA)
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(task)'}: {e.message}"
            for e in sorted(validator.iter_errors(record), key=lambda e: list(map(str, e.absolute_path)))]


def validate_paths(paths: list[str], out=None, err=None) -> int:
    """Print every problem of the task files (or directories of them) at paths; 0 when all are valid, else 2.
    The streams default to sys.stdout/sys.stderr as they are at the call (not at import: a capture replaces them)."""
    out, err = out or sys.stdout, err or sys.stderr
    from megatron_ext.env.tasks import TaskError, load_tasks
    from megatron_ext.eval.tasks import suite_files

    problems, count = [], 0
    for spec in paths:
        if not os.path.exists(spec):
            problems.append(f"{spec}: no such file or directory")
            continue
        try:
            files = suite_files(spec)
        except TaskError as e:
            problems.append(str(e))
            continue
        for path in files:
            before = len(problems)
            try:
                records = _records(path)
            except OSError as e:
                problems.append(f"{path}: cannot read ({e.strerror})")
                continue
            for where, record in records:
                count += 1
                if isinstance(record, Exception):
                    problems.append(f"{where}: {record}")
                else:
                    problems += [f"{where}: {m}" for m in schema_errors(record)]
            if len(problems) == before:  # the schema holds: what only the loader can check
                try:
                    load_tasks(path)
                except TaskError as e:
                    problems.append(str(e))
    for p in problems:
        print(f"invalid: {p}", file=err)
    print(f"{count} tasks checked in {len(paths)} path(s): " + (f"{len(problems)} problems" if problems
                                                                  else "all valid"), file=out)
    return 2 if problems else 0


if __name__ == "__main__":
    print(json.dumps(TASK_SCHEMA, indent=1))
