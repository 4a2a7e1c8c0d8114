"""tools/run_eval.py with scripted agents on a tiny suite: the oracle scores 100 %, a no-op 0 %, a flaky agent
gets the hand-computed intervals; a run killed with SIGKILL resumes without redoing finished episodes; the report
renders in a real headless browser with every figure loaded; --compare names the tests and their p-values."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_ext.env.agents import AgentError, ScriptAgent
from megatron_ext.env.demo import ORACLE
from megatron_ext.env.episode import EpisodeConfig
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.tasks import TaskError
from megatron_ext.eval.agents import make_factory
from megatron_ext.eval.harness import RunDir, RunError, run_suite
from megatron_ext.eval.outputs import publish
from megatron_ext.eval.tasks import load_suite
from megatron_ext.eval.usage import Prices
from tests.unit.eval_fixtures import ROOT, chromium_image_sizes, make_suite, oracle_dir, run_eval_main, script_dir

RUN_EVAL = os.path.join(ROOT, "tools", "run_eval.py")
ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _config(tmp):
    os.makedirs(os.path.join(tmp, "boxes"), exist_ok=True)
    return EpisodeConfig(sandbox=BubblewrapConfig(base_dir=os.path.join(tmp, "boxes")))


def _cli(*argv, timeout=600):
    return subprocess.run([sys.executable, RUN_EVAL, *argv], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two-task suite, two passes: the oracle through the CLI (with prices), the no-op through the API."""
    root = str(tmp_path_factory.mktemp("eval"))
    suite = make_suite(root)
    oracle = _cli("--tasks", suite, "--agent", f"script:{oracle_dir(root)}", "--passes", "2", "--concurrency", "2",
                  "--out", os.path.join(root, "oracle_run"), "--price-input", "2", "--price-output", "8",
                  "--env-sandbox-dir", root)
    assert oracle.returncode == 0, oracle.stderr[-3000:]
    tasks = load_suite(suite)
    noop = RunDir(os.path.join(root, "noop_run"))
    noop.start({"suite_spec": suite, "agent": "script:noop", "model": None, "task_ids": [t.id for t in tasks],
                "passes": 2})
    factory = make_factory(f"script:{script_dir(root, 'noop', {})}", tasks)
    outcome = run_suite(tasks, factory, noop, 2, 2, _config(root), log=lambda line: None)
    assert outcome == {"ran": 4, "skipped": 0, "failed": []}
    publish(noop, tasks, 2, Prices(), "estimate: 4 bytes a token")
    return {"root": root, "suite": suite, "tasks": tasks, "oracle": oracle}


def _summary(run_dir):
    return json.load(open(os.path.join(run_dir, "summary.json")))


