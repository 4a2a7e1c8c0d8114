"""Grading by test ids, the way SWE-bench's harness grades, and the files that can steer a test run.

The contract (docs/grading.md says it for task authors):

* A pytest ``test_command`` (``[NAME=VALUE ...] python -m pytest ARGS`` or ``pytest ARGS``, no shell operators)
  is not run as written. The grader runs ``python -I runner.py`` from a folder outside the workspace, bound
  read-only only for this run: pytest with our own configuration file (``-c``; the workspace's ini files,
  setup.cfg and pyproject sections are never read), ``--rootdir``/``--confcutdir`` at the workspace,
  ``-p no:cacheprovider``, plugin autoload off, and the task's own ARGS. The runner records each test's outcome
  from pytest's reports into a report folder made fresh on the host for this run.
* Correct = every expected test id passed (or xfailed). Expected ids: the task's ``metadata.fail_to_pass`` plus
  ``metadata.pass_to_pass`` when it has them (mining stores both), else the ids of one trusted run of the tests on
  the task's untouched repository with the hidden tests laid over (skip-marked tests left out): those it failed,
  and the tests of files that did not collect, are the task's fail-to-pass. Cached by the content of the
  repository, hidden tests and command. A missing id, a crash, a timeout or no report is wrong.
  ``tests_fraction`` (partial credit): with fail-to-pass known, the share of those ids passing times the share
  of the other expected ids still passing (an edit that fixes nothing earns 0, however many tests already passed);
  else (every expected test passed on the untouched repository, or its run did not finish and the ids come from
  a collection only) expected ids passed / expected ids; never read from printed output.
* Any other test command keeps exit-code grading (0 = correct; tests_fraction = correctness). It is weaker: the
  agent's code decides the exit code, so anything that exits 0 passes.

Limit, stated plainly: the tests import the agent's code into the pytest process that reports on them, so code
written to target this grader can still forge outcomes in memory (e.g. patch pytest's report objects from the
package under test). What it cannot do any more is steer the run from files (configuration, plugins, shadowed
modules), pre-write a report, or pass by exiting early. Running each test in a process apart from the reporter
would close the rest.
"""

from __future__ import annotations

import configparser
import hashlib
import json
import os
import secrets
import shlex
import shutil
import stat
import sys
import tomllib
from dataclasses import dataclass, field, replace
from typing import Optional

from megatron_ext.env.sandbox import WORKDIR, BubblewrapConfig, BubblewrapSandbox
from megatron_ext.env.workspace import overlay

GRADER_VERSION = 2  # 2: collected ids carry their untouched repository's failures (fail_to_pass)
GRADER_MOUNT = "/grading"            # the runner and our pytest.ini, read-only
REPORT_MOUNT = "/grading-report"     # the fresh report folder, writable during the grading run only
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grading_runner.py")
PASSED = ("passed", "xfailed")
MAX_REPORT_BYTES = 64 << 20

# ---- files that can steer a test run ----------------------------------------------------------------------
STEERING_NAMES = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "sitecustomize.py", "usercustomize.py"}
STEERING_SUFFIXES = (".pth", ".pyc", ".pyo")
STEERING_DIR_SUFFIXES = (".dist-info", ".egg-info", "__pycache__")
GUARDED_MODULES = set(sys.stdlib_module_names) | {
    "pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "exceptiongroup", "tomli", "pygments",
    "colorama"}


def _pytest_section(name: str, entry) -> object:
    """The pytest part of a setup.cfg or pyproject.toml snapshot entry; a parse failure is its own value."""
    if entry is None:
        return None
    if entry[0] != "file" or not isinstance(entry[1], bytes):  # a link, or content the snapshot did not keep
        return ("other", entry)
    try:
        text = entry[1].decode()
        if name == "pyproject.toml":
            return tomllib.loads(text).get("tool", {}).get("pytest")
        parser = configparser.RawConfigParser()
        parser.read_string(text)
        return {s: dict(parser.items(s)) for s in ("tool:pytest", "pytest") if parser.has_section(s)}
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, configparser.Error):
        return ("unparsable", entry[1])


