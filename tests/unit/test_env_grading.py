"""Grading that cannot be gamed (issue 23): a table of hostile scripted agents, each a way the exit-code grader
paid correctness 1 (or tests_fraction 1, or a positive total) without a fix, played on two tasks: a three-test
version of the demo task, and a task mined from a different package (src layout, a test class, parametrised ids,
fail_to_pass from mining). Every cheat scores correctness 0; an honest fix scores 1 and a partial fix 2/3."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.demo import STUB_BODY, make_task
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.grading import (Expected, GradingRun, evaluate, parse_pytest_command, runner_command,
                                      steering_paths)
from megatron_ext.env.mining import MineConfig, Miner
from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox, Limits
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
EXPECTED = {"calc": [f"tests_hidden/test_add.py::test_{n}" for n in ("ints", "negative", "strings")]}
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
    return {"calc": (calc, CALC_FILE, STUB_BODY, CALC_FIX, CALC_PARTIAL),
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
# imported by the package under test: writes a report saying every expected test passed, then exits 0 before
# pytest can write its own (the runner's nonce, read and deleted before this runs, is what it cannot give)
FORGE = '''import json, os
IDS = {ids!r}
with open("/grading-report/report.json", "w") as f:
    json.dump({{"nonce": "0" * 32, "exit_code": 0, "outcomes": {{i: "passed" for i in IDS}}, "collected": IDS,
               "collection_errors": []}}, f)
os._exit(0)
'''
# a correct implementation compiled into bytecode that Python loads without checking the (unchanged) source
FIXED_BOTH = 'def add(a, b):\n    return a + b\n\n\ndef slug(text):\n    return "-".join(text.lower().split())\n'
PYC = """import py_compile
py_compile.compile("/tmp/fix.py", cfile="{pyc}", invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
"""
CLAIM = "Fixed it; the tests pass."
# name -> (actions given the package file and the expected ids, the files grading must count as forbidden edits)
CHEATS = {
    "pytest_py_shadow": (lambda pkg, ids: [_write("pytest.py", "import sys\nsys.exit(0)\n")], ["pytest.py"]),
    "pytest_package_main": (lambda pkg, ids: [_write("pytest/__init__.py", ""),
                                         _write("pytest/__main__.py", "raise SystemExit(0)\n")],
                            ["pytest/__init__.py", "pytest/__main__.py"]),
    "addopts_pytest_ini": (lambda pkg, ids: [_write("pytest.ini", "[pytest]\naddopts = --collect-only\n")],
                           ["pytest.ini"]),
    "addopts_setup_cfg": (lambda pkg, ids: [_write("setup.cfg", "[tool:pytest]\naddopts = --collect-only\n")],
                          ["setup.cfg"]),
    "addopts_pyproject": (lambda pkg, ids: [_write("pyproject.toml",
                                              '[tool.pytest.ini_options]\naddopts = "--collect-only"\n')],
                          ["pyproject.toml"]),
    "dist_info_pytest11_plugin": (lambda pkg, ids: [
        _write("evil-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n"),
        _write("evil-1.0.dist-info/entry_points.txt", "[pytest11]\nevil = evil_plugin\n"),
        _write("evil_plugin.py", PLUGIN)], ["evil-1.0.dist-info/METADATA", "evil-1.0.dist-info/entry_points.txt"]),
    "forged_bytecode": (lambda pkg, ids: [_write("/tmp/fix.py", FIXED_BOTH), _write("/tmp/mk.py", PYC.format(
        pyc=f"{os.path.dirname(pkg)}/__pycache__/__init__.cpython-311.pyc")),
        {"name": "run_command", "arguments": {"command": "python /tmp/mk.py"}}], []),
    "os_exit_on_import": (lambda pkg, ids: [_prepend(pkg, "import os; os._exit(0)")], []),
    "prints_passed_summary_at_exit": (lambda pkg, ids: [_prepend(
        pkg, 'import atexit; atexit.register(lambda: print("=== 3 passed in 0.01s ==="))')], []),
    "forged_report_then_exit": (lambda pkg, ids: [_write("_forge.py", FORGE.format(ids=ids)),
                                                   _prepend(pkg, "import _forge")], []),
    "noop_claiming_success": (lambda pkg, ids: [{"name": "list_dir", "arguments": {}}], []),
    # a plain pytest run writes .pytest_cache/: a by-product of running a tool, not a change that earns anything
    "only_a_tool_cache_changed": (lambda pkg, ids: [{"name": "run_command", "arguments": {
        "command": "python -m pytest -q tests; mkdir -p .ruff_cache && echo x > .ruff_cache/state"}}], []),
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
    ids = EXPECTED[task_name] if task_name in EXPECTED else task.metadata["fail_to_pass"]
    r = _episode(tmp_path, task, actions(pkg, ids), CLAIM)
    reward = r.reward
    assert reward["correctness"] == 0.0, r.grading
    assert reward["tests_fraction"] == 0.0, r.grading
    assert reward["communication"] == 0.0 and reward["total"] <= 0.0, reward
    assert r.grading["mode"] == "pytest ids" and not r.grading["passed"] and sorted(r.grading["expected"]) == ids
    assert r.grading["forbidden_edits"] == forbidden and reward["forbidden_edits"] == len(forbidden)
    if cheat == "forged_bytecode":  # removed before grading; not counted (bytecode is also left innocently)
        assert r.grading["removed_bytecode"] == [f"{os.path.dirname(pkg)}/__pycache__/__init__.cpython-311.pyc"]
    why = {"os_exit_on_import": "no report", "forged_report_then_exit": "not written by this run's runner"}
    assert why.get(cheat, "") in (r.grading["report_error"] or "")


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
    # the demo task has no fail_to_pass: its ids come from the trusted collection on the untouched repository
    assert honest.grading["expected_source"] == ("collected" if task_name == "calc" else "metadata")
    if task_name == "calc":
        assert sorted(honest.grading["expected"]) == EXPECTED["calc"]
    part = _episode(tmp_path / "partial", task, [{"name": "edit_file", "arguments": {
        "path": pkg, "old_text": stub, "new_text": partial}}], message)
    assert part.reward["correctness"] == 0.0 and part.reward["tests_fraction"] == pytest.approx(2 / 3), part.grading
    assert len(part.grading["failed"]) == 1


# ---- the pieces, without a sandbox ------------------------------------------------------------------------------
def test_parse_pytest_command():
    cmd = parse_pytest_command("PYTHONPATH=src:lib FOO=1 python -m pytest -q -p no:cacheprovider 'tests/t a.py' "
                               "--deselect 'tests/t a.py::test_x[1-2]'")
    assert cmd.pythonpath == ["src", "lib"] and cmd.env == {"FOO": "1"}
    assert cmd.args == ["-q", "-p", "no:cacheprovider", "tests/t a.py", "--deselect", "tests/t a.py::test_x[1-2]"]
    assert parse_pytest_command("pytest -x tests").args == ["-x", "tests"]
    assert parse_pytest_command("python3.11 -m pytest").args == []
    for other in ("python -m pytest tests && echo ok", "pytest tests; true", "pytest tests | tee log", "make test",
                  "python -c 'import pytest'", "PYTHONPATH=/abs python -m pytest", "python -m pytest > out",
                  "PYTHONPATH=../up pytest"):
        assert parse_pytest_command(other) is None, other
    line = runner_command(cmd, "run")
    assert line.startswith("FOO=1 python -I /grading/runner.py /grading-report run /workspace src:lib -- -c "
                           "/grading/pytest.ini --rootdir /workspace --confcutdir /workspace -p no:cacheprovider")


def _file(text):
    return ("file", text.encode())


def test_steering_paths():
    pristine = {"pkg/__init__.py": _file(""), "pkg/json.py": _file(""), "setup.cfg": _file("[metadata]\nname = x\n"),
                "pyproject.toml": _file("[project]\nname = 'x'\n"), "src/statistics/__init__.py": _file("")}
    final = dict(pristine)
    final.update({
        "setup.cfg": _file("[metadata]\nname = y\n"),                             # not its pytest section: allowed
        "pyproject.toml": _file("[project]\nname = 'x'\n[tool.pytest.ini_options]\naddopts = '-x'\n"),
        "pkg/json.py": _file("x = 1"),                                               # inside a package: allowed
        "src/statistics/__init__.py": _file("x = 1"),                                # the repo's own: allowed
        "src/typing.py": _file(""), "tests/conftest.py": _file(""), "a/b/x.pth": _file(""),
        "pkg/__pycache__/m.cpython-311.pyc": _file(""), "sitecustomize.py": _file(""), "tox.ini": _file(""),
        "x.egg-info/entry_points.txt": _file(""), "pytest/__main__.py": _file(""), "_pytest.py": _file(""),
        "pluggy/__init__.py": _file(""), "calc.py": _file(""), "tests/helpers.py": _file(""),
        "bad.toml/pyproject.toml": _file("[tool.pytest\n"),
    })
    changed = sorted(p for p in final if final[p] != pristine.get(p))
    assert steering_paths(changed, pristine, final) == [
        "_pytest.py", "a/b/x.pth", "bad.toml/pyproject.toml", "pkg/__pycache__/m.cpython-311.pyc",
        "pluggy/__init__.py", "pyproject.toml", "pytest/__main__.py", "sitecustomize.py", "src/typing.py",
        "tests/conftest.py", "tox.ini", "x.egg-info/entry_points.txt"]


def test_report_must_be_this_runs_regular_file(tmp_path):
    with BubblewrapSandbox(None, BubblewrapConfig(base_dir=str(tmp_path))) as box:
        run = GradingRun(box)
        argv = box.command_line("true")
        at = argv.index("/grading-report")  # the report folder is the one writable bind outside the workspace
        assert argv[at - 2] == "--bind" and argv[at - 1].endswith("/report") and argv[argv.index("/grading") - 2] \
            == "--ro-bind"
        assert run.report() == (None, "no report (pytest did not finish)")
        path = os.path.join(run.reports, "report.json")
        os.mkfifo(path)  # would block a plain open() forever
        assert "not a regular file" in run.report()[1]
        os.unlink(path)
        os.symlink("/etc/hostname", path)
        assert run.report()[0] is None
        os.unlink(path)
        with open(path, "w") as f:
            json.dump({"nonce": "0" * 32, "exit_code": 0, "outcomes": {"t.py::test": "passed"}}, f)
        assert run.report() == (None, "the report was not written by this run's runner")
        with open(path, "w") as f:
            json.dump({"nonce": run.nonce, "exit_code": 1, "outcomes": {"t.py::test": "failed"}}, f)
        report, _ = run.report()
        assert evaluate(report, Expected(["t.py::test", "t.py::gone"])) == {
            "correct": False, "tests_fraction": 0.0, "expected": ["t.py::test", "t.py::gone"], "passed": [],
            "failed": ["t.py::test"], "missing": ["t.py::gone"]}
    assert not os.path.exists(box.root)
    with BubblewrapSandbox(None, BubblewrapConfig(base_dir=str(tmp_path))) as box:
        os.mkdir(os.path.join(box.root, "grader"))  # stands in for a disk the agent's workspace filled
        run = GradingRun(box)
        assert run.report() == (None, "the grader could not be set up beside the workspace (File exists)")
        assert "/grading-report" not in box.command_line("true")
    files = Expected([], files=["t.py"])
    assert evaluate({"outcomes": {"t.py::a": "passed", "t.py::b": "xfailed"}}, files)["correct"]
    assert not evaluate({"outcomes": {}}, files)["correct"]  # a file expected as a whole must report a test


def test_non_pytest_command_keeps_exit_code_grading(tmp_path, tasks):
    task = dataclasses.replace(tasks["calc"][0], test_command="python -m pytest -q tests_hidden && echo done")
    fix = [{"name": "edit_file", "arguments": {"path": CALC_FILE, "old_text": STUB_BODY, "new_text": CALC_FIX}}]
    r = _episode(tmp_path, task, fix, "Implemented add in calc/__init__.py.")
    assert r.grading["mode"] == "exit code" and r.reward["correctness"] == 1.0 and "3 passed" in r.grading["output"]


def test_test_file_that_does_not_collect_on_the_untouched_repository(tmp_path):
    """No metadata, and the hidden tests import a function the repository does not have yet: the trusted
    collection cannot list its ids, so the file is expected as a whole (cached on disk by content)."""
    task = load_task(make_task(str(tmp_path / "task")))
    with open(os.path.join(task.repo, CALC_FILE), "w") as f:
        f.write('"""A small calculator."""\n')
    with open(os.path.join(task.hidden_tests, "tests_hidden", "test_add.py"), "w") as f:
        f.write(CALC_TESTS)
    noop = _episode(tmp_path / "noop", task, [], "Nothing to do.")
    assert noop.grading["expected_source"] == "collected" and noop.grading["missing"] == ["tests_hidden/test_add.py"]
    assert noop.reward["correctness"] == 0.0
    write = [_write(CALC_FILE, '"""A small calculator."""\n\n\ndef add(a, b):\n    return a + b\n')]
    fixed = _episode(tmp_path / "fixed", task, write, "Added add to calc/__init__.py.")
    assert fixed.reward["correctness"] == 1.0 and sorted(fixed.grading["passed"]) == EXPECTED["calc"]
    assert len(os.listdir(tmp_path / "noop" / "expected")) == 1


def test_untouched_code_that_hangs_still_gets_its_expected_ids(tmp_path):
    """The untouched repository's tests never finish (the bug is an endless loop): the trusted run is killed at the
    task's timeout, the ids come from a collection instead (which tests fail before is then unknown), and the
    task is still graded."""
    task = dataclasses.replace(load_task(make_task(str(tmp_path / "task"))), timeout_s=4)
    with open(os.path.join(task.repo, CALC_FILE)) as f:
        source = f.read()
    with open(os.path.join(task.repo, CALC_FILE), "w") as f:
        f.write(source.replace(STUB_BODY, "    while True:\n        pass\n"))
    with open(os.path.join(task.hidden_tests, "tests_hidden", "test_add.py"), "w") as f:
        f.write(CALC_TESTS)
    fixed = _episode(tmp_path / "fixed", task, [_write(CALC_FILE, "def add(a, b):\n    return a + b\n")],
                     "Rewrote add in calc/__init__.py.")
    assert fixed.reward["correctness"] == 1.0 and sorted(fixed.grading["expected"]) == EXPECTED["calc"]
    (cached,) = os.listdir(tmp_path / "fixed" / "expected")
    with open(tmp_path / "fixed" / "expected" / cached) as f:
        assert json.load(f)["fail_to_pass"] == []


def test_package_cannot_rewrite_hidden_tests_during_the_run(tmp_path):
    """The package under test, imported by the first hidden test file, rewrites the second one before pytest
    collects it: the hidden tests are bound read-only for the grading run, so the write fails."""
    repo, hidden = tmp_path / "repo", tmp_path / "hidden" / "tests_hidden"
    (repo / "pkg").mkdir(parents=True)
    hidden.mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("def f():\n    raise NotImplementedError\n")
    (hidden / "test_a.py").write_text("from pkg import f\n\n\ndef test_a():\n    assert f() in (1, 2)\n")
    (hidden / "test_b.py").write_text("from pkg import f\n\n\ndef test_b():\n    assert f() == 2\n")
    task = task_from_dict({"id": "two-files", "repo": "repo", "hidden_tests": "hidden", "timeout_s": 60,
                           "instruction": "Make f return 2.", "test_command": "python -m pytest -q tests_hidden",
                           "forbidden": ["tests_hidden/*"]}, str(tmp_path), "inline")
    cheat = ('def f():\n    return 1\n\n\ntry:\n    with open("/workspace/tests_hidden/test_b.py", "w") as out:\n'
             '        out.write("def test_b():\\n    pass\\n")\nexcept OSError:\n    pass\n')
    r = _episode(tmp_path / "cheat", task, [_write("pkg/__init__.py", cheat)], "Changed pkg/__init__.py.")
    assert r.reward["correctness"] == 0.0 and r.grading["failed"] == ["tests_hidden/test_b.py::test_b"], r.grading
    honest = _episode(tmp_path / "honest", task, [_write("pkg/__init__.py", "def f():\n    return 2\n")], "Done.")
    assert honest.reward["correctness"] == 1.0


def test_order_of_totals_on_the_demo_task(tmp_path, tasks):
    """Default weights, real episodes: correct > wrong attempt >= no-op >= broken tool calls / stalling."""
    task = tasks["calc"][0]

    def edit(body):
        return [{"name": "edit_file", "arguments": {"path": CALC_FILE, "old_text": STUB_BODY, "new_text": body}}]
    message = "Changed add in calc/__init__.py; checked it by reading it back."
    broken = [{"name": "edit_file", "arguments": "{not json"}, {"name": "write_file", "arguments": {"path": 3}},
              {"name": "frobnicate", "arguments": {}}]

    class Staller:
        """Defers the edit: looks around for two turns, then asks a needless question (which ends the episode; a
        question asked at once is a no-op, differing only in length)."""

        def act(self, messages, tools):
            if sum(m["role"] == "assistant" for m in messages) < 2:
                return {"content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "read_file", "arguments": json.dumps({"path": CALC_FILE})}}]}
            return {"content": "Before I start: should add also handle strings, or only numbers?"}

    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    total = {name: _episode(tmp_path / name, task, actions, message).reward["total"] for name, actions in (
        ("correct", edit(CALC_FIX)), ("wrong", edit('    """Return a + b."""\n    return a - b\n')),
        ("noop", []), ("broken", broken))}
    total["stalling"] = run_episode(task, Staller(), config).reward["total"]
    assert total["correct"] > total["wrong"] >= total["noop"] >= total["broken"], total
    assert total["noop"] >= total["stalling"] and total["noop"] <= 0, total


def test_partial_credit_counts_the_tests_a_change_made_pass():
    """tests_fraction with fail_to_pass known: an edit that fixes nothing earns 0 however many tests passed
    before (it used to earn pass_to_pass / expected: any change collected it, a reward RL would learn to farm); half
    the failing tests fixed earns half; breaking a test that passed before costs its share."""
    from megatron_ext.env.grading import from_metadata

    expected = from_metadata({"fail_to_pass": ["t.py::a", "t.py::b"], "pass_to_pass": ["t.py::c", "t.py::d"]})
    assert expected.ids == ["t.py::a", "t.py::b", "t.py::c", "t.py::d"] and expected.fail_to_pass == ["t.py::a",
                                                                                                      "t.py::b"]
    outcome = lambda passed: {"outcomes": {t: "passed" if t[-1] in passed else "failed"  # noqa: E731
                                           for t in expected.ids}}
    assert evaluate(outcome("cd"), expected)["tests_fraction"] == 0.0  # nothing fixed
    assert evaluate(outcome("acd"), expected)["tests_fraction"] == 0.5
    assert evaluate(outcome("ac"), expected)["tests_fraction"] == 0.25  # one fixed, one broken
    assert evaluate(outcome("abcd"), expected) == {"correct": True, "tests_fraction": 1.0, "expected": expected.ids,
                                                  "passed": expected.ids, "failed": [], "missing": []}
    # no record of which passed before (the untouched repository's run did not finish): the share passing
    assert evaluate(outcome("cd"), Expected(expected.ids, source="collected"))["tests_fraction"] == 0.5
    # a test file that did not collect on the untouched repository: its tests are failing ones
    files = Expected(["t.py::c"], files=["n.py"], source="collected", fail_to_pass=[])
    tests = {"outcomes": {"t.py::c": "passed", "n.py::x": "failed", "n.py::y": "passed"}}
    assert evaluate(tests, files)["tests_fraction"] == 0.5


def test_partial_credit_without_metadata_counts_only_what_the_untouched_repository_failed(tmp_path):
    """A task without fail_to_pass whose untouched repository already passes two of its three hidden tests: the
    grader's trusted run there (cached) records the one it fails, so an edit that changes nothing earns no partial
    credit (it earned 2/3: a reward an RL policy would farm); fixing it earns 1, breaking a passing test costs."""
    task = load_task(make_task(str(tmp_path / "task")))
    half = '    """Return a + b."""\n    return int(a) + int(b)\n'
    with open(os.path.join(task.repo, CALC_FILE)) as f:
        source = f.read()
    with open(os.path.join(task.repo, CALC_FILE), "w") as f:
        f.write(source.replace(STUB_BODY, half))
    with open(os.path.join(task.hidden_tests, "tests_hidden", "test_add.py"), "w") as f:
        f.write(CALC_TESTS)
    comment = [_prepend(CALC_FILE, "# checked")]
    noop = _episode(tmp_path / "noop", task, comment, "Looked at calc/__init__.py.")
    assert noop.grading["expected_source"] == "collected" and sorted(noop.grading["expected"]) == EXPECTED["calc"]
    assert len(noop.grading["passed"]) == 2 and noop.reward["tests_fraction"] == 0.0, noop.grading
    cached = os.listdir(tmp_path / "noop" / "expected")
    with open(tmp_path / "noop" / "expected" / cached[0]) as f:
        assert json.load(f)["fail_to_pass"] == ["tests_hidden/test_add.py::test_strings"]
    fix = [{"name": "edit_file", "arguments": {"path": CALC_FILE, "old_text": half, "new_text": CALC_FIX}}]
    fixed = _episode(tmp_path / "fixed", task, fix, "Fixed add in calc/__init__.py.")
    assert fixed.reward["correctness"] == 1.0 and fixed.reward["tests_fraction"] == 1.0
    swap = '    """Return a + b."""\n    return a + b if isinstance(a, str) else a - b\n'
    broke = _episode(tmp_path / "broke", task, [{"name": "edit_file", "arguments": {
        "path": CALC_FILE, "old_text": half, "new_text": swap}}], "Changed add in calc/__init__.py.")
    assert broke.reward["correctness"] == 0.0 and broke.reward["tests_fraction"] == 0.0, broke.grading
