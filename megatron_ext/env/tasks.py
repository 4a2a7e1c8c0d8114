"""Repository tasks: what an episode starts from and how it is graded.

A task is a JSON object (a ``.json`` file, or one line of a ``.jsonl`` suite):

    {"id": "calc-add",                       # unique
     "repo": "repos/calc",                   # a directory or a .tar.gz/.tgz/.tar; copied, never modified
     "instruction": "Implement calc.add ...",
     "test_command": "python -m pytest -q tests_hidden",   # run in the workspace after the episode; 0 = correct
     "timeout_s": 120,                       # wall-clock limit of test_command
     "hidden_tests": "hidden/calc",          # optional: a directory laid over the workspace only for grading
     "forbidden": ["tests/*"],               # optional: globs ('*' crosses folders) of files the agent must not
                                             # edit; changed ones are counted and restored before grading
     "max_turns": 30, "command_timeout_s": 60,             # optional episode limits
     "environment": "envs/3f2a...",          # optional: the task's virtual environment (environments.py); its
                                             # python runs the agent's commands and grading
     "metadata": {"source": "...", "category": "...", "reference_diff_lines": 12}}

Relative paths are relative to the file that holds the task. The agent's copy never contains ``.git`` (history
would give the answer away) nor the hidden tests, which live outside its workspace until grading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional


class TaskError(ValueError):
    """A task that cannot be used; the message names the file, the line and the field."""


@dataclass
class Task:
    id: str
    repo: str
    instruction: str
    test_command: str
    timeout_s: float
    hidden_tests: Optional[str] = None
    forbidden: list = field(default_factory=list)
    max_turns: int = 30
    command_timeout_s: float = 60.0
    metadata: dict = field(default_factory=dict)
    environment: Optional[str] = None

    def to_json(self) -> dict:
        return {"id": self.id, "repo": self.repo, "instruction": self.instruction,
                "test_command": self.test_command, "timeout_s": self.timeout_s, "hidden_tests": self.hidden_tests,
                "forbidden": list(self.forbidden), "max_turns": self.max_turns,
                "command_timeout_s": self.command_timeout_s, "metadata": dict(self.metadata),
                **({"environment": self.environment} if self.environment else {})}


_REQUIRED = {"id": str, "repo": str, "instruction": str, "test_command": str, "timeout_s": (int, float)}
_OPTIONAL = {"hidden_tests": (str, type(None)), "forbidden": list, "max_turns": int,
             "command_timeout_s": (int, float), "metadata": dict, "environment": (str, type(None))}


def task_from_dict(record, base_dir: str, where: str) -> Task:
    """A validated Task; relative repo/hidden_tests paths are resolved against base_dir."""
    if not isinstance(record, dict):
        raise TaskError(f"{where}: a task must be a JSON object, got {type(record).__name__}")
    for key, kind in _REQUIRED.items():
        if key not in record:
            raise TaskError(f"{where}: missing required field '{key}' (required: {sorted(_REQUIRED)})")
    unknown = set(record) - set(_REQUIRED) - set(_OPTIONAL)
    if unknown:
        raise TaskError(f"{where}: unknown fields {sorted(unknown)}; put extra information under 'metadata'")
    for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if key in record and (not isinstance(record[key], kind) or isinstance(record[key], bool)):
            raise TaskError(f"{where}: field '{key}' has the wrong type ({type(record[key]).__name__})")
    for key in ("id", "instruction", "test_command"):
        if not record[key].strip():
            raise TaskError(f"{where}: field '{key}' is empty")
    if record["timeout_s"] <= 0 or record.get("command_timeout_s", 1) <= 0 or record.get("max_turns", 1) <= 0:
        raise TaskError(f"{where}: timeout_s, command_timeout_s and max_turns must be positive")
    if not all(isinstance(g, str) and g for g in record.get("forbidden", [])):
        raise TaskError(f"{where}: 'forbidden' must be a list of non-empty glob strings")

    def resolve(path: str) -> str:
        return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))

    task = Task(**{k: record[k] for k in record})
    task.repo = resolve(task.repo)
    if not (os.path.isdir(task.repo) or (os.path.isfile(task.repo) and
                                         task.repo.endswith((".tar.gz", ".tgz", ".tar")))):
        raise TaskError(f"{where}: repo {task.repo} is neither a directory nor a .tar.gz/.tgz/.tar file")
    if task.hidden_tests is not None:
        task.hidden_tests = resolve(task.hidden_tests)
        if not os.path.isdir(task.hidden_tests):
            raise TaskError(f"{where}: hidden_tests {task.hidden_tests} is not a directory")
        if _inside(task.hidden_tests, task.repo):
            raise TaskError(f"{where}: hidden_tests {task.hidden_tests} lies inside the repo; the agent would see "
                            "them - move them outside")
    if task.environment is not None:
        task.environment = resolve(task.environment)
        if not os.path.isfile(os.path.join(task.environment, "bin", "python")):
            raise TaskError(f"{where}: environment {task.environment} is not a virtual environment (no bin/python)")
    task.forbidden = list(task.forbidden)
    task.metadata = dict(task.metadata)
    return task


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def load_tasks(path: str) -> list[Task]:
    """Every task in a .json file (one object or a list) or a .jsonl file (one per line); ids must be unique."""
    try:
        text = open(path).read()
    except OSError as e:
        raise TaskError(f"{path}: cannot read ({e.strerror})") from None
    base = os.path.dirname(os.path.abspath(path))
    tasks = []
    if path.endswith(".jsonl"):
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise TaskError(f"{path}:{number}: invalid JSON ({e})") from None
                tasks.append(task_from_dict(record, base, f"{path}:{number}"))
    else:
        try:
            record = json.loads(text)
        except ValueError as e:
            raise TaskError(f"{path}: invalid JSON ({e})") from None
        records = record if isinstance(record, list) else [record]
        tasks = [task_from_dict(r, base, f"{path}[{i}]" if isinstance(record, list) else path)
                 for i, r in enumerate(records)]
    if not tasks:
        raise TaskError(f"{path}: holds no tasks")
    seen = set()
    for t in tasks:
        if t.id in seen:
            raise TaskError(f"{path}: duplicate task id {t.id!r}")
        seen.add(t.id)
    return tasks


def load_task(spec: str) -> Task:
    """One task: PATH.json, or PATH.jsonl (must hold one task) or PATH.jsonl#ID."""
    path, _, wanted = spec.partition("#")
    tasks = load_tasks(path)
    if wanted:
        for t in tasks:
            if t.id == wanted:
                return t
        raise TaskError(f"{path}: no task with id {wanted!r} (ids: {[t.id for t in tasks][:10]}...)")
    if len(tasks) != 1:
        raise TaskError(f"{path} holds {len(tasks)} tasks; choose one with {path}#ID")
    return tasks[0]
