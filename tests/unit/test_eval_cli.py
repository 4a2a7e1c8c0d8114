"""tools/run_eval.py as benchmark users run it (issue 28): listing and selecting tasks, FILE.jsonl#ID, script files
that name no task, nothing written before the run starts, fewer --passes than stored, output modes, --max-turns and
--episode-timeout-s, a test command that cannot start, the task JSON Schema and --validate, figure labels."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest

from megatron_ext.env.demo import ORACLE
from megatron_ext.env.tasks import TaskError
from megatron_ext.eval.agents import make_factory
from megatron_ext.eval.tasks import load_suite
from tests.unit.eval_fixtures import (
    ROOT,
    make_suite,
    oracle_dir,
    run_eval_main,
    script_dir,
)


@pytest.fixture
def suite(tmp_path):
    return make_suite(str(tmp_path), ids=("add-a", "add-b", "add-c"))


def _episode_files(out):
    return sorted(os.path.relpath(os.path.join(b, f), out) for b, _, fs in os.walk(os.path.join(out, "episodes"))
                  for f in fs)


def test_list_filter_task_ids_and_one_task_by_id(suite, capsys):
    main = run_eval_main()
    assert main(["--tasks", suite, "--list"]) == 0
    listed = capsys.readouterr()
    assert [line.split("\t")[0] for line in listed.out.splitlines()] == ["add-a", "add-b", "add-c"]
    assert "3 tasks" in listed.err
    assert main(["--tasks", suite, "--list", "--filter", "add-[ab]"]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["add-a", "add-b"]
    assert main(["--tasks", suite, "--list", "--task-ids", "add-c, add-a"]) == 0
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == ["add-a", "add-c"]
    assert main(["--tasks", suite, "--list", "--filter", "nope-*"]) == 2
    assert "--filter 'nope-*' matches no task id" in capsys.readouterr().err
    assert main(["--tasks", suite, "--list", "--task-ids", "add-z"]) == 2
    assert "no task with id ['add-z']" in capsys.readouterr().err
    assert [t.id for t in load_suite(suite + "#add-b")] == ["add-b"]  # run_episode's FILE.jsonl#ID
    with pytest.raises(TaskError, match="has no task with id 'add-q'"):
        load_suite(suite + "#add-q")


def test_script_files_that_name_no_task_are_named(suite, tmp_path, caplog):
    tasks = load_suite(suite)
    folder = script_dir(str(tmp_path), "agents", {"add-a": ORACLE, "add_b": ORACLE})  # a typo: add_b
    os.makedirs(os.path.join(folder, "pkg-1.0:pkg"))
    with open(os.path.join(folder, "pkg-1.0:pkg", "mod.py::fn.json"), "w") as f:  # a mined id's nested file
        json.dump(ORACLE, f)
    with caplog.at_level(logging.WARNING):
        make_factory(f"script:{folder}", tasks)
    assert "2 files name no task of the suite: ['add_b.json', 'pkg-1.0:pkg/mod.py::fn.json']" in caplog.text and "tasks without a file get no actions: ['add-b', 'add-c']" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a selection: the other tasks' files are not strays
        make_factory(f"script:{oracle_dir(str(tmp_path), ids=('add-a', 'add-b'))}", tasks[:1],
                     suite_ids=[t.id for t in tasks])
    assert "name no task" not in caplog.text


def test_failed_start_writes_nothing_and_fewer_passes_keep_the_stored_ones(suite, tmp_path, capsys):
    main = run_eval_main()
    out = str(tmp_path / "run")
    common = ["--tasks", suite, "--task-ids", "add-a", "--out", out, "--env-sandbox-dir", str(tmp_path)]
    assert main([*common, "--agent", f"script:{tmp_path / 'no-such-dir'}", "--passes", "2"]) == 2
    assert "not a directory" in capsys.readouterr().err and not os.path.exists(out)
    agent = f"script:{oracle_dir(str(tmp_path))}"
    old = os.umask(0o027)
    try:
        assert main([*common, "--agent", agent, "--passes", "2"]) == 0  # the corrected re-run is not refused
    finally:
        os.umask(old)
    capsys.readouterr()
    for rel in ("run.json", "summary.json", "report.md", "episodes.jsonl",
                _episode_files(out)[0]):
        assert stat.S_IMODE(os.stat(os.path.join(out, rel)).st_mode) == 0o640, rel  # the umask's, not 0600
    assert main([*common, "--agent", agent, "--passes", "1"]) == 0
    err = capsys.readouterr().err
    assert "holds 2 passes per task; --passes 1 runs no new pass and the summary keeps all 2" in err
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["episodes"] == 2 and summary["accuracy"] == 1.0


def test_max_turns_and_episode_timeout(suite, tmp_path):
    main = run_eval_main()
    slow = [{"name": "run_command", "arguments": {"command": "sleep 2"}}] * 3 + ORACLE
    agent = f"script:{script_dir(str(tmp_path), 'slow', {'add-a': slow, 'add-b': ORACLE})}"
    common = ["--tasks", suite, "--agent", agent, "--env-sandbox-dir", str(tmp_path), "--task-ids", "add-a,add-b"]
    out = str(tmp_path / "limited")
    assert main([*common, "--out", out, "--max-turns", "2", "--episode-timeout-s", "1"]) == 0
    records = {r["task"]: r for r in map(json.loads, open(os.path.join(out, "episodes.jsonl")))}
    assert records["add-a"]["status"] == "episode_timeout" and len(records["add-a"]["tool_calls"]) == 1
    assert records["add-b"]["status"] == "max_turns" and len(records["add-b"]["tool_calls"]) == 2
    assert json.load(open(os.path.join(out, "run.json")))["limits"] == {"max_turns": 2, "episode_timeout_s": 1.0}


def test_a_test_command_that_cannot_start_is_reported_not_graded_wrong(suite, tmp_path, capsys):
    broken = tmp_path / "suite" / "broken.jsonl"
    record = json.loads(open(suite).readline())
    broken.write_text(json.dumps({**record, "id": "no-runner", "test_command": "no-such-runner-xyz -q"}) + "\n")
    out = str(tmp_path / "run")
    assert run_eval_main()(["--tasks", str(broken), "--agent", f"script:{oracle_dir(str(tmp_path), ('no-runner',))}",
                            "--out", out, "--env-sandbox-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "task no-runner: its test_command could not be started (exit 127" in err
    assert "command: no-such-runner-xyz -q" in err and _episode_files(out) == []


def test_task_schema_matches_the_loader_and_validate_names_every_problem(suite, tmp_path, capsys):
    from megatron_ext.env import tasks as env_tasks
    from megatron_ext.eval.schema import TASK_SCHEMA

    assert json.load(open(os.path.join(ROOT, "docs", "task.schema.json"))) == TASK_SCHEMA  # the published copy
    assert set(TASK_SCHEMA["properties"]) == set(env_tasks._REQUIRED) | set(env_tasks._OPTIONAL)
    assert set(TASK_SCHEMA["required"]) == set(env_tasks._REQUIRED)
    main = run_eval_main()
    assert main(["--validate", suite]) == 0
    assert "3 tasks checked in 1 path(s): all valid" in capsys.readouterr().out
    good = json.loads(open(suite).readline())
    bad = tmp_path / "suite" / "bad.jsonl"
    bad.write_text("\n".join([json.dumps({k: v for k, v in good.items() if k != "test_command"}),
                              json.dumps({**good, "id": "t2", "timeout_s": "soon", "colour": "red"}),
                              "{not json",
                              json.dumps({**good, "id": "t4", "repo": "no/such/repo"})]) + "\n")
    assert main(["--validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"invalid: {bad}:1: (task): 'test_command' is a required property" in err
    assert f"invalid: {bad}:2: timeout_s: 'soon' is not of type 'number'" in err
    assert f"invalid: {bad}:2: (task): Additional properties are not allowed ('colour' was unexpected)" in err
    assert f"invalid: {bad}:3: invalid JSON" in err
    assert f"{bad}:4" not in err  # the loader (paths exist) runs once the schema holds
    bad.write_text(json.dumps({**good, "id": "t4", "repo": "no/such/repo"}) + "\n")
    assert main(["--validate", str(bad)]) == 2
    assert f"{bad}:1: repo" in capsys.readouterr().err


def test_figure_labels_keep_the_distinguishing_part_and_the_legend_hides_nothing():
    from megatron_ext.eval.plots import pareto_figure, short_labels

    ids = ["pkg-1.0:pkg/mod.py::fn_a", "pkg-1.0:pkg/mod.py::fn_b", "pkg-1.0:pkg/other.py::Klass.method_long_name",
           "pkg-1.0:pkg/deep/package/path/to/module.py::fn_a"]
    assert short_labels(["overall", *ids], 30, [True]) == [
        "overall", "mod.py::fn_a", "mod.py::fn_b", "other.py:…ass.method_long_name", "deep/pack…h/to/module.py::fn_a"]
    long = ["x" * 60 + "1", "x" * 60 + "2"]
    cut = short_labels(long, 20)
    assert len(set(cut)) == 2 and all(len(c) <= 20 for c in cut)
    fig = pareto_figure(["overall", *ids], [1.0, 1.0, 1.0, 1.01, 1.0], [1.0, 1.0, 1.0, 1.0, 0.5], "tokens", "t",
                        highlight=[True])
    renderer, ax = fig.canvas.get_renderer(), fig.axes[0]
    assert not ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) == 5 and not any(boxes[i].overlaps(boxes[j]) for i in range(5) for j in range(i))
    frame = ax.get_window_extent(renderer)
    assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for b in boxes)
