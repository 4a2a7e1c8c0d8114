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
    played = run_episode(mul, ScriptAgent(oracle), config)
    assert played.reward["correctness"] == 1.0
    # one diff measure on both sides: the exact oracle changed as many lines as the reference solution
    assert played.grading["diff_lines"] == mul.metadata["reference_diff_lines"] == 5  # 4 body lines + the stub
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
    played = run_episode(task, ScriptAgent(oracle), config)
    assert played.reward["correctness"] == 1.0
    assert played.grading["diff_lines"] == task.metadata["reference_diff_lines"] == 5
    assert run_episode(task, ScriptAgent([]), config).reward["correctness"] == 0.0


# ---- issue 28: tabs, reasons for a failing reference, variety, atomic output, one diff measure ----------------
TABBED = 'class Spec:\n\tdef match(self, path):\n\t\t"""True when path matches."""\n\t\tparts = path.split("/")\n' \
         '\t\treturn parts[-1].endswith(".py")\n\n\ndef norm(path):\n\tout = path.strip()\n\treturn out.lower()\n'
SPREAD = {"spread/__init__.py": "",
          "spread/alpha.py": "def first(x):\n    y = x + 1\n    return y\n\n\ndef second(x):\n    y = x * 2\n"
                             "    return y\n",
          "spread/beta.py": TABBED,
          "tests/test_spread.py": "from spread.alpha import first, second\nfrom spread.beta import Spec, norm\n\n\n"
                                  "def test_first():\n    assert first(1) == 2\n\n\ndef test_second():\n"
                                  "    assert second(2) == 4\n\n\ndef test_match():\n    assert Spec().match('a/b.py')"
                                  "\n\n\ndef test_norm():\n    assert norm(' A ') == 'a'\n"}


def _tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _quiet_miner(**config):
    from megatron_ext.env.mining import MineConfig, Miner
    return Miner(MineConfig(**config), log=lambda m: None)


def test_delete_body_keeps_tab_indentation(tmp_path):
    import ast

    from megatron_ext.env.mining import candidates
    _tree(tmp_path, {"m.py": TABBED})
    found, _ = candidates(str(tmp_path), ["m.py"], 2)
    assert [c.qualname for c in found] == ["Spec.match", "norm"]
    for c in found:
        deleted = delete_body(TABBED, c)
        ast.parse(deleted)  # an IndentationError when the stub is indented with spaces
        assert "\t" * c.qualname.count(".") + "\traise NotImplementedError\n" in deleted


def test_failing_reference_names_the_missing_module_and_shows_pytest_output(tmp_path):
    src = _tree(tmp_path / "needs", {"needs.py": "def f(x):\n    y = x\n    return y\n",
                                     "test_needs.py": "import not_installed_dep_xyz\nfrom needs import f\n\n\n"
                                                      "def test_f():\n    assert f(1) == 1\n"})
    tasks, skipped = _quiet_miner().mine(str(src), str(tmp_path / "out"))
    assert tasks == [] and len(skipped) == 1
    reason = skipped[0][1]
    assert "missing: not_installed_dep_xyz" in reason
    assert "ModuleNotFoundError: No module named 'not_installed_dep_xyz'" in reason  # pytest's own output
    (src / "pytest.ini").write_text("[pytest]\naddopts = --cov=needs\n")
    (src / "test_needs.py").write_text("from needs import f\n\n\ndef test_f():\n    assert f(1) == 1\n")
    _, skipped = _quiet_miner().mine(str(src), str(tmp_path / "out"))
    assert "missing: a pytest plugin for --cov" in skipped[0][1] and "unrecognized arguments" in skipped[0][1]


def test_per_file_cap_spreads_tasks_over_files_and_tab_indented_code_mines(tmp_path):
    src = _tree(tmp_path / "spread", SPREAD)
    tasks, skipped = _quiet_miner(max_tasks=2, max_per_file=1).mine(str(src), str(tmp_path / "out"))
    assert [t["metadata"]["function"] for t in tasks] == ["spread/alpha.py::first", "spread/beta.py::Spec.match"]
    assert ("spread/alpha.py::second", "over --max-per-file 1") in skipped
    stub = open(os.path.join(tmp_path, "out", tasks[1]["repo"], "spread", "beta.py")).read()
    assert "\t\t\"\"\"True when path matches.\"\"\"\n\t\traise NotImplementedError\n" in stub


def test_seed_shuffles_candidates_reproducibly(tmp_path, monkeypatch):
    from megatron_ext.env.mining import Miner
    src = _tree(tmp_path / "spread", SPREAD)
    tried = []
    monkeypatch.setattr(Miner, "_task", lambda self, ref, c, *a: (tried.append(c.id), (None, "recorded"))[1])
    reference, real = {}, Miner.run_suite  # only the reference runs here: run it once
    monkeypatch.setattr(Miner, "run_suite", lambda self, *a: reference.get("r") or reference.setdefault(
        "r", real(self, *a)))

    def order(seed):
        tried.clear()
        _quiet_miner(seed=seed).mine(str(src), str(tmp_path / "out"))
        return list(tried)

    in_path_order = order(None)
    assert in_path_order == ["spread/alpha.py::first", "spread/alpha.py::second", "spread/beta.py::Spec.match",
                             "spread/beta.py::norm"]
    assert order(3) == order(3) and sorted(order(3)) == sorted(in_path_order)
    assert any(order(seed) != in_path_order for seed in range(5))


def test_a_test_command_that_cannot_start_is_its_own_reason(tmp_path, monkeypatch):
    from megatron_ext.env import mining
    real = mining.pytest_command
    monkeypatch.setattr(mining, "pytest_command", lambda root, args: real(root, args) if "--junitxml" in args
                        else "no-such-test-runner-xyz " + args)
    src = _tree(tmp_path / "spread", SPREAD)
    tasks, skipped = _quiet_miner(max_candidates=1).mine(str(src), str(tmp_path / "out"))
    assert tasks == []
    reason = dict(skipped)["spread/alpha.py::first"]
    assert reason.startswith("the task's test command cannot be started (exit 127)") and "not found" in reason


def test_a_failed_mining_run_never_empties_or_creates_the_suite(tmp_path, capsys):
    import importlib.util

    from megatron_ext.env.mining import write_tasks
    src = _tree(tmp_path / "untested", {"m.py": "def f():\n    return 1\n"})
    out = tmp_path / "suite.jsonl"
    out.write_text('{"kept": true}\n')
    spec = importlib.util.spec_from_file_location("mine_tasks", os.path.join(ROOT, "tools", "mine_tasks.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for existing in (True, False):
        assert tool.main([str(src), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert "was not written" in err
        if existing:
            assert out.read_text() == '{"kept": true}\n' and "existing file is unchanged" in err
            out.unlink()
        else:
            assert not out.exists()
    with pytest.raises(ValueError, match="no tasks to write"):
        write_tasks(str(out), [])
    assert not out.exists() and not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
