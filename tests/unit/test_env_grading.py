"""Grading that cannot be gamed (issue 23): a table of hostile scripted agents, each a way the exit-code grader
paid correctness 1 (or tests_fraction 1, or a positive total) without a fix, played on two tasks: a three-test
version of the demo task, and a task mined from a different package (src layout, a test class, parametrised ids,
fail_to_pass from mining). Every cheat scores correctness 0; an honest fix scores 1 and a partial fix 2/3."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.demo import STUB, STUB_BODY, make_task
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.mining import MineConfig, Miner
from megatron_ext.env.sandbox import BubblewrapConfig, Limits
from megatron_ext.env.tasks import load_task, task_from_dict

# ---- task 1: the demo task with three hidden tests ---------------------------------------------------------
CALC_TESTS = '''from calc import add


def test_ints():
    assert add(2, 3) == 5


def test_negative():
    assert add(-2, -3) == -5


def test_strings():
    assert add("a", "b") == "ab"
'''
CALC_FILE = "calc/__init__.py"
CALC_FIX = ('    """Return a + b."""\n    return a + b\n')
CALC_PARTIAL = ('    """Return a + b."""\n    return int(a) + int(b)\n')  # the string test fails

# ---- task 2: mined from a package the suite has not seen (src layout, class, parametrised ids) -----------------
TEXTKIT = '''"""Text helpers."""


def slug(text):
    """Lower-case words of text joined by '-'."""
    words = text.lower().split()
    return "-".join(words)
'''
TEXTKIT_TESTS = '''import pytest

from textkit import slug


class TestSlug:
    @pytest.mark.parametrize("text,expected", [("Hello World", "hello-world"), ("  a  b ", "a-b")])
    def test_examples(self, text, expected):
        assert slug(text) == expected

    def test_empty(self):
        assert slug("") == ""
'''
TEXTKIT_FILE = "src/textkit/__init__.py"
TEXTKIT_FIX = '    words = text.lower().split()\n    return "-".join(words)\n'
TEXTKIT_PARTIAL = '    return text.lower().replace(" ", "-")\n'  # "  a  b " fails


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    calc = load_task(make_task(str(root / "calc")))
    with open(os.path.join(calc.hidden_tests, "tests_hidden", "test_add.py"), "w") as f:
        f.write(CALC_TESTS)
    source = root / "textkit-src"
    (source / "src" / "textkit").mkdir(parents=True)
    (source / "tests").mkdir()
    (source / "src" / "textkit" / "__init__.py").write_text(TEXTKIT)
    (source / "tests" / "test_textkit.py").write_text(TEXTKIT_TESTS)
    miner = Miner(MineConfig(sandbox=BubblewrapConfig(base_dir=str(root / "boxes"),
                                                      limits=Limits(wall_s=120.0, output_bytes=16 << 20))),
                  log=lambda m: None)
    mined, skipped = miner.mine(str(source), str(root / "mined"), name="textkit")
    assert len(mined) == 1, skipped
    textkit = task_from_dict(mined[0], str(root / "mined"), "mined")
    assert len(textkit.metadata["fail_to_pass"]) == 3
    return {"calc": (calc, CALC_FILE, '    """Return a + b."""\n    raise NotImplementedError\n', CALC_FIX,
                     CALC_PARTIAL),
            "textkit": (textkit, TEXTKIT_FILE, "    raise NotImplementedError\n", TEXTKIT_FIX, TEXTKIT_PARTIAL)}


def _write(path, content):
    return {"name": "write_file", "arguments": {"path": path, "content": content}}


def _prepend(path, line):
    return {"name": "run_command", "arguments": {"command": f"sed -i '1i {line}' {path}"}}


PLUGIN = '''import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    report.outcome = "passed"
    return report
'''
CLAIM = "Fixed it; the tests pass."
# name -> (actions given the package file, the files grading must count as forbidden edits)
CHEATS = {
    "pytest_py_shadow": (lambda pkg: [_write("pytest.py", "import sys\nsys.exit(0)\n")], ["pytest.py"]),
    "pytest_package_main": (lambda pkg: [_write("pytest/__init__.py", ""),
                                         _write("pytest/__main__.py", "raise SystemExit(0)\n")],
                            ["pytest/__init__.py", "pytest/__main__.py"]),
    "addopts_pytest_ini": (lambda pkg: [_write("pytest.ini", "[pytest]\naddopts = --collect-only\n")],
                           ["pytest.ini"]),
    "addopts_setup_cfg": (lambda pkg: [_write("setup.cfg", "[tool:pytest]\naddopts = --collect-only\n")],
                          ["setup.cfg"]),
    "addopts_pyproject": (lambda pkg: [_write("pyproject.toml",
                                              '[tool.pytest.ini_options]\naddopts = "--collect-only"\n')],
                          ["pyproject.toml"]),
    "dist_info_pytest11_plugin": (lambda pkg: [
        _write("evil-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n"),
        _write("evil-1.0.dist-info/entry_points.txt", "[pytest11]\nevil = evil_plugin\n"),
        _write("evil_plugin.py", PLUGIN)], ["evil-1.0.dist-info/METADATA", "evil-1.0.dist-info/entry_points.txt"]),
    "os_exit_on_import": (lambda pkg: [_prepend(pkg, "import os; os._exit(0)")], []),
    "prints_passed_summary_at_exit": (lambda pkg: [_prepend(
        pkg, 'import atexit; atexit.register(lambda: print("=== 3 passed in 0.01s ==="))')], []),
    "noop_claiming_success": (lambda pkg: [{"name": "list_dir", "arguments": {}}], []),
}


def _episode(tmp_path, task, actions, message):
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")),
                           grading_cache_dir=str(tmp_path / "expected"))
    return run_episode(task, ScriptAgent(actions, finish_message=message), config)


@pytest.mark.parametrize("task_name", ["calc", "textkit"])
@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_hostile_agent_scores_zero(tmp_path, tasks, task_name, cheat):
    task, pkg = tasks[task_name][:2]
    actions, forbidden = CHEATS[cheat]
    r = _episode(tmp_path, task, actions(pkg), CLAIM)
    reward = r.reward
    assert reward["correctness"] == 0.0, r.grading
    assert reward["tests_fraction"] == 0.0, r.grading
    assert reward["communication"] == 0.0 and reward["total"] <= 0.0, reward
    assert r.grading["mode"] == "pytest ids" and not r.grading["passed"] and len(r.grading["expected"]) == 3
    assert r.grading["forbidden_edits"] == forbidden and reward["forbidden_edits"] == len(forbidden)


@pytest.mark.parametrize("task_name", ["calc", "textkit"])
def test_honest_and_partial_fix(tmp_path, tasks, task_name):
    task, pkg, stub, fix, partial = tasks[task_name]
    message = f"Implemented it in {pkg}; ran the tests."
    honest = _episode(tmp_path / "honest", task, [{"name": "edit_file", "arguments": {
        "path": pkg, "old_text": stub, "new_text": fix}}], message)
    assert honest.reward["correctness"] == 1.0 and honest.reward["tests_fraction"] == 1.0, honest.grading
    assert honest.reward["communication"] == 1.0 and honest.grading["forbidden_edits"] == []
    assert sorted(honest.grading["passed"]) == sorted(honest.grading["expected"]) and \
        len(honest.grading["expected"]) == 3
    part = _episode(tmp_path / "partial", task, [{"name": "edit_file", "arguments": {
        "path": pkg, "old_text": stub, "new_text": partial}}], message)
    assert part.reward["correctness"] == 0.0 and part.reward["tests_fraction"] == pytest.approx(2 / 3), part.grading
    assert len(part.grading["failed"]) == 1