def test_oracle_scores_one_with_every_metric(runs):
    run_dir = os.path.join(runs["root"], "oracle_run")
    s = _summary(run_dir)
    assert s["accuracy"] == 1.0 and s["accuracy_ci"] == [1.0, 1.0] and s["complete"]
    assert s["pass_at_k"] == {"1": 1.0, "2": 1.0} and s["best_of_k"]["accuracy"] == 1.0
    assert s["accuracy_wilson"] == pytest.approx([0.510109, 1.0], abs=1e-5)  # 4 of 4: z^2 / (n + z^2) below 1
    assert set(s["per_task"]) == {"add-a", "add-b"} and s["per_task"]["add-a"]["correct"] == [1, 1]
    # the oracle replaces one line: one removed + one added; references state 2 and 6 lines
    assert s["code_quality"]["diff_lines"] == 2.0 and s["code_quality"]["style"] == 0.0
    assert s["per_task"]["add-b"]["code_quality"]["diff_to_reference"] == pytest.approx(2 / 6)
    assert s["code_quality"]["diff_to_reference_median"] == pytest.approx((1 + 2 / 6) / 2)
    assert s["suite"]["median_reference_diff_lines"] == 4.0 and s["suite"]["cursorbench"] == {
        "median_reference_diff_lines": 181, "median_instruction_chars": 390}
    assert s["interaction"]["communication"] == 1.0 and s["interaction"]["invalid_calls"] == 0.0
    eff = s["efficiency"]
    assert eff["tool_calls"] == len(ORACLE) and eff["turns"] == len(ORACLE)
    assert eff["total_steps"] == eff["critical_steps"] == len(ORACLE) and "swarm" not in s  # a single agent
    assert eff["output_tokens"] == eff["tool_call_tokens"] > 0 and eff["cached_input_tokens"] > eff["input_tokens"]
    assert eff["cost"] == pytest.approx((2 * (eff["input_tokens"] + eff["cached_input_tokens"]) +
                                         8 * eff["output_tokens"]) / 1e6)
    assert eff["cost_total"] == pytest.approx(4 * eff["cost"])
    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "episodes.jsonl"))]
    assert [(e["task"], e["pass"]) for e in episodes] == [("add-a", 0), ("add-a", 1), ("add-b", 0), ("add-b", 1)]
    e = episodes[0]
    assert e["reward"]["correctness"] == 1.0 and "4 passed" in e["grading"]["output"]
    assert [c["name"] for c in e["tool_calls"]] == [a["name"] for a in ORACLE]
    assert e["transcript"][-1]["content"] == "finished"
    assert e["usage"]["output_tokens"] == e["counts"]["tool_call_tokens"]
    out = runs["oracle"]
    assert "[4/4]" in out.stderr and "accuracy so far 1.000" in out.stderr and "accuracy 1.000" in out.stdout
    md = open(os.path.join(run_dir, "report.md")).read()
    assert "| accuracy | 1.000 | [1.000, 1.000] (95% percentile bootstrap over tasks" in md
    assert "| median changed lines of the reference solution | 4.0 | 181 |" in md
    for name in ("accuracy", "pareto", "heatmap"):
        assert f"(report_figures/{name}.png)" in md
        assert open(os.path.join(run_dir, "report_figures", f"{name}.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_noop_scores_zero(runs):
    s = _summary(os.path.join(runs["root"], "noop_run"))
    assert s["accuracy"] == 0.0 and s["accuracy_ci"] == [0.0, 0.0] and s["pass_at_k"]["2"] == 0.0
    assert s["best_of_k"]["accuracy"] == 0.0 and s["code_quality"]["diff_lines"] == 0.0
    # changed nothing: no communication reward (issue 23)
    assert s["efficiency"]["tool_calls"] == 1.0 and s["interaction"]["communication"] == 0.0
    assert s["prices_per_million_tokens"] is None and s["efficiency"]["cost"] == 0.0


def test_flaky_agent_gets_the_hand_computed_intervals(runs, tmp_path):
    """add-a is solved on pass 0 only, add-b on both passes: task accuracies 0.5 and 1."""
    tasks = runs["tasks"]
    factory = lambda task, k: ScriptAgent(ORACLE if task.id == "add-b" or k == 0 else [])  # noqa: E731
    run = RunDir(str(tmp_path / "flaky"))
    run.start({"suite_spec": "x", "agent": "flaky", "model": None, "task_ids": [t.id for t in tasks], "passes": 2})
    run_suite(tasks, factory, run, 2, 1, _config(str(tmp_path)), log=lambda line: None)
    s = publish(run, tasks, 2, Prices(), "estimate")
    assert s["accuracy"] == 0.75
    assert s["accuracy_ci"] == [0.5, 1.0]  # bootstrap over two tasks: their range (see test_eval_stats)
    assert s["accuracy_wilson"] == pytest.approx([0.300643, 0.954415], abs=1e-5)  # 3 of 4 episodes
    assert s["per_task"]["add-a"]["accuracy_ci"] == pytest.approx([0.094531, 0.905469], abs=1e-5)  # 1 of 2
    assert s["per_task"]["add-a"]["correct"] == [1, 0] and s["per_task"]["add-b"]["correct"] == [1, 1]
    assert s["pass_at_k"] == {"1": 0.75, "2": 1.0} and s["best_of_k"]["accuracy"] == 1.0
    assert s["per_task"]["add-a"]["best_reward"] > s["per_task"]["add-a"]["reward"]


def test_killed_run_resumes_without_redoing_finished_episodes(tmp_path, capsys):
    root = str(tmp_path)
    suite = make_suite(root, ids=("add-a", "add-b", "add-c"))
    slow = [{"name": "run_command", "arguments": {"command": "sleep 1"}}] + ORACLE
    agents = script_dir(root, "slow", {i: slow for i in ("add-a", "add-b", "add-c")})
    out = os.path.join(root, "run")
    argv = [sys.executable, RUN_EVAL, "--tasks", suite, "--agent", f"script:{agents}", "--passes", "1",
            "--out", out, "--env-sandbox-dir", root]
    log = open(os.path.join(root, "first.log"), "w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    episodes = os.path.join(out, "episodes")
    deadline = time.monotonic() + 300
    finished = []
    while time.monotonic() < deadline and process.poll() is None:
        finished = [os.path.join(b, f) for b, _, fs in os.walk(episodes) for f in fs if f.endswith(".json")] \
            if os.path.isdir(episodes) else []
        if finished:
            break
        time.sleep(0.1)
    assert process.poll() is None, open(os.path.join(root, "first.log")).read()[-3000:]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    finished = sorted(p for b, _, fs in os.walk(episodes) for p in (os.path.join(b, f) for f in fs)
                      if p.endswith(".json"))
    assert 1 <= len(finished) < 3 and not os.path.exists(os.path.join(out, "summary.json"))
    before = {p: (os.stat(p).st_mtime_ns, open(p).read()) for p in finished}
    main = run_eval_main()
    assert main(["--tasks", suite, "--agent", f"script:{agents}", "--passes", "1", "--out", out,
                 "--env-sandbox-dir", root]) == 0
    err = capsys.readouterr().err
    assert f"{len(finished)} of 3 episodes already finished, {3 - len(finished)} to run" in err
    assert {p: (os.stat(p).st_mtime_ns, open(p).read()) for p in finished} == before  # not redone
    s = _summary(out)
    assert s["complete"] and s["episodes"] == 3 and s["accuracy"] == 1.0
    assert not [f for b, _, fs in os.walk(out) for f in fs if f.endswith(".tmp")]
    # more passes on the same run: only the new ones run
    assert main(["--tasks", suite, "--agent", f"script:{agents}", "--passes", "2", "--out", out,
                 "--env-sandbox-dir", root, "--concurrency", "3"]) == 0
    assert "3 of 6 episodes already finished, 3 to run" in capsys.readouterr().err
    assert _summary(out)["pass_at_k"] == {"1": 1.0, "2": 1.0}
    # another agent in the same directory is refused before anything runs
    with pytest.raises(RunError, match="holds a run with another agent"):
        RunDir(out).start({**json.load(open(os.path.join(out, "run.json"))), "agent": f"script:{root}"})


def test_resume_with_other_sampling_is_refused(tmp_path, capsys):
    """run.json pins the sampling temperature and tokens per turn: more passes at another temperature would mix
    two policies' samples in one accuracy. A run recorded before the pin (no "sampling") still resumes."""
    root = str(tmp_path)
    suite, oracle = make_suite(root, ids=("add-a",)), oracle_dir(root, ids=("add-a",))
    out = os.path.join(root, "run")
    main = run_eval_main()
    base = ["--tasks", suite, "--agent", f"script:{oracle}", "--out", out, "--env-sandbox-dir", root]
    assert main(base + ["--temperature", "0.7", "--max-tokens", "64"]) == 0
    manifest = json.load(open(os.path.join(out, "run.json")))
    assert manifest["sampling"] == {"temperature": 0.7, "max_tokens": 64}
    capsys.readouterr()
    for other in (["--temperature", "1.0", "--max-tokens", "64"], ["--temperature", "0.7", "--max-tokens", "65"]):
        assert main(base + other + ["--passes", "2"]) == 2
        assert "holds a run with another sampling ({'temperature': 0.7, 'max_tokens': 64})" in capsys.readouterr().err
    assert _summary(out)["episodes"] == 1  # nothing ran
    assert main(base + ["--temperature", "0.7", "--max-tokens", "64", "--passes", "2"]) == 0
    assert _summary(out)["episodes"] == 2
    del manifest["sampling"]  # as written before the pin
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump(manifest, f)
    assert main(base + ["--temperature", "1.0", "--passes", "2"]) == 0


def test_unreachable_endpoint_stores_nothing_and_is_retried(runs, tmp_path):
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tasks = runs["tasks"][:1]
    run = RunDir(str(tmp_path / "down"))
    factory = make_factory(f"endpoint:http://127.0.0.1:{port}", tasks, timeout_s=5)
    lines = []
    outcome = run_suite(tasks, factory, run, 2, 2, _config(str(tmp_path)), log=lines.append)
    assert outcome["ran"] == 0 and len(outcome["failed"]) == 2 and "Connection refused" in outcome["failed"][0][2]
    assert run.records(tasks, 2) == [] and "retried when the run is resumed" in lines[0]
    summary = publish(run, tasks, 2, Prices(), "estimate")  # an empty run still gets a summary and a report
    assert summary["accuracy"] is None and summary["episodes"] == 0 and not summary["complete"]
    assert "| episodes | 0 | 0 of 1 tasks x 2 passes; complete: no |" in open(run.root + "/report.md").read()


def test_bad_inputs_are_named(tmp_path, capsys):
    suite = make_suite(str(tmp_path))
    tasks = load_suite(suite)
    with pytest.raises(TaskError, match="no such file or directory"):
        load_suite(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="holds no"):
        load_suite(str(tmp_path / "empty"))
    assert [t.id for t in load_suite(os.path.dirname(suite))] == ["add-a", "add-b"]  # a directory of task files
    shutil.copy(suite, tmp_path / "suite" / "again.jsonl")
    with pytest.raises(TaskError, match="appears in"):
        load_suite(os.path.dirname(suite))
    with pytest.raises(TaskError, match="built-in suites|builtin:nope"):
        load_suite("builtin:nope")
    stray = script_dir(str(tmp_path), "stray", {"add-z": ORACLE})
    with pytest.raises(AgentError, match="none of its files names a task"):
        make_factory(f"script:{stray}", tasks)
    with pytest.raises(AgentError, match="expected script:DIR"):
        make_factory("robot:x", tasks)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(RunError, match="not an evaluation run"):
        RunDir(str(tmp_path / "full")).start({"agent": "a", "model": None, "task_ids": [], "passes": 1})
    main = run_eval_main()
    assert main(["--tasks", suite, "--agent", f"script:{tmp_path}", "--out", str(tmp_path / "r"), "--passes", "0"]) == 2
    assert "--passes must be >= 1" in capsys.readouterr().err
    assert main(["--tasks", suite, "--agent", "endpoint:http://x", "--out", str(tmp_path / "full")]) == 2
    assert "exists and is not an evaluation run" in capsys.readouterr().err
    assert main(["--compare", str(tmp_path / "full"), str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
def test_report_and_comparison_render_in_a_browser(runs, capsys):
    root = runs["root"]
    sizes = {i["id"]: (i["w"], i["h"]) for i in chromium_image_sizes(os.path.join(root, "oracle_run", "report.html"))}
    assert sizes.pop("broken-control") == (0, 0)
    assert set(sizes) == {"fig-accuracy", "fig-pareto", "fig-heatmap"} and all(w > 200 and h > 100
                                                                                for w, h in sizes.values())
    out = os.path.join(root, "cmp")
    assert run_eval_main()(["--compare", os.path.join(root, "oracle_run"), os.path.join(root, "noop_run"),
                            "--out", out]) == 0
    printed = capsys.readouterr().out
    pair = json.load(open(os.path.join(out, "compare.json")))["against_baseline"]["noop_run"]
    assert pair["difference"] == -1.0 and pair["p"] == 0.5 and not pair["significant"]  # 2 of 4 sign patterns
    assert pair["test"] == "paired sign-flip permutation, exact (4 sign patterns)"
    assert pair["per_task"]["add-a"]["p"] == pytest.approx(1 / 3)  # Fisher: [[2, 0], [0, 2]]
    assert pair["per_task"]["add-a"]["p_holm"] == pytest.approx(2 / 3)
    assert "| add-a | 1.000 | 0.000 | -1.000 | 0.3333 | 0.6667 |  |" in printed
    sizes = {i["id"]: i["w"] for i in chromium_image_sizes(os.path.join(out, "compare.html"))}
    assert all(sizes[f"fig-{n}"] > 200 for n in ("accuracy", "pareto", "heatmap"))
