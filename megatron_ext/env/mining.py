"""Task mining from real code with tests: feature deletion, and reverting a commit that changed code and tests.

Feature deletion (`Miner.mine`): remove the body of a function the tests cover, ask the agent to implement it.

For each source (a directory, a git checkout or an sdist .tar.gz):

1. copy it (without .git) and run its test suite once in a sandbox (pytest, JUnit XML): the reference results;
2. candidates, in a deterministic order (path, line; or shuffled by ``seed``, the same seed giving the same
   order): top-level functions and methods outside the tests whose body (docstring aside) has at least
   ``min_body_lines`` lines and whose name some test file mentions; at most ``max_per_file`` tasks come from one
   file, so a small ``max_tasks`` still spreads over the package;
3. for each candidate, replace the body by ``raise NotImplementedError`` (the docstring stays) and rerun the suite:
   the tests that passed on the reference and now fail are the task's fail-to-pass tests (none: skipped);
4. write the task: the agent's repository is the deleted version without its test files; the test files are the
   hidden tests; ``test_command`` runs the test files holding the fail-to-pass tests, deselecting any test that
   already failed on the reference; then verify with that exact command that the deleted version fails and the
   reference passes (otherwise skipped). A command the sandbox cannot start (exit 126/127) is its own reason.

``reference_diff_lines`` is `megatron_ext.env.episode.diff_lines` from the agent's starting files to the
reference: the measure grading applies to the agent's changes, so an exact oracle has ratio 1.0.

Commits (`Miner.mine_commits`, git checkouts): for each of the last N non-merge commits that changed code and
tests, the agent gets the parent's code (tests removed) and the commit message; the hidden tests are the commit's
test files; fail-to-pass are the commit's changed tests that pass at the commit and fail on the parent's code;
verified the same way.

Everything skipped is reported with its reason. The same inputs give the same tasks.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import io
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Optional

from megatron_ext.atomic import atomic_output
from megatron_ext.env.environments import (EnvBuildError, EnvConfig, build_environment, requirements_for_tests,
                                          sandbox_for)
from megatron_ext.env.episode import diff_lines
from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox, Limits, SandboxError, copy_source

TEST_GLOBS = ("test_*.py", "*_test.py", "conftest.py")
TEST_DIRS = ("tests", "test", "testing")
REPORT = "/tmp/junit.xml"
NOT_STARTED = (126, 127)  # /bin/sh: the command is not executable / not found


@dataclass
class MineConfig:
    min_body_lines: int = 2
    max_candidates: int = 20         # per source, after the name filter
    max_tasks: int = 10              # per source
    max_per_file: Optional[int] = None  # tasks from one file, per source (None: no cap)
    seed: Optional[int] = None       # shuffle the candidates with this seed (None: path, line order)
    timeout_s: float = 300.0         # one run of the test suite
    sandbox: BubblewrapConfig = field(default_factory=lambda: BubblewrapConfig(
        limits=Limits(wall_s=300.0, cpu_s=600, output_bytes=16 << 20)))
    env: Optional[EnvConfig] = None  # per-source environments (environments.py); None: the harness's python


def is_test_file(rel: str) -> bool:
    parts = rel.split(os.sep)
    return rel.endswith(".py") and (any(p in TEST_DIRS for p in parts[:-1]) or
                                    any(fnmatch.fnmatch(parts[-1], g) for g in TEST_GLOBS))


def python_files(root: str) -> list[str]:
    out = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__"))
        out += [os.path.relpath(os.path.join(base, f), root) for f in sorted(files) if f.endswith(".py")]
    return out


def pythonpath(root: str) -> str:
    """'src' for a src layout, else ''."""
    src = os.path.join(root, "src")
    return "src" if os.path.isdir(src) and any(os.path.isfile(os.path.join(src, d, "__init__.py"))
                                               for d in os.listdir(src)) else ""


def pytest_command(root: str, args: str) -> str:
    path = pythonpath(root)
    return (f"PYTHONPATH={path} " if path else "") + f"python -m pytest -q -p no:cacheprovider {args}"


@dataclass
class Candidate:
    path: str
    qualname: str
    lineno: int
    body_start: int     # first body line after the docstring (1-based)
    end: int            # last line of the function
    indent: str
    signature: str
    docstring: Optional[str]

    @property
    def id(self) -> str:
        return f"{self.path}::{self.qualname}"


def candidates(root: str, files: list[str], min_body_lines: int) -> tuple[list[Candidate], list[tuple[str, str]]]:
    out, skipped = [], []
    for rel in files:
        try:
            source = open(os.path.join(root, rel), encoding="utf-8").read()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError) as e:
            skipped.append((rel, f"cannot parse ({type(e).__name__})"))
            continue
        lines = source.splitlines()

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    body = child.body
                    doc = ast.get_docstring(child)
                    rest = body[1:] if doc is not None else body
                    if not rest:
                        skipped.append((f"{rel}::{name}", "no body besides the docstring"))
                        continue
                    start, end = rest[0].lineno, child.end_lineno
                    if end - start + 1 < min_body_lines:
                        skipped.append((f"{rel}::{name}", f"body shorter than {min_body_lines} lines"))
                        continue
                    if start == child.lineno or (doc is not None and start == body[0].end_lineno):
                        skipped.append((f"{rel}::{name}", "body shares a line with the def or the docstring"))
                        continue
                    header = "\n".join(lines[child.lineno - 1: body[0].lineno - 1]).strip() or lines[child.lineno - 1]
                    first = lines[start - 1]
                    out.append(Candidate(rel, name, child.lineno, start, end, first[:len(first) - len(first.lstrip())],
                                         header.strip(), doc))
        visit(tree, "")
    return out, skipped


def delete_body(source: str, c: Candidate) -> str:
    """The source with c's body replaced by ``raise NotImplementedError``, indented exactly as the body's first line
    was (tabs or mixed tabs and spaces included: Python compares indentation as written)."""
    lines = source.splitlines(keepends=True)
    return "".join(lines[: c.body_start - 1] + [f"{c.indent}raise NotImplementedError\n"] + lines[c.end:])


def parse_junit(xml_text: str, test_files: list[str]) -> dict[str, str]:
    """test node id -> 'passed' | 'failed' | 'skipped' from pytest's JUnit XML.

    pytest writes classname as the dotted module path plus any class names; the module is the longest prefix
    that names one of test_files."""
    modules = {f[:-3].replace(os.sep, "."): f for f in test_files}
    results = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        parts = case.get("classname", "").split(".")
        file, klass = None, []
        for k in range(len(parts), 0, -1):
            if ".".join(parts[:k]) in modules:
                file, klass = modules[".".join(parts[:k])], parts[k:]
                break
        if file is None:
            continue
        node = "::".join([file, *klass, case.get("name", "")])
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "skipped"
        results[node] = status
    return results


def missing_modules(output: str) -> list[str]:
    """Modules an import failed to find, and pytest plugins an addopts/-p option needs, named in pytest's output
    (what to install for the suite to run)."""
    found = re.findall(r"No module named '([^']+)'", output)
    found += [f"a pytest plugin for {flag}" for flag in re.findall(r"unrecognized arguments: (--?[\w-]+)", output)]
    return list(dict.fromkeys(found))


def reference_failure(output: str, tail_lines: int = 15) -> str:
    """Why no test passed on the reference: the missing modules, if any, and the tail of pytest's output."""
    missing = missing_modules(output)
    tail = "\n".join(output.rstrip().splitlines()[-tail_lines:]) or "(no output)"
    return ("no test passes on the reference" + (f"; missing: {', '.join(missing)}" if missing else "") +
            f"; the end of pytest's output:\n{tail}")


