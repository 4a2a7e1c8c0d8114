"""SWE-bench-style import (issue 28, item 3): a local git repository with a bug, a gold patch and a test patch
becomes a verified task graded by its FAIL_TO_PASS / PASS_TO_PASS ids; the gold patch grades correct and a no-op
wrong; an instance whose FAIL_TO_PASS already passes at base_commit, or whose ids are not pytest's, is skipped with
its reason; the clone is never modified and a run that imports nothing writes nothing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.tasks import load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUGGY = "def add(a, b):\n    return a + b\n\n\ndef mean(xs):\n    return sum(xs) // len(xs)\n"
FIXED = BUGGY.replace("//", "/")
TESTS = "from calc import add, mean\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
NEW_TESTS = TESTS + "\n\ndef test_mean():\n    assert mean([2, 3]) == 2.5\n"


def git(repo, *args) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def make_clone(repos) -> tuple[str, str, str]:
    """repos/acme__calc with the buggy base commit; (base_commit, gold patch, test patch)."""
    repo = repos / "acme__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc" / "__init__.py").write_text(BUGGY)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc" / "__init__.py").write_text(FIXED)
    (repo / "tests" / "test_calc.py").write_text(NEW_TESTS)
    patch, test_patch = git(repo, "diff", "--", "calc"), git(repo, "diff", "--", "tests")
    git(repo, "commit", "-qam", "fix mean")  # the clone's HEAD is past base_commit, as in a real clone
    return base, patch, test_patch


def load_tool():
    spec = importlib.util.spec_from_file_location("import_swe_tasks", os.path.join(ROOT, "tools",
                                                                                    "import_swe_tasks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_verify_and_grade_a_swe_instance(tmp_path, capsys):
    repos = tmp_path / "repos"
    base, patch, test_patch = make_clone(repos)
    head = git(repos / "acme__calc", "rev-parse", "HEAD")
    good = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base, "patch": patch,
            "test_patch": test_patch, "problem_statement": "mean([2, 3]) returns 2, not 2.5.",
            "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_mean"]),   # JSON-encoded, as SWE-bench ships
            "PASS_TO_PASS": ["tests/test_calc.py::test_add"]}
    already = {**good, "instance_id": "acme__calc-2", "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
               "PASS_TO_PASS": []}
    foreign = {**good, "instance_id": "acme__calc-3", "FAIL_TO_PASS": ["test_mean (tests.CalcTest)"]}
    instances = tmp_path / "instances.jsonl"
    instances.write_text("".join(json.dumps(i) + "\n" for i in (good, already, foreign)))
    out = tmp_path / "swe.jsonl"
    argv = [str(instances), "--repos", str(repos), "--out", str(out), "--env-dir", str(tmp_path / "envs")]
    assert load_tool().main(argv) == 0
    err = capsys.readouterr().err
    skipped = {json.loads(line)["instance_id"]: json.loads(line)["reason"]
               for line in (tmp_path / "swe.skipped.jsonl").read_text().splitlines()}
    assert set(skipped) == {"acme__calc-2", "acme__calc-3"}, skipped
    assert "FAIL_TO_PASS already pass at base_commit: ['tests/test_calc.py::test_add']" in skipped["acme__calc-2"]
    assert "not pytest node ids" in skipped["acme__calc-3"] and "acme__calc-2" in err
    # the clone is as it was
    assert git(repos / "acme__calc", "rev-parse", "HEAD") == head
    assert git(repos / "acme__calc", "status", "--porcelain") == ""

    [task] = load_tasks(str(out))
    assert task.id == "acme__calc-1" and task.instruction == good["problem_statement"]
    assert task.metadata["fail_to_pass"] == ["tests/test_calc.py::test_mean"]
    assert task.metadata["pass_to_pass"] == ["tests/test_calc.py::test_add"]
    assert task.environment and os.path.isfile(os.path.join(task.environment, "bin", "python"))
    # the agent sees the base commit (old tests, buggy code); the new test is hidden
    assert open(os.path.join(task.repo, "calc", "__init__.py")).read() == BUGGY
    assert "test_mean" not in open(os.path.join(task.repo, "tests", "test_calc.py")).read()
    assert open(os.path.join(task.hidden_tests, "tests", "test_calc.py")).read() == NEW_TESTS

    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    gold = run_episode(task, ScriptAgent([{"name": "run_command", "arguments": {
        "command": "cat > /tmp/gold.patch << 'EOF'\n" + patch + "EOF\npatch -p1 < /tmp/gold.patch"}}]), config)
    assert gold.reward["correctness"] == 1.0 and gold.grading["mode"] == "pytest ids", gold.grading
    assert sorted(gold.grading["passed"]) == ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mean"]
    noop = run_episode(task, ScriptAgent([]), config)
    assert noop.reward["correctness"] == 0.0 and noop.grading["failed"] == ["tests/test_calc.py::test_mean"]


def test_nothing_imported_writes_nothing(tmp_path, capsys):
    repos = tmp_path / "repos"
    base, patch, test_patch = make_clone(repos)
    instances = tmp_path / "instances.jsonl"
    instances.write_text(json.dumps({"instance_id": "x-1", "repo": "acme/calc", "base_commit": "0" * 40,
                                     "patch": patch, "test_patch": test_patch, "problem_statement": "p",
                                     "FAIL_TO_PASS": "[\"tests/test_calc.py::test_mean\"]",
                                     "PASS_TO_PASS": "[]"}) + "\n" +
                         json.dumps({"instance_id": "x-2", "repo": "acme/missing"}) + "\n")
    out = tmp_path / "swe.jsonl"
    out.write_text("kept\n")
    assert load_tool().main([str(instances), "--repos", str(repos), "--out", str(out), "--no-env"]) == 1
    assert out.read_text() == "kept\n"
    reasons = [json.loads(line)["reason"] for line in (tmp_path / "swe.skipped.jsonl").read_text().splitlines()]
    assert "is not in" in reasons[0] and "missing fields" in reasons[1], reasons
    assert "the existing file is unchanged" in capsys.readouterr().err
