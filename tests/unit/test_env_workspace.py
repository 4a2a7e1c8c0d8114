"""Host-side robustness (issue 23): whatever the agent leaves in its workspace (FIFOs, 1500-deep trees, huge
files, files made to slow diffs down) cannot block, crash or stall the trainer, and a grading it breaks scores the
episode wrong instead of failing the run."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.demo import ORACLE, make_task
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.sandbox import PREFIX, BubblewrapConfig, BubblewrapSandbox, Limits
from megatron_ext.env.tasks import load_task
from megatron_ext.env.tools import Toolbox
from megatron_ext.env.workspace import WalkLimits, WorkspaceError, changed_paths, copy_tree, diff_lines, \
    remove_tree, snapshot

LIMITS = Limits(cpu_s=30, wall_s=60.0, memory_bytes=1 << 30, processes=64, disk_bytes=256 << 20, cpus=2.0)


def deep_tree(root: str, depth: int, name: str = "d") -> str:
    """depth nested folders under root, made without recursion or long paths (os.makedirs recurses)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("bottom\n")
    os.close(fd)
    return root


@pytest.fixture
def task(tmp_path):
    return load_task(make_task(str(tmp_path / "task")))


def config(tmp_path) -> EpisodeConfig:
    return EpisodeConfig(sandbox=BubblewrapConfig(limits=LIMITS, base_dir=str(tmp_path / "boxes")))


def test_tools_refuse_fifos_without_blocking(tmp_path, task):
    with BubblewrapSandbox(task.repo, BubblewrapConfig(limits=LIMITS, base_dir=str(tmp_path / "b"))) as box:
        assert box.exec("mkfifo pipe && python -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"sock\")'").ok
        tools, records = Toolbox(box), []
        calls = [("read_file", {"path": "pipe"}), ("edit_file", {"path": "pipe", "old_text": "a", "new_text": "b"}),
                 ("write_file", {"path": "pipe", "content": "x"}), ("read_file", {"path": "sock"}),
                 ("read_file", {"path": "/dev/zero"})]
        worker = threading.Thread(target=lambda: records.extend(tools.call(n, a) for n, a in calls), daemon=True)
        worker.start()
        worker.join(20)
        if worker.is_alive():  # unblock the host thread before failing
            os.close(os.open(os.path.join(box.workspace, "pipe"), os.O_WRONLY | os.O_NONBLOCK))
        assert not worker.is_alive(), "a tool call blocked on a FIFO"
    errors = [r.error for r in records]
    assert all(e is not None for e in errors), [r.observation for r in records]
    assert "pipe: a FIFO (named pipe), not a regular file" in errors[0] and "FIFO" in errors[1]
    assert "pipe: cannot write" in errors[2] or "FIFO" in errors[2]
    assert "sock: a socket, not a regular file" in errors[3] or "sock: cannot open" in errors[3]
    assert "outside the workspace" in errors[4]


def test_read_file_refuses_files_over_the_read_cap(tmp_path, task):
    with BubblewrapSandbox(task.repo, BubblewrapConfig(limits=LIMITS, base_dir=str(tmp_path / "b"))) as box:
        box.exec("head -c 200000 /dev/zero | tr '\\0' 'a' > big.txt")
        from megatron_ext.env.tools import ToolLimits
        record = Toolbox(box, ToolLimits(read_bytes=100_000)).call("read_file", {"path": "big.txt"})
    assert "big.txt: 200000 bytes, more than the 100000 this tool reads" in record.error


def test_fifo_in_the_workspace_does_not_break_grading(tmp_path, task):
    agent = ScriptAgent([{"name": "run_command", "arguments": {"command": "mkfifo calc/pipe tests_pipe"}}] + ORACLE)
    result = run_episode(task, agent, config(tmp_path))
    assert result.reward["correctness"] == 1.0, result.grading["output"]  # graded normally, the FIFO left out
    assert "calc/pipe" in result.grading["changed_files"]
    assert os.listdir(tmp_path / "boxes") == []


DEEP = ("python -c \"import os\nfor _ in range(1500):\n    os.mkdir('d'); os.chdir('d')\nopen('leaf', 'w').write('x')\"")


