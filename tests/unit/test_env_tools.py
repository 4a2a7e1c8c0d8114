"""The agent's tools: strict validation, precise errors, truncation, and each tool's behaviour in a sandbox."""

from __future__ import annotations

import json

import pytest

from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox
from megatron_ext.env.tools import TOOL_SCHEMAS, Toolbox, ToolLimits, truncate, validate, ToolError
from megatron_ext.env.demo import STUB, make_task


@pytest.fixture
def tools(tmp_path):
    make_task(str(tmp_path))
    box = BubblewrapSandbox(str(tmp_path / "repo"), BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    yield Toolbox(box, ToolLimits(observation_chars=400, read_lines=5, command_timeout_s=10))
    box.close()


def test_schemas_are_openai_functions_the_server_accepts():
    from megatron_ext.inference.server import _tools
    assert _tools(TOOL_SCHEMAS) == TOOL_SCHEMAS
    assert [t["function"]["name"] for t in TOOL_SCHEMAS] == ["read_file", "list_dir", "grep", "edit_file",
                                                             "write_file", "run_command", "todo", "finish"]


@pytest.mark.parametrize("name,arguments,message", [
    ("read_file", '{"path": 1}', "argument 'path' must be string, got int"),
    ("read_file", "[1]", "must be a JSON object, got list"),
    ("read_file", "{", "not valid JSON"),
    ("read_file", {}, "missing required arguments ['path']"),
    ("read_file", {"path": "a", "start_line": True}, "'start_line' must be integer, got bool"),
    ("grep", {"pattern": "x", "globs": "*.py"}, "'globs' must be array of strings"),
    ("todo", {"action": "drop"}, "must be one of ['add', 'complete', 'list']"),
    ("rm", {}, "unknown tool 'rm'"),
])
def test_validation_errors(name, arguments, message):
    with pytest.raises(ToolError) as e:
        validate(name, arguments)
    assert message in str(e.value)


def test_truncation_marker():
    text = "".join(str(i % 10) for i in range(1000))
    out = truncate(text, 90)
    assert out.startswith(text[:60]) and out.endswith(text[-30:]) and "[... 910 characters truncated ...]" in out
    assert truncate("short", 90) == "short"


def test_read_file_ranges(tools):
    assert tools.call("read_file", {"path": "calc/__init__.py", "start_line": 4, "end_line": 5}).observation == \
        '     4\tdef add(a, b):\n     5\t    """Return a + b."""'
    long = tools.call("read_file", {"path": "calc/__init__.py"}).observation
    assert long.splitlines()[-1] == f"[... showing lines 1-5 of {len(STUB.splitlines())}; read on with start_line=6]"
    past = tools.call("read_file", {"path": "calc/__init__.py", "start_line": 99})
    assert not past.valid and "has 11 lines" in past.error
    missing = tools.call("read_file", {"path": "nope.py"})
    assert missing.observation == "error: nope.py: no such file"
    outside = tools.call("read_file", {"path": "/etc/passwd"})
    assert "outside the workspace" in outside.error
    assert tools.invalid_calls == 3


def test_list_dir_and_grep(tools):
    assert tools.call("list_dir", {}).observation == "calc/\ntests/"
    assert tools.call("list_dir", {"path": "calc"}).observation == "__init__.py"
    assert tools.call("list_dir", {"path": "nowhere"}).error.startswith("list_dir: find:")
    hits = tools.call("grep", {"pattern": r"def \w+\(a, b\)", "globs": ["*.py"]}).observation.splitlines()
    assert hits == ["./calc/__init__.py:4:def add(a, b):", "./calc/__init__.py:9:def sub(a, b):"]
    assert tools.call("grep", {"pattern": "RETURN A \\+", "ignore_case": True, "path": "calc"}).observation == \
        'calc/__init__.py:5:    """Return a + b."""'
    assert tools.call("grep", {"pattern": "sub", "globs": ["*.txt"]}).observation == "no matches"
    assert "invalid regular expression" in tools.call("grep", {"pattern": "(unclosed"}).error


def test_edit_and_write_file(tools):
    r = tools.call("edit_file", {"path": "calc/__init__.py", "old_text": "    raise NotImplementedError\n",
                                 "new_text": "    return a + b\n"})
    assert r.valid and r.observation == "edited calc/__init__.py: replaced 1 line(s) at line 6 with 1 line(s)"
    assert tools.sandbox.read_file("calc/__init__.py").decode() == STUB.replace("raise NotImplementedError",
                                                                                 "return a + b")
    # a final newline ends the last line, it does not start another; no newline at all is still one line
    assert tools.call("edit_file", {"path": "calc/__init__.py", "old_text": "    return a + b",
                                    "new_text": "    return a + b  # sum\n    # end"}).observation == \
        "edited calc/__init__.py: replaced 1 line(s) at line 6 with 2 line(s)"
    assert tools.call("edit_file", {"path": "calc/__init__.py", "old_text": "    # end\n",
                                    "new_text": ""}).observation == \
        "edited calc/__init__.py: replaced 1 line(s) at line 7 with 0 line(s)"
    assert "old_text is empty" in tools.call("edit_file", {"path": "calc/__init__.py", "old_text": "",
                                                           "new_text": "x"}).error
    assert tools.call("write_file", {"path": "new/dir/f.py", "content": "a\nb\n"}).observation == \
        "wrote new/dir/f.py (2 lines, 4 bytes)"
    assert tools.call("run_command", {"command": "cat new/dir/f.py"}).observation == "a\nb\n[exit code 0]"


def test_run_command_todo_and_finish(tools):
    assert tools.call("run_command", {"command": "echo hi; exit 3"}).observation == "hi\n[exit code 3]"
    assert "between 1 and 10" in tools.call("run_command", {"command": "true", "timeout_s": 11}).error
    assert "wall-clock limit" in tools.call("run_command", {"command": "sleep 5", "timeout_s": 1}).observation
    big = tools.call("run_command", {"command": "seq 1 10000"}).observation
    assert len(big) < 500 and "characters truncated" in big and big.endswith("10000\n[exit code 0]")
    assert tools.call("todo", {"action": "add", "item": "write tests"}).observation == "1. [ ] write tests"
    tools.call("todo", {"action": "add", "item": "run them"})
    assert tools.unfinished_todos == 2
    assert tools.call("todo", {"action": "complete", "id": 1}).observation == "1. [x] write tests\n2. [ ] run them"
    assert "no item 7" in tools.call("todo", {"action": "complete", "id": 7}).error
    assert "takes the 'id'" in tools.call("todo", {"action": "complete", "item": "run them"}).error
    assert tools.unfinished_todos == 1
    assert "message is empty" in tools.call("finish", {"message": "  "}).error and tools.finished is None
    assert tools.call("finish", json.dumps({"message": "done"})).observation == "finished"
    assert tools.finished == "done" and tools.invalid_calls == 4