class Miner:
    def __init__(self, config: Optional[MineConfig] = None, log=print):
        self.config, self.log = config or MineConfig(), log
        self.suite_output = ""  # the output of the last run_suite
        self.sandbox = self.config.sandbox  # the current source's (its environment's python)
        self.environment: Optional[str] = None

    def use_environment(self, root: str) -> Optional[str]:
        """Build (or find) the environment root's tests need and run the suites with it; the reason when it
        cannot be built (None: ready, or environments are off)."""
        self.sandbox, self.environment = self.config.sandbox, None
        if self.config.env is None:
            return None
        requirements, sources = requirements_for_tests(root)
        self.log(f"test requirements: {', '.join(requirements) or 'none'}"
                 + (f" (from {'; '.join(sources)})" if sources else ""))
        try:
            self.environment = build_environment(requirements, self.config.env, self.log)
        except (EnvBuildError, OSError, subprocess.TimeoutExpired) as e:
            return f"cannot build the test environment: {e}"
        self.sandbox = sandbox_for(self.config.sandbox, self.environment)
        return None

    def run_suite(self, root: str, tests: list[str], replace: Optional[tuple[str, str]] = None) -> dict[str, str]:
        """Results of the test files under root (optionally with one file's text replaced)."""
        with BubblewrapSandbox(root, self.sandbox) as box:
            if replace:
                box.write_file(replace[0], replace[1].encode())
            self.suite_output = box.exec(pytest_command(root, f"--junitxml={REPORT}"),
                                         timeout_s=self.config.timeout_s).output
            try:
                return parse_junit(box.read_file(REPORT).decode(), tests)
            except (ET.ParseError, SandboxError, ValueError):  # no report: the suite did not run
                return {}

    def check(self, root: str, hidden: str, command: str) -> tuple[Optional[int], str]:
        """Exit code and output of command in a sandbox holding root plus the hidden tests."""
        with BubblewrapSandbox(root, self.sandbox) as box:
            shutil.copytree(hidden, box.workspace, dirs_exist_ok=True, symlinks=True)
            r = box.exec(command, timeout_s=self.config.timeout_s)
            return r.exit_code, r.output

    def mine(self, source: str, out_dir: str, name: Optional[str] = None,
             task_base: Optional[str] = None) -> tuple[list[dict], list[tuple]]:
        """(tasks, skipped (what, why)) of one source; task folders go under out_dir, paths in the tasks are
        relative to task_base (default out_dir: where the task file will live)."""
        self.task_base = task_base or out_dir
        name = name or os.path.basename(os.path.normpath(source)).removesuffix(".tar.gz").removesuffix(".tgz")
        skipped: list[tuple] = []
        tasks = []
        with tempfile.TemporaryDirectory(prefix="megatron-mine-") as work:
            ref = os.path.join(work, "reference")
            os.mkdir(ref)
            copy_source(source, ref)
            files = python_files(ref)
            tests = [f for f in files if is_test_file(f)]
            if not tests:
                return [], [(source, "no test files (test_*.py, *_test.py, tests/)")]
            why = self.use_environment(ref)
            if why:
                return [], [(source, why)]
            reference = self.run_suite(ref, tests)
            if not any(s == "passed" for s in reference.values()):
                return [], [(source, reference_failure(self.suite_output))]
            test_text = "\n".join(open(os.path.join(ref, t), encoding="utf-8", errors="replace").read()
                                  for t in tests)
            found, skipped = candidates(ref, [f for f in files if not is_test_file(f)], self.config.min_body_lines)
            mentioned = []
            for c in found:
                short = c.qualname.split(".")[-1]
                if short.startswith("__") and short.endswith("__"):
                    skipped.append((c.id, "special method"))
                elif short in test_text:
                    mentioned.append(c)
                else:
                    skipped.append((c.id, "no test file mentions its name"))
            if self.config.seed is not None:
                random.Random(self.config.seed).shuffle(mentioned)
            for c in mentioned[self.config.max_candidates:]:
                skipped.append((c.id, f"over --max-candidates {self.config.max_candidates}"))
            per_file: dict[str, int] = {}
            for c in mentioned[: self.config.max_candidates]:
                if len(tasks) >= self.config.max_tasks:
                    skipped.append((c.id, f"over --max-tasks {self.config.max_tasks}"))
                    continue
                if self.config.max_per_file is not None and per_file.get(c.path, 0) >= self.config.max_per_file:
                    skipped.append((c.id, f"over --max-per-file {self.config.max_per_file}"))
                    continue
                task, reason = self._task(ref, c, reference, tests, out_dir, name)
                if task is None:
                    skipped.append((c.id, reason))
                else:
                    tasks.append(task)
                    per_file[c.path] = per_file.get(c.path, 0) + 1
                    self.log(f"accepted {task['id']}: {len(task['metadata']['fail_to_pass'])} fail-to-pass tests")
        return tasks, skipped

    def _task(self, ref: str, c: Candidate, reference: dict, tests: list[str], out_dir: str, name: str):
        original = open(os.path.join(ref, c.path), encoding="utf-8").read()
        deleted = delete_body(original, c)
        after = self.run_suite(ref, tests, (c.path, deleted))
        if not after:
            return None, ("the suite does not run with the body deleted (import-time use?); the end of pytest's "
                          "output: " + self.suite_output.rstrip()[-300:])
        broken = sorted(t for t, s in reference.items() if s == "passed" and after.get(t, "failed") == "failed")
        if not broken:
            return None, "deleting the body breaks no passing test"
        task_id = f"{name}:{c.path}::{c.qualname}".replace(os.sep, "/")
        folder = os.path.join(out_dir, _slug(task_id))
        repo, hidden = _layout(folder, ref, tests, ref, tests)
        with open(os.path.join(repo, c.path), "w", encoding="utf-8") as f:
            f.write(deleted)
        command, reason = self._verified_command(folder, ref, broken, reference)
        if command is None:
            return None, reason
        diff = "".join(difflib.unified_diff(deleted.splitlines(True), original.splitlines(True),
                                            f"a/{c.path}", f"b/{c.path}"))
        doc = f"\n\nIts docstring says:\n{c.docstring}" if c.docstring else ""
        instruction = (f"The body of `{c.qualname}` in `{c.path}` (line {c.lineno}) was removed; it now raises "
                       f"NotImplementedError. Implement it so that it works as the rest of the code and its callers "
                       f"expect.\n\nSignature: `{c.signature.rstrip(':')}`{doc}")
        return self._record(task_id, folder, instruction, command, tests,
                            {"source": name, "category": "feature deletion", "function": c.id,
                             "pass_to_pass": _pass_to_pass(reference, after, broken),
                             "fail_to_pass": broken, "reference_diff": diff,
                             "reference_diff_lines": diff_lines(deleted, original)}), None

    def _verified_command(self, folder: str, ref: str, broken: list[str], reference: dict):
        """The test command over the files of the fail-to-pass tests; (None, reason) unless it fails on the task's
        repository and passes on the reference (the task folder is removed then)."""
        files = sorted({t.split("::")[0] for t in broken})
        deselect = sorted(t for t, s in reference.items() if s != "passed" and t.split("::")[0] in files)
        command = pytest_command(ref, " ".join(shlex.quote(f) for f in files) +
                                 "".join(f" --deselect {shlex.quote(t)}" for t in deselect))
        repo, hidden = os.path.join(folder, "repo"), os.path.join(folder, "hidden")
        code, output = self.check(ref, hidden, command)
        if code in NOT_STARTED:
            shutil.rmtree(folder)
            return None, f"the task's test command cannot be started (exit {code}): {output[-300:]}"
        if code != 0:
            shutil.rmtree(folder)
            return None, f"the task's test command fails on the reference: {output[-300:]}"
        if self.check(repo, hidden, command)[0] == 0:
            shutil.rmtree(folder)
            return None, "the task's test command passes on the task's repository"
        return command, None

    def _record(self, task_id, folder, instruction, command, hidden_tests, metadata) -> dict:
        env = {"environment": os.path.relpath(self.environment, self.task_base)} if self.environment else {}
        return {**env, "id": task_id, "repo": os.path.relpath(os.path.join(folder, "repo"), self.task_base),
                "instruction": instruction, "test_command": command, "timeout_s": self.config.timeout_s,
                "hidden_tests": os.path.relpath(os.path.join(folder, "hidden"), self.task_base),
                "forbidden": sorted({*hidden_tests, *[f"{d}/*" for d in TEST_DIRS], "*conftest.py"}),
                "metadata": metadata}

    # ---- "revert a commit that changed code and tests" ----------------------------------------------------
    def mine_commits(self, repo: str, out_dir: str, max_commits: int = 50, name: Optional[str] = None,
                     task_base: Optional[str] = None) -> tuple[list[dict], list[tuple]]:
        """Tasks from the last max_commits non-merge commits of a git checkout (HEAD's history, newest first)
        that changed both code and tests: the agent gets the parent's code, the instruction is the commit
        message, the hidden tests are the commit's. The checkout is only read (git log / diff / archive)."""
        self.task_base = task_base or out_dir
        name = name or os.path.basename(os.path.normpath(repo))
        if not os.path.isdir(os.path.join(repo, ".git")):
            return [], [(repo, "not a git checkout (no .git)")]
        commits = _git(repo, "log", "--no-merges", "--format=%H %P", f"-n{max_commits}").split("\n")
        tasks, skipped = [], []
        for line in filter(None, commits):
            commit, *parents = line.split()
            if len(tasks) >= self.config.max_tasks:
                skipped.append((commit, f"over --max-tasks {self.config.max_tasks}"))
                continue
            if len(parents) != 1:
                skipped.append((commit, "root commit (no parent)"))
                continue
            changed = _git(repo, "diff", "--name-only", parents[0], commit).split("\n")
            code = [f for f in changed if f.endswith(".py") and not is_test_file(f)]
            if not code or not any(is_test_file(f) for f in changed):
                skipped.append((commit, "does not change both code and tests"))
                continue
            task, reason = self._commit_task(repo, commit, parents[0], changed, out_dir, name)
            if task is None:
                skipped.append((commit, reason))
            else:
                tasks.append(task)
                self.log(f"accepted {task['id']}: {len(task['metadata']['fail_to_pass'])} fail-to-pass tests")
        return tasks, skipped

    def _commit_task(self, repo: str, commit: str, parent: str, changed: list[str], out_dir: str, name: str):
        with tempfile.TemporaryDirectory(prefix="megatron-mine-") as work:
            ref, before, composite = (os.path.join(work, d) for d in ("reference", "parent", "composite"))
            _git_tree(repo, commit, ref)
            _git_tree(repo, parent, before)
            tests = [f for f in python_files(ref) if is_test_file(f)]
            old_tests = [f for f in python_files(before) if is_test_file(f)]
            why = self.use_environment(ref)
            if why:
                return None, why
            reference = self.run_suite(ref, tests)
            _layout(composite, before, old_tests, ref, tests)
            shutil.copytree(os.path.join(composite, "hidden"), os.path.join(composite, "repo"), dirs_exist_ok=True)
            after = self.run_suite(os.path.join(composite, "repo"), tests)
            changed_tests = {f for f in changed if is_test_file(f)}
            broken = sorted(t for t, s in reference.items() if s == "passed" and t.split("::")[0] in changed_tests
                            and after.get(t, "failed") == "failed")
            if not broken:
                return None, "the commit's tests do not fail before it (or fail after it)"
            task_id = f"{name}:commit:{commit[:12]}"
            folder = os.path.join(out_dir, _slug(task_id))
            _layout(folder, before, old_tests, ref, tests)
            command, reason = self._verified_command(folder, ref, broken, reference)
            if command is None:
                return None, reason
            message = _git(repo, "log", "-1", "--format=%B", commit).strip()
            code = [f for f in changed if f.endswith(".py") and not is_test_file(f)]
            diff = _git(repo, "diff", parent, commit, "--", *code)
            edited = [f for f in changed if not is_test_file(f)]
            instruction = (f"Make the change this commit message describes:\n\n{message}\n\n"
                           "Hidden tests check the result.")
            return self._record(task_id, folder, instruction, command, tests,
                                {"source": name, "category": "commit", "commit": commit, "parent": parent,
                                 "pass_to_pass": _pass_to_pass(reference, after, broken),
                                 "fail_to_pass": broken, "reference_diff": diff,
                                 "reference_diff_lines": sum(diff_lines(_read_text(before, f), _read_text(ref, f))
                                                             for f in edited)}), None