def _shadows(rel: str, pristine: dict, final: dict) -> bool:
    """rel adds a module importable under a guarded name (stdlib, pytest and its dependencies) from a folder that
    is not a package (the workspace root, src/, a test folder pytest puts on sys.path)."""
    parts = rel.split("/")
    for i, name in enumerate(parts):
        folder = "/".join(parts[:i])
        if f"{folder}/__init__.py".lstrip("/") in final:
            continue
        module = name.split(".")[0] if i == len(parts) - 1 else name
        if i == len(parts) - 1 and not name.endswith((".py", ".so", ".pyc", ".pyd")):
            continue
        prefix = "/".join(parts[: i + 1])
        if module in GUARDED_MODULES and not any(p == prefix or p.startswith(prefix + "/") for p in pristine):
            return True
    return False


def is_bytecode(rel: str) -> bool:
    """Compiled bytecode: removed before grading like the other steering files, but not counted as a forbidden
    edit (a run outside PYTHONDONTWRITEBYTECODE leaves it innocently)."""
    return rel.endswith((".pyc", ".pyo")) or "__pycache__" in rel.split("/")


TOOL_CACHES = (".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis")


def is_tool_cache(rel: str) -> bool:
    """What running a tool leaves behind (pytest's cache after a plain `pytest`): not an edit, so it earns no
    reward that needs a change (communication, tests_fraction) and is no style subject."""
    return any(part in TOOL_CACHES for part in rel.split("/"))


def steering_paths(changed: list[str], pristine: dict, final: dict) -> list[str]:
    """The changed paths (snapshot keys) that can steer a test run rather than be part of a solution: conftest.py
    anywhere, pytest/tox ini files, a changed pytest section of setup.cfg or pyproject.toml, *.pth, anything in a
    *.dist-info / *.egg-info / __pycache__ folder, compiled bytecode, sitecustomize / usercustomize, and new
    modules named like the stdlib or pytest (see _shadows)."""
    out = []
    for rel in changed:
        parts = rel.split("/")
        name = parts[-1]
        if name in STEERING_NAMES or name.endswith(STEERING_SUFFIXES) or \
                any(p.endswith(STEERING_DIR_SUFFIXES) for p in parts):
            out.append(rel)
        elif name in ("setup.cfg", "pyproject.toml"):
            if _pytest_section(name, pristine.get(rel)) != _pytest_section(name, final.get(rel)):
                out.append(rel)
        elif rel in final and _shadows(rel, pristine, final):
            out.append(rel)
    return out


# ---- the test command ---------------------------------------------------------------------------------------
@dataclass
class PytestCommand:
    args: list                                   # pytest's arguments as the task gave them
    env: dict = field(default_factory=dict)      # NAME=VALUE assignments before the command (PYTHONPATH aside)
    pythonpath: list = field(default_factory=list)  # PYTHONPATH entries, relative to the workspace


def parse_pytest_command(command: str) -> Optional[PytestCommand]:
    """The parts of ``[NAME=VALUE ...] python[3[.X]] -m pytest ARGS`` or ``[...] pytest ARGS``; None for anything
    else (shell operators, another program), which keeps exit-code grading."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return None
    if not tokens or any(t and all(c in "();<>|&" for c in t) for t in tokens):
        return None
    env = {}
    while tokens and "=" in tokens[0] and tokens[0].split("=", 1)[0].isidentifier():
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    if not tokens:
        return None
    program = os.path.basename(tokens[0])
    if program in ("pytest", "py.test"):
        args = tokens[1:]
    elif program in ("python", "python3") or (program.startswith("python3.") and program[8:].isdigit()):
        if tokens[1:3] != ["-m", "pytest"]:
            return None
        args = tokens[3:]
    else:
        return None
    pythonpath = [p for p in env.pop("PYTHONPATH", "").split(":") if p]
    if any(os.path.isabs(p) or ".." in p.split("/") for p in pythonpath):
        return None
    return PytestCommand(args, env, pythonpath)


def runner_command(cmd: PytestCommand, mode: str) -> str:
    """The shell command the grading sandbox runs for cmd (mode 'run' or 'collect')."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cmd.env.items())
    argv = ["python", "-I", f"{GRADER_MOUNT}/runner.py", REPORT_MOUNT, mode, WORKDIR, ":".join(cmd.pythonpath),
            "--", "-c", f"{GRADER_MOUNT}/pytest.ini", "--rootdir", WORKDIR, "--confcutdir", WORKDIR,
            "-p", "no:cacheprovider", *cmd.args]
    return (env + " " if env else "") + " ".join(shlex.quote(a) for a in argv)


