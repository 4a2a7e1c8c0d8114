"""`--tasks SUITE`: a task suite in the agentic environment's format (megatron_ext/env/tasks.py), and its shape.

SUITE is one of
* a ``.json`` / ``.jsonl`` task file;
* a directory: every ``*.json`` and ``*.jsonl`` file directly in it plus every ``*/task.json`` one level down
  (the layout tools/mine_tasks.py and megatron_ext/env/demo.py write), in sorted order;
* ``builtin:NAME``: a built-in suite, materialised on disk by `megatron_ext.eval.suites.materialize(NAME)`;
* any of these followed by ``#ID``: that one task (as tools/run_episode.py takes ``FILE.jsonl#ID``).

`select_tasks` narrows a suite to ``--filter GLOB`` / ``--task-ids`` (an id that names no task is an error, a glob
that matches none too: a typo never silently evaluates nothing or everything).

Task ids must be unique across the suite. `suite_statistics` gives the two numbers CursorBench describes itself
by (REFERENCE.md): the median changed lines of the reference solutions (the tasks' ``metadata.reference_diff_lines``,
added plus removed lines) and the median instruction length in characters.
"""

from __future__ import annotations

import fnmatch
import glob
import os

from megatron_ext.env.tasks import Task, TaskError, load_tasks
from megatron_ext.eval.stats import median

CURSORBENCH = {"median_reference_diff_lines": 181, "median_instruction_chars": 390}


def resolve_suite(spec: str) -> str:
    """The path a --tasks spec names (materialising a builtin: suite)."""
    if spec.startswith("builtin:"):
        name = spec[len("builtin:"):]
        try:
            from megatron_ext.eval.suites import materialize
        except ImportError as e:
            raise TaskError(f"--tasks {spec}: built-in suites are not available in this installation "
                            f"(megatron_ext.eval.suites: {e})") from None
        try:
            return materialize(name)
        except (KeyError, ValueError, RuntimeError) as e:  # an unknown name, a fetch or mining failure
            raise TaskError(f"--tasks {spec}: {e}") from None
    if not os.path.exists(spec):
        raise TaskError(f"--tasks {spec}: no such file or directory (a .json/.jsonl task file, a directory of "
                        "them, or builtin:NAME)")
    return spec


def suite_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    files = sorted(glob.glob(os.path.join(path, "*.json")) + glob.glob(os.path.join(path, "*.jsonl")) +
                   glob.glob(os.path.join(path, "*", "task.json")))
    if not files:
        raise TaskError(f"--tasks {path}: the directory holds no *.json, *.jsonl or */task.json task files")
    return files


def load_suite(spec: str) -> list[Task]:
    """Every task of the suite `spec` names (one task with ``#ID``); ids unique."""
    base, hash_, wanted = spec.rpartition("#") if "#" in spec and not os.path.exists(spec) else (spec, "", "")
    if hash_:
        tasks = load_suite(base)
        picked = [t for t in tasks if t.id == wanted]
        if not picked:
            raise TaskError(f"--tasks {spec}: {base} has no task with id {wanted!r} (ids: "
                            f"{[t.id for t in tasks][:10]}{'...' if len(tasks) > 10 else ''})")
        return picked
    tasks, where = [], {}
    for path in suite_files(resolve_suite(spec)):
        for task in load_tasks(path):
            if task.id in where:
                raise TaskError(f"--tasks {spec}: task id {task.id!r} appears in {where[task.id]} and {path}")
            where[task.id] = path
            tasks.append(task)
    return tasks


def select_tasks(tasks: list[Task], filters=(), ids=()) -> list[Task]:
    """The tasks whose id matches any of `filters` (fnmatch globs) and, with `ids`, is one of them; suite order."""
    known = {t.id for t in tasks}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise TaskError(f"--task-ids: no task with id {unknown[:10]} in the suite (see --list)")
    unmatched = [g for g in filters if not any(fnmatch.fnmatchcase(t.id, g) for t in tasks)]
    if unmatched:
        raise TaskError(f"--filter {unmatched[0]!r} matches no task id of the suite (see --list)")
    picked = [t for t in tasks if (not ids or t.id in ids) and
              (not filters or any(fnmatch.fnmatchcase(t.id, g) for g in filters))]
    if not picked:
        raise TaskError("--filter and --task-ids together select no task (see --list)")
    return picked


def suite_statistics(tasks: list[Task]) -> dict:
    """The suite's shape next to CursorBench's."""
    diffs = [t.metadata["reference_diff_lines"] for t in tasks
             if isinstance(t.metadata.get("reference_diff_lines"), (int, float))]
    return {"tasks": len(tasks),
            "median_reference_diff_lines": median(diffs),
            "tasks_with_reference_diff": len(diffs),
            "median_instruction_chars": median([len(t.instruction) for t in tasks]),
            "cursorbench": dict(CURSORBENCH)}