def _pass_to_pass(reference: dict, after: dict, broken: list[str]) -> list[str]:
    """Tests in the files the test command runs that pass both on the reference and on the task's repository:
    grading expects them to keep passing (grading.py takes fail_to_pass + pass_to_pass as the expected ids)."""
    files = {t.split("::")[0] for t in broken}
    return sorted(t for t, s in reference.items() if s == "passed" and t not in broken
                  and t.split("::")[0] in files and after.get(t) == "passed")


def _git(repo: str, *args: str) -> str:
    r = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {r.stderr.strip()}")
    return r.stdout


def _git_tree(repo: str, commit: str, dest: str):
    """The files of a commit, unpacked into dest (git archive; nothing in the checkout changes)."""
    data = subprocess.run(["git", "-C", repo, "archive", "--format=tar", commit], capture_output=True, check=True)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data.stdout)) as tar:
        tar.extractall(dest, filter="data")


def _layout(folder: str, agent_src: str, agent_tests: list[str], test_src: str, hidden_tests: list[str]):
    """folder/repo: agent_src without its test files (and the folders they leave empty); folder/hidden: the
    hidden test files from test_src. Returns both paths."""
    shutil.rmtree(folder, ignore_errors=True)
    repo, hidden = os.path.join(folder, "repo"), os.path.join(folder, "hidden")
    shutil.copytree(agent_src, repo, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    for t in agent_tests:
        os.unlink(os.path.join(repo, t))
    for base, _, _ in os.walk(repo, topdown=False):
        if base != repo and not os.listdir(base):
            os.rmdir(base)
    for t in hidden_tests:
        dest = os.path.join(hidden, t)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.join(test_src, t), dest)
    os.makedirs(hidden, exist_ok=True)
    return repo, hidden


def _read_text(root: str, rel: str) -> str:
    """A file's text as grading compares it ('' when absent or not text)."""
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return ""


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def write_tasks(path: str, tasks: list[dict]):
    """Write the suite atomically; an empty one is refused (ValueError) and an existing file stays as it was, so
    a failed mining run never leaves a 0-byte suite that a directory of suites would then reject."""
    if not tasks:
        raise ValueError(f"{path}: no tasks to write; " + ("the existing file is unchanged" if os.path.exists(path)
                                                         else "nothing was written"))
    with atomic_output(path) as f:
        for t in tasks:
            f.write(json.dumps(t, sort_keys=True) + "\n")