class GradingRun:
    """The grader's folders inside one grading sandbox's own folder (so they share its lifetime, its disk limit
    and whatever makes its folders reachable to the sandbox's host user): the runner and our pytest.ini, bound
    read-only at /grading, and an empty report folder, bound writable at /grading-report. Both exist only in this
    sandbox: the agent's sandbox never had them. Adds the binds to box.config (read at each exec)."""

    def __init__(self, box: BubblewrapSandbox):
        self.box, self.error = box, None
        self.grader, self.reports = os.path.join(box.root, "grader"), os.path.join(box.root, "report")
        self.nonce = secrets.token_hex(16)
        try:
            os.mkdir(self.grader)
            os.mkdir(self.reports)
            os.chmod(self.grader, 0o755)
            os.chmod(self.reports, 0o777)  # the sandbox may run as another host uid
            shutil.copyfile(RUNNER, os.path.join(self.grader, "runner.py"))
            with open(os.path.join(self.grader, "pytest.ini"), "w") as f:
                f.write("[pytest]\n")
            with open(os.path.join(self.reports, "nonce"), "w") as f:
                f.write(self.nonce)
            for path in ("grader/runner.py", "grader/pytest.ini", "report/nonce"):
                os.chmod(os.path.join(box.root, path), 0o644 if path.startswith("grader") else 0o666)
        except OSError as e:  # no room left beside the workspace (a disk-limited sandbox the agent filled)
            self.error = f"the grader could not be set up beside the workspace ({e.strerror})"
            return
        self._bind((self.grader, GRADER_MOUNT, False), (self.reports, REPORT_MOUNT, True))

    def _bind(self, *binds):
        self.box.config = replace(self.box.config, binds=tuple(self.box.config.binds) + binds)

    def protect_hidden(self, hidden: str):
        """Bind the hidden tests' top-level entries, as laid over the workspace, read-only: the code under test
        runs before pytest has read every test file and must not be able to rewrite one (or plant bytecode
        beside it) in the meantime."""
        self._bind(*((os.path.join(self.box.workspace, name), f"{WORKDIR}/{name}", False)
                     for name in sorted(os.listdir(hidden))))

    def report(self) -> tuple[Optional[dict], str]:
        """(the runner's report, '') or (None, why there is none). The file is the sandbox's: opened without
        following links, regular files only, size-capped, and it must carry this run's nonce."""
        if self.error:
            return None, self.error
        path = os.path.join(self.reports, "report.json")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None, "no report (pytest did not finish)"
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_REPORT_BYTES:
                return None, "the report is not a regular file of at most 64 MiB"
            try:
                report = json.loads(f.read(MAX_REPORT_BYTES))
            except ValueError:
                return None, "the report is not valid JSON"
        if not isinstance(report, dict) or report.get("nonce") != self.nonce or \
                not isinstance(report.get("outcomes"), dict):
            return None, "the report was not written by this run's runner"
        return report, ""


# ---- expected ids -------------------------------------------------------------------------------------------
@dataclass
class Expected:
    ids: list                                   # test ids that must pass
    files: list = field(default_factory=list)   # test files that did not collect on the untouched repository:
    #                                             every test reported from them must pass, and at least one
    source: str = "metadata"                    # "metadata" | "collected"
    fail_to_pass: list = field(default_factory=list)  # of `ids`, those the untouched repository fails

    def to_json(self) -> dict:
        return {"ids": self.ids, "files": self.files, "source": self.source, "fail_to_pass": self.fail_to_pass}


class GradingError(RuntimeError):
    """The task cannot be graded by test ids (its tests do not collect on its untouched repository)."""


def from_metadata(metadata: dict) -> Optional[Expected]:
    f2p, p2p = metadata.get("fail_to_pass"), metadata.get("pass_to_pass") or []
    if isinstance(f2p, list) and f2p and all(isinstance(t, str) for t in f2p + list(p2p)):
        return Expected(sorted(set(f2p) | set(p2p)), fail_to_pass=sorted(set(f2p)))
    return None


