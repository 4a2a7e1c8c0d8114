"""Feature-deletion mining on a small git repository: verified tasks, reasons for every skip, and the mined tasks
behave: an oracle applying the reference change scores 1, a no-op 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.mining import Candidate, delete_body, parse_junit
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.tasks import load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACKAGE = '''"""Small maths."""


def add(a, b):
    """Sum of a and b."""
    total = a + b
    return total


def mul(a, b):
    out = 0
    for _ in range(b):
        out += a
    return out


def helper(x):
    y = x * 2
    return y


def tiny():
    return 1


def unused(x):
    z = x - 1
    return z


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)
        return len(self.items)
'''
TESTS = '''from mathy import Stack, add, mul


def test_add():
    assert add(2, 3) == 5


def test_mul():
    assert mul(4, 3) == 12


def test_reference_bug():
    assert mul(2, 2) == 5  # fails on the reference: must be deselected


class TestStack:
    def test_push(self):
        assert Stack().push(1) == 1


def test_mentions_unused_and_tiny():
    assert "unused" and "tiny"
'''


def _git_repo(root):
    repo = root / "mathy-repo"
    (repo / "mathy").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "mathy" / "__init__.py").write_text(PACKAGE)
    (repo / "tests" / "test_mathy.py").write_text(TESTS)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    return repo


def test_delete_body_keeps_signature_and_docstring():
    c = Candidate("m.py", "add", 4, 6, 7, "    ", "def add(a, b):", "Sum of a and b.")
    assert delete_body(PACKAGE, c).splitlines()[3:7] == ["def add(a, b):", '    """Sum of a and b."""',
                                                         "    raise NotImplementedError", ""]


def test_parse_junit_node_ids():
    xml = ('<testsuites><testsuite><testcase classname="tests.test_m" name="test_a"/>'
           '<testcase classname="tests.test_m.TestS" name="test_b[1]"><failure/></testcase>'
           '<testcase classname="tests.test_m" name="test_c"><skipped/></testcase></testsuite></testsuites>')
    assert parse_junit(xml, ["tests/test_m.py"]) == {"tests/test_m.py::test_a": "passed",
                                                     "tests/test_m.py::TestS::test_b[1]": "failed",
                                                     "tests/test_m.py::test_c": "skipped"}


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_mine_a_git_repository_and_play_the_tasks(tmp_path):
    repo = _git_repo(tmp_path)
    out = tmp_path / "suite" / "mathy.jsonl"
    out.parent.mkdir()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "mine_tasks.py"), str(repo), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    skipped = {json.loads(line)["skipped"]: json.loads(line)["reason"]
               for line in r.stderr.splitlines() if line.startswith("{")}
    assert skipped == {"mathy/__init__.py::tiny": "body shorter than 2 lines",
                       "mathy/__init__.py::Stack.__init__": "body shorter than 2 lines",
                       "mathy/__init__.py::helper": "no test file mentions its name",
                       "mathy/__init__.py::unused": "deleting the body breaks no passing test"}
    tasks = load_tasks(str(out))
    assert [t.id for t in tasks] == ["mathy-repo:mathy/__init__.py::add", "mathy-repo:mathy/__init__.py::mul",
                                     "mathy-repo:mathy/__init__.py::Stack.push"]
    add, mul, push = tasks
    assert add.metadata["fail_to_pass"] == ["tests/test_mathy.py::test_add"]
    # the other tests of the file that pass before and after: grading expects them too (never the reference's bug)
    assert add.metadata["pass_to_pass"] == ["tests/test_mathy.py::TestStack::test_push",
                                            "tests/test_mathy.py::test_mentions_unused_and_tiny",
                                            "tests/test_mathy.py::test_mul"]
    assert push.metadata["fail_to_pass"] == ["tests/test_mathy.py::TestStack::test_push"]
    assert "--deselect tests/test_mathy.py::test_reference_bug" in mul.test_command
    assert "Sum of a and b." in add.instruction and "def add(a, b)" in add.instruction
    # the agent's copy: the body deleted, no tests, no history; the hidden tests live elsewhere
    assert sorted(os.listdir(add.repo)) == ["mathy"]
    assert "raise NotImplementedError" in open(os.path.join(add.repo, "mathy", "__init__.py")).read()
    assert os.listdir(os.path.join(add.hidden_tests, "tests")) == ["test_mathy.py"]
    assert open(repo / "mathy" / "__init__.py").read() == PACKAGE  # the source is untouched

    diff = mul.metadata["reference_diff"]
    body = "".join(line[1:] for line in diff.splitlines(True) if line.startswith("+") and not line.startswith("+++"))
    oracle = [{"name": "edit_file", "arguments": {"path": "mathy/__init__.py",
                                                  "old_text": "    raise NotImplementedError\n", "new_text": body}}]
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    assert run_episode(mul, ScriptAgent(oracle), config).reward["correctness"] == 1.0
    assert run_episode(mul, ScriptAgent([]), config).reward["correctness"] == 0.0


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_mine_commits_that_changed_code_and_tests(tmp_path):
    from megatron_ext.env.mining import Miner
    repo = _git_repo(tmp_path)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    feature = PACKAGE + '''

def neg(x):
    """Minus x."""
    return -x
'''
    (repo / "mathy" / "__init__.py").write_text(feature)
    (repo / "tests" / "test_neg.py").write_text("from mathy import neg\n\n\ndef test_neg():\n    assert neg(2) == -2\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "Add neg(x), the negation of x"], cwd=repo, check=True, env=env)
    (repo / "README").write_text("docs only\n")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "Docs"], cwd=repo, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()

    out = tmp_path / "suite"
    tasks, skipped = Miner(log=lambda m: None).mine_commits(str(repo), str(out), max_commits=10)
    reasons = [reason for _, reason in skipped]
    assert reasons == ["does not change both code and tests", "root commit (no parent)"]
    assert len(tasks) == 1
    path = out / "suite.jsonl"
    path.write_text(json.dumps(tasks[0]) + "\n")
    task = load_tasks(str(path))[0]
    assert task.instruction.startswith("Make the change this commit message describes:\n\nAdd neg(x), the negation")
    assert task.metadata["fail_to_pass"] == ["tests/test_neg.py::test_neg"]
    assert "+def neg(x):" in task.metadata["reference_diff"]
    assert "neg" not in open(os.path.join(task.repo, "mathy", "__init__.py")).read()  # the parent's code
    assert sorted(os.listdir(os.path.join(task.hidden_tests, "tests"))) == ["test_mathy.py", "test_neg.py"]
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip() \
        == head and (repo / "mathy" / "__init__.py").read_text() == feature  # the checkout is only read

    oracle = [{"name": "write_file", "arguments": {"path": "mathy/__init__.py", "content": feature}}]
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    assert run_episode(task, ScriptAgent(oracle), config).reward["correctness"] == 1.0
    assert run_episode(task, ScriptAgent([]), config).reward["correctness"] == 0.0