def test_a_1500_deep_tree_scores_wrong_and_breaks_nothing(tmp_path, task):
    agent = ScriptAgent([{"name": "run_command", "arguments": {"command": DEEP}}] + ORACLE)
    result = run_episode(task, agent, config(tmp_path))  # used to raise RecursionError: "could not run"
    assert result.reward["correctness"] == 0.0 and result.status == "finished"
    assert "nested deeper than" in result.grading["output"]
    assert os.listdir(tmp_path / "boxes") == []  # removed
    honest = run_episode(task, ScriptAgent(ORACLE), config(tmp_path))  # the next episode in that base dir
    assert honest.reward["correctness"] == 1.0


def test_stale_sandbox_folders_of_any_depth_are_swept(tmp_path):
    base = tmp_path / "boxes"
    base.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = base / f"{PREFIX}{dead.pid}-crashed"
    stale.mkdir()
    deep_tree(str(stale), 1500, name="a-long-folder-name")  # 28k characters: past PATH_MAX too
    with BubblewrapSandbox(None, BubblewrapConfig(limits=LIMITS, base_dir=str(base))) as box:
        assert box.exec("echo fresh").output == "fresh\n"
        assert not stale.exists()


def test_remove_and_copy_trees_without_recursion(tmp_path):
    deep_tree(str(tmp_path), 1500)
    with pytest.raises(WorkspaceError, match="nested deeper than 64"):
        snapshot(str(tmp_path))
    dest = tmp_path.parent / "copy"
    dest.mkdir()
    copy_tree(str(tmp_path), str(dest), WalkLimits(max_depth=2000, max_entries=10_000))
    assert (dest / "/".join(["d"] * 1500) / "leaf").read_text() == "bottom\n"
    remove_tree(str(dest))
    remove_tree(str(tmp_path / "d"))
    assert not dest.exists() and os.listdir(tmp_path) == []


def test_snapshots_hash_big_files_and_record_special_ones(tmp_path):
    (tmp_path / "small.py").write_text("x = 1\n")
    (tmp_path / "big.bin").write_bytes(b"a" * 5000)
    os.mkfifo(tmp_path / "pipe")
    limits = WalkLimits(max_file_bytes=1000)
    before = snapshot(str(tmp_path), limits)
    assert before["small.py"] == ("file", b"x = 1\n") and before["big.bin"][:2] == ("big", 5000)
    assert before["pipe"] == ("special", "fifo")
    full = snapshot(str(tmp_path), WalkLimits(max_file_bytes=None))
    assert changed_paths(full, before) == []  # held and hashed copies of one content compare equal
    (tmp_path / "big.bin").write_bytes(b"a" * 4999 + b"b")
    assert changed_paths(full, snapshot(str(tmp_path), limits)) == ["big.bin"]
    with pytest.raises(WorkspaceError, match="more than 2 entries"):
        snapshot(str(tmp_path), WalkLimits(max_entries=2))


def test_diff_lines_is_bounded_in_time():
    assert diff_lines("a\nb\nc\n", "a\nx\nc\nd\n") == 3  # difflib's count where matching is cheap
    old, new = "\n" * 150_000 + "a\n", "b\n" + "\n" * 300_000
    start = time.monotonic()
    assert diff_lines(old, new) == 150_002  # difflib took 120 s for a tenth of this
    assert diff_lines("", "\n" * 300_000) == 300_000
    assert time.monotonic() - start < 3.0


def test_a_workspace_filled_to_its_disk_limit_scores_wrong(tmp_path, task):
    small = EpisodeConfig(sandbox=BubblewrapConfig(limits=Limits(cpu_s=30, wall_s=60.0, memory_bytes=1 << 30,
                                                                 processes=64, disk_bytes=8 << 20),
                                                   base_dir=str(tmp_path / "boxes")))
    fill = {"name": "run_command", "arguments": {"command": "head -c 20000000 /dev/zero > fill; df -k ."}}
    result = run_episode(task, ScriptAgent(ORACLE[:-1] + [fill]), small)  # used to fail with OSError: not counted
    assert result.reward["correctness"] == 0.0
    assert "No space left on device" in result.grading["output"], result.grading["output"]
    assert os.listdir(tmp_path / "boxes") == []


def test_snapshots_hold_at_most_max_held_bytes(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 1000)
    shot = snapshot(str(tmp_path), WalkLimits(max_held_bytes=2500))
    assert [shot[f"f{i}"][0] for i in range(5)] == ["file", "file", "big", "big", "big"]
