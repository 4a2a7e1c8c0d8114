"""benchmarks/rl_task_count.py (issue 26): held-out success per number of RL tasks, from run_eval summaries."""

import json

import pytest

from tests.unit.data_fixtures import load_tool


def _summary(path, per_task):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({"per_task": {t: {"correct": c} for t, c in per_task.items()}}))
    return str(path)


def test_points_pool_the_sets_at_shared_task_counts_and_test_against_the_start(tmp_path, capsys):
    bench = load_tool("rl_task_count", "benchmarks")
    tasks = [f"t{i}" for i in range(12)]
    a0 = _summary(tmp_path / "a0", {t: [False, False] for t in tasks})
    a1 = _summary(tmp_path / "a1", {t: [True, False] for t in tasks})
    a2 = _summary(tmp_path / "a2", {t: [True, True] for t in tasks})
    b0 = _summary(tmp_path / "b0", {"u0": [True, True, False, False], "u1": [False] * 4})
    b2 = _summary(tmp_path / "b2", {"u0": [True] * 4, "u1": [False] * 4})
    out = tmp_path / "fig.png"
    assert bench.main(["--out", str(out), "--eval", "A", f"0={a0}", f"320={a1}", f"640={a2}",
                       "--eval", "B", f"0={b0}", f"640={b2}"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    got = {(r[0][2:], int(r[1])): (int(r[2]), float(r[3]), r[5]) for r in rows}
    passk = {(r[0][2:], int(r[1])): float(r[6].rstrip(" |")) for r in rows}
    assert got[("A", 0)][:2] == (12, 0.0) and got[("A", 0)][2] == "-"
    assert got[("A", 320)][1] == 0.5 and float(got[("A", 320)][2]) < 0.01  # 12 tasks all up by 0.5: exact p
    assert got[("B", 640)][1] == 0.5 and float(got[("B", 640)][2]) == 1.0  # one task up: both signs reach it
    # pooled only at 0 and 640 (B has no 320): 14 tasks, per-task means
    assert ("all sets", 320) not in got
    assert got[("all sets", 0)][:2] == (14, pytest.approx((0.5 + 0) / 14, abs=1e-3))
    assert got[("all sets", 640)][:2] == (14, pytest.approx(13 / 14, abs=1e-3))
    assert passk[("A", 0)] == 0 and passk[("A", 320)] == 1 and passk[("B", 0)] == 0.5
    assert passk[("all sets", 640)] == pytest.approx(13 / 14, abs=1e-3)
    assert out.stat().st_size > 1000


def test_bad_series_are_refused(tmp_path):
    bench = load_tool("rl_task_count", "benchmarks")
    d = _summary(tmp_path / "d", {"t": [True]})
    with pytest.raises(SystemExit, match="the first point must be 0=DIR"):
        bench.main(["--eval", "A", f"320={d}"])
    with pytest.raises(SystemExit, match="task counts must increase"):
        bench.main(["--eval", "A", f"0={d}", f"640={d}", f"320={d}"])
    with pytest.raises(SystemExit, match="expected TASKS=DIR"):
        bench.main(["--eval", "A", f"0={d}", d])
    with pytest.raises(SystemExit, match="not a run_eval.py summary"):
        bench.main(["--eval", "A", f"0={tmp_path}"])
