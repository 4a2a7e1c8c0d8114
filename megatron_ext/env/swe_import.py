"""SWE-bench-style instances as tasks: a repository at a base commit, a gold patch, a test patch and the test ids
that must go from failing to passing (FAIL_TO_PASS) and keep passing (PASS_TO_PASS).

For each instance (``instance_id``, ``repo`` "owner/name", ``base_commit``, ``patch``, ``test_patch``,
``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``problem_statement``; the id lists as JSON lists or, as SWE-bench ships them,
JSON-encoded strings) with a local clone at ``REPOS/owner__name``:

1. the base commit's files are unpacked with ``git archive`` into a temporary folder (the clone is only read);
2. the test patch is applied to a copy: the files it adds or changes become the task's hidden tests (laid over the
   workspace for grading, forbidden to the agent); the agent's repository is the base commit as it is;
3. the environment the tests need is built (environments.py) when environments are on;
4. verification through the grader itself (test-id grading in the sandbox, with the environment's python): on the
   base repository every FAIL_TO_PASS id must fail and every PASS_TO_PASS id pass; with the gold patch applied all
   of them must pass. The test command runs the files the ids name;
5. the task: id = instance_id, instruction = problem_statement, ``metadata.fail_to_pass`` / ``pass_to_pass`` (so
   grading expects exactly those ids), the gold patch as ``reference_diff``.

Only pytest node ids (``path::name``) can be graded this way; other harnesses' ids (Django's, SymPy's) are skipped
with that reason. Every skipped instance comes back with its reason.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from megatron_ext.env.environments import EnvBuildError, EnvConfig, build_environment, requirements_for_tests, \
    sandbox_for
from megatron_ext.env.episode import diff_lines
from megatron_ext.env.grading import GradingRun, evaluate, from_metadata, parse_pytest_command, runner_command
from megatron_ext.env.mining import _git_tree, _read_text, _slug, pytest_command
from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox, Limits
from megatron_ext.env.tasks import TaskError, task_from_dict
from megatron_ext.env.workspace import overlay

FIELDS = ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS",
          "problem_statement")


class SkipInstance(Exception):
    """This instance cannot become a task; the message says why."""


@dataclass
class ImportConfig:
    timeout_s: float = 600.0
    sandbox: BubblewrapConfig = field(default_factory=lambda: BubblewrapConfig(
        limits=Limits(wall_s=600.0, cpu_s=1200, output_bytes=16 << 20)))
    env: Optional[EnvConfig] = None


def read_instances(path: str) -> list[dict]:
    """The instances of a .jsonl file (one a line) or a .json file (a list)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"{path}:{number}: invalid JSON ({e})") from None
    return out