def _digest(h, path: str):
    if os.path.isfile(path):
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return
    for base, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not (d == ".git" and base == path))
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
            full = os.path.join(base, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            if os.path.islink(full):
                h.update(b"link:" + os.readlink(full).encode())
            elif os.path.isfile(full):
                _digest(h, full)
            h.update(b"\0")


def cache_key(task) -> str:
    env = getattr(task, "environment", None) or ""  # its folder name is the hash of its requirements
    h = hashlib.sha256(f"v{GRADER_VERSION}\0{task.test_command}\0".encode() +
                       (f"env:{os.path.basename(env)}\0".encode() if env else b""))
    _digest(h, task.repo)
    h.update(b"\0hidden\0")
    if task.hidden_tests:
        _digest(h, task.hidden_tests)
    return h.hexdigest()


_MEMORY: dict[str, Expected] = {}


def _untouched_run(task, cmd: PytestCommand, sandbox: BubblewrapConfig, mode: str, timeout_s: float):
    """(report or None, why, output) of the runner in `mode` on the task's untouched repository, hidden tests laid
    over as the graded run lays them (modes the sandbox can read)."""
    with BubblewrapSandbox(task.repo, sandbox) as box:
        run = GradingRun(box)
        if task.hidden_tests:
            overlay(task.hidden_tests, box.workspace)
        r = box.exec(runner_command(cmd, mode), timeout_s=timeout_s)
        report, why = run.report() if r.killed is None else (None, f"killed ({r.killed})")
    return report, why, r.output


def expected_tests(task, cmd: PytestCommand, sandbox: BubblewrapConfig, cache_dir: Optional[str],
                   timeout_s: float) -> Expected:
    """The task's expected ids (metadata), else those of a trusted run on the untouched repository, with the ones
    it failed as fail_to_pass (where that run does not finish, a collection's ids without them); cached in memory
    and under cache_dir."""
    found = from_metadata(task.metadata)
    if found is not None:
        return found
    key = cache_key(task)
    if key in _MEMORY:
        return _MEMORY[key]
    path = os.path.join(cache_dir, f"{key}.json") if cache_dir else None
    if path and os.path.isfile(path):
        with open(path) as f:
            record = json.load(f)
        _MEMORY[key] = Expected(record["ids"], record["files"], "collected", record["fail_to_pass"])
        return _MEMORY[key]
    report, why, output = _untouched_run(task, cmd, sandbox, "baseline", timeout_s)
    baseline = report is not None
    if not baseline:  # the untouched code hangs or crashes the run: which tests fail before stays unknown
        report, why, output = _untouched_run(task, cmd, sandbox, "collect", timeout_s)
    if report is None or not (report["collected"] or report["collection_errors"]):
        raise GradingError(f"task {task.id}: its tests cannot be collected on its untouched repository "
                           f"({why or 'no tests collected'}): {output[-2000:]}")
    files = sorted({e.split("::")[0] for e in report["collection_errors"] if e})
    ids = sorted(report["collected"])
    failing = [t for t in ids if report["outcomes"].get(t) not in PASSED] if baseline else []
    expected = Expected(ids, files, "collected", failing)
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(expected.to_json(), f)
        os.replace(tmp, path)
    _MEMORY[key] = expected
    return expected


def progress(ids: list, passed: list, expected: Expected) -> float:
    """The partial credit `tests_fraction`. When it is known which tests the untouched repository fails
    (fail_to_pass: the task's metadata, or the baseline run's failures and the tests of files that did not collect
    there), the share of those that pass now, times the share of the other expected tests still passing: tests
    that already passed are no credit for an edit that fixes nothing (any change would have collected them), and
    breaking them costs. Else (nothing failed before, or no baseline) expected ids passed / expected ids."""
    if not ids:
        return 0.0
    done, failing, files = set(passed), set(expected.fail_to_pass), set(expected.files)
    must = [t for t in ids if t in failing or t.split("::")[0] in files]  # a file that did not collect: failing
    if not must:
        return len(done) / len(ids)
    owed = set(must)
    kept = [t for t in ids if t not in owed]
    return sum(t in done for t in must) / len(must) * (sum(t in done for t in kept) / len(kept) if kept else 1.0)


def evaluate(report: Optional[dict], expected: Expected) -> dict:
    """correct, tests_fraction and the ids by outcome, from a runner report (None: nothing ran: wrong)."""
    outcomes = report["outcomes"] if report else {}
    ids = list(expected.ids)
    for file in expected.files:
        ids += sorted(t for t in outcomes if t.startswith(f"{file}::")) or [file]
    passed = [t for t in ids if outcomes.get(t) in PASSED]
    missing = [t for t in ids if t not in outcomes]
    failed = [t for t in ids if t in outcomes and outcomes[t] not in PASSED]
    return {"correct": bool(ids) and len(passed) == len(ids), "tests_fraction": progress(ids, passed, expected),
            "expected": ids, "passed": passed, "failed": failed, "missing": missing}