def parse_ids(value, name: str) -> list[str]:
    """A FAIL_TO_PASS / PASS_TO_PASS value: a list of strings or a JSON-encoded one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise SkipInstance(f"{name} is neither a list nor a JSON-encoded list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise SkipInstance(f"{name} must be a list of test ids")
    return value


def patched_files(patch: str) -> tuple[list[str], list[str]]:
    """(files the patch leaves in place, files it deletes)."""
    kept, deleted = [], []
    for block in re.split(r"^diff --git ", patch, flags=re.M)[1:]:
        target = re.search(r"^\+\+\+ (?:b/)?(\S+)", block, flags=re.M)
        source = re.search(r"^--- (?:a/)?(\S+)", block, flags=re.M)
        if target and target.group(1) != "/dev/null":
            kept.append(target.group(1))
        elif source:
            deleted.append(source.group(1))
        else:  # a rename or mode change without content: the header names it
            kept.append(block.split()[1][2:])
    return kept, deleted


def apply_patch(folder: str, patch: str, what: str):
    """git apply the patch in a plain folder (no repository involved)."""
    if not patch.strip():
        return
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=folder, input=patch, text=True,
                       capture_output=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": os.path.dirname(folder)})
    if r.returncode != 0:
        raise SkipInstance(f"the {what} does not apply to base_commit: {r.stderr.strip()[-300:]}")


class Importer:
    def __init__(self, config: Optional[ImportConfig] = None, log=print):
        self.config, self.log = config or ImportConfig(), log

    def outcomes(self, task, workspace: str, sandbox: BubblewrapConfig) -> tuple[dict, str]:
        """The grader's per-test outcomes of the task's test command on workspace (hidden tests laid over)."""
        with BubblewrapSandbox(workspace, sandbox) as box:
            run = GradingRun(box)
            overlay(task.hidden_tests, box.workspace)
            run.protect_hidden(task.hidden_tests)
            r = box.exec(runner_command(parse_pytest_command(task.test_command), "run"), timeout_s=task.timeout_s)
            report, why = run.report() if r.killed is None else (None, f"killed ({r.killed})")
        return (report or {}).get("outcomes", {}), why or r.output[-1500:]

    def import_one(self, instance: dict, repos: str, out_dir: str, task_base: str) -> dict:
        """The task of one instance (its folder written under out_dir), or SkipInstance."""
        if not isinstance(instance, dict):
            raise SkipInstance("not a JSON object")
        missing = [k for k in FIELDS if k not in instance]
        if missing:
            raise SkipInstance(f"missing fields {missing}")
        f2p = parse_ids(instance["FAIL_TO_PASS"], "FAIL_TO_PASS")
        p2p = parse_ids(instance["PASS_TO_PASS"], "PASS_TO_PASS")
        if not f2p:
            raise SkipInstance("FAIL_TO_PASS is empty")
        odd = [t for t in f2p + p2p if "::" not in t]
        if odd:
            raise SkipInstance(f"test ids are not pytest node ids (path::name), e.g. {odd[0]!r}")
        clone = os.path.join(repos, instance["repo"].replace("/", "__"))
        if not os.path.isdir(os.path.join(clone, ".git")) and not os.path.isfile(os.path.join(clone, "HEAD")):
            raise SkipInstance(f"no git clone at {clone}")
        task_id = str(instance["instance_id"])
        folder = os.path.join(out_dir, _slug(task_id))
        with tempfile.TemporaryDirectory(prefix="megatron-swe-") as work:
            base, tested, gold = (os.path.join(work, d) for d in ("base", "tested", "gold"))
            try:
                _git_tree(clone, instance["base_commit"], base)
            except subprocess.CalledProcessError as e:
                raise SkipInstance(f"base_commit {instance['base_commit']} is not in {clone}: "
                                   f"{e.stderr.decode(errors='replace').strip()[-200:]}") from None
            shutil.copytree(base, tested, symlinks=True)
            apply_patch(tested, instance["test_patch"], "test_patch")
            shutil.copytree(tested, gold, symlinks=True)
            apply_patch(gold, instance["patch"], "patch")
            test_files, deleted = patched_files(instance["test_patch"])
            if deleted:
                raise SkipInstance(f"the test_patch deletes {deleted}; hidden tests can only add or replace files")
            sandbox, environment = self.config.sandbox, None
            if self.config.env is not None:
                try:
                    environment = build_environment(requirements_for_tests(base)[0], self.config.env, self.log)
                except (EnvBuildError, OSError, subprocess.TimeoutExpired) as e:
                    raise SkipInstance(f"cannot build the test environment: {e}") from None
                sandbox = sandbox_for(sandbox, environment)
            shutil.rmtree(folder, ignore_errors=True)
            repo, hidden = os.path.join(folder, "repo"), os.path.join(folder, "hidden")
            shutil.copytree(base, repo, symlinks=True)
            os.makedirs(hidden)
            for rel in test_files:
                os.makedirs(os.path.dirname(os.path.join(hidden, rel)), exist_ok=True)
                shutil.copy2(os.path.join(tested, rel), os.path.join(hidden, rel))
            files = sorted({t.split("::")[0] for t in f2p + p2p})
            record = {"id": task_id, "repo": os.path.relpath(repo, task_base),
                      "hidden_tests": os.path.relpath(hidden, task_base),
                      "instruction": instance["problem_statement"],
                      "test_command": pytest_command(base, " ".join(shlex.quote(f) for f in files)),
                      "timeout_s": self.config.timeout_s, "forbidden": sorted(test_files),
                      "metadata": {"source": instance["repo"], "category": "swe", "base_commit":
                                   instance["base_commit"], "fail_to_pass": sorted(f2p),
                                   "pass_to_pass": sorted(p2p), "reference_diff": instance["patch"],
                                   "reference_diff_lines": sum(diff_lines(_read_text(base, f), _read_text(gold, f))
                                                               for f in patched_files(instance["patch"])[0])}}
            if environment:
                record["environment"] = os.path.relpath(environment, task_base)
            try:
                task = task_from_dict(record, task_base, task_id)
                self._verify(task, base, gold, f2p, p2p, sandbox)
            except (SkipInstance, TaskError):
                shutil.rmtree(folder, ignore_errors=True)
                raise
        return record

    def _verify(self, task, base: str, gold: str, f2p: list[str], p2p: list[str], sandbox: BubblewrapConfig):
        before, why = self.outcomes(task, base, sandbox)
        if not before:
            raise SkipInstance(f"the tests do not run on base_commit: {why}")
        passing = [t for t in f2p if before.get(t) in ("passed", "xfailed")]
        if passing:
            raise SkipInstance(f"FAIL_TO_PASS already pass at base_commit: {passing}")
        broken = [t for t in p2p if before.get(t) not in ("passed", "xfailed")]
        if broken:
            raise SkipInstance(f"PASS_TO_PASS do not pass at base_commit: {broken[:5]}")
        after, why = self.outcomes(task, gold, sandbox)
        result = evaluate({"outcomes": after}, from_metadata(task.metadata))
        if not result["correct"]:
            raise SkipInstance(f"the gold patch does not pass: failed {result['failed'][:5]}, missing "
                               f"{result['missing'][:5]}" + (f"; {why[-500:]}" if not after else ""))

    def import_all(self, instances: list, repos: str, out_dir: str, task_base: str) -> tuple[list, list]:
        """(tasks, skipped as (instance_id, reason))."""
        tasks, skipped = [], []
        for i, instance in enumerate(instances):
            name = instance.get("instance_id", f"#{i}") if isinstance(instance, dict) else f"#{i}"
            try:
                tasks.append(self.import_one(instance, repos, out_dir, task_base))
                self.log(f"imported {name}")
            except SkipInstance as e:
                skipped.append((name, str(e)))
        return tasks, skipped
