"""tools/run_eval.py --agent-mode swarm on the two-part demo task (megatron_ext/env/demo.py): a scripted orchestrator
that splits it between two scripted sub-agents against the serial scripted agent. Same accuracy, fewer critical
steps (6 against 7, hand-counted in test_env_swarm.py) in the summary and the report; --compare shows the
accuracy and the critical-step and wall-clock differences; run.json pins the agent mode for resuming."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_ext.env.demo import TWO_PART_ORCHESTRATOR, TWO_PART_SERIAL, TWO_PART_SUBAGENTS, make_two_part_task
from tests.unit.eval_fixtures import chromium_image_sizes, run_eval_main, script_dir

TASK = "kit-two-part"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("evalswarm"))
    task = make_two_part_task(os.path.join(root, "task"))
    main = run_eval_main()
    common = ["--tasks", task, "--env-sandbox-dir", root]
    serial = os.path.join(root, "serial")
    assert main([*common, "--agent", f"script:{script_dir(root, 'serial_agent', {TASK: TWO_PART_SERIAL})}",
                 "--out", serial]) == 0
    swarm = os.path.join(root, "swarm")
    swarm_argv = [*common, "--agent-mode", "swarm",
                  "--agent", f"script:{script_dir(root, 'orchestrator', {TASK: TWO_PART_ORCHESTRATOR})}",
                  "--swarm-subagent-policy", f"script:{script_dir(root, 'subagents', {TASK: TWO_PART_SUBAGENTS})}",
                  "--swarm-max-subagents", "2", "--out", swarm]
    assert main(swarm_argv) == 0
    return {"root": root, "serial": serial, "swarm": swarm, "swarm_argv": swarm_argv, "common": common, "main": main}


def _summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def test_swarm_run_reports_fewer_critical_steps_for_the_same_accuracy(two_runs):
    serial, swarm = _summary(two_runs["serial"]), _summary(two_runs["swarm"])
    assert serial["accuracy"] == swarm["accuracy"] == 1.0
    assert serial["agent_mode"] == "single" and swarm["agent_mode"] == "swarm"
    assert swarm["swarm_setup"]["max_subagents"] == 2 and swarm["swarm_setup"]["subagent_policy"].startswith("script:")
    # serial: 7 turns, one stage; swarm: stages (1 + 4) + (1 + 0), 2 orchestrator turns + 2 x 4 sub-agent steps
    assert (serial["efficiency"]["total_steps"], serial["efficiency"]["critical_steps"]) == (7.0, 7.0)
    assert (swarm["efficiency"]["total_steps"], swarm["efficiency"]["critical_steps"]) == (10.0, 6.0)
    assert swarm["efficiency"]["turns"] == 2.0 and swarm["efficiency"]["wall_s"] > 0
    t = swarm["per_task"][TASK]
    assert t["efficiency"]["critical_steps"] == 6.0 and t["efficiency"]["wall_s"] > 0
    assert t["swarm"]["subagents_assigned"] == 2.0 and t["swarm"]["finished"] == 2.0 and t["swarm"]["merges"] == 2.0
    assert swarm["swarm"]["peak_concurrency"] >= 1 and "swarm" not in serial
    # the mean reward is the task reward, without the PARL shaping terms
    [record] = [json.loads(line) for line in open(os.path.join(two_runs["swarm"], "episodes.jsonl"))]
    assert swarm["reward"] == pytest.approx(record["reward"]["r_task"]) != record["reward"]["total"]
    # tokens: the orchestrator's plus both sub-agents' (each with the tools it was allowed)
    roles = record["usage_by_role"]
    assert roles["subagents"]["output_tokens"] > 0 and roles["orchestrator"]["output_tokens"] > 0
    assert record["usage"]["output_tokens"] == roles["orchestrator"]["output_tokens"] + \
        roles["subagents"]["output_tokens"]
    assert record["subagents"][1]["tools"] == ["read_file", "edit_file", "run_command", "finish"]
    md = open(os.path.join(two_runs["swarm"], "report.md")).read()
    assert "| critical steps (per stage: orchestrator turns + longest sub-agent) | 6.00 |" in md
    assert "| total steps (every model turn, sub-agents included) | 10.00 |" in md
    assert "## Agent swarm (means per episode)" in md and "| subagents assigned | 2.00 |" in md
    assert f"| {TASK} | 1 | 1.000 |" in md and "| 10.0 | 6.0 |" in md


def test_resume_is_pinned_to_the_agent_mode(two_runs, capsys):
    main = two_runs["main"]
    assert main(two_runs["swarm_argv"]) == 0
    assert "1 of 1 episodes already finished, 0 to run" in capsys.readouterr().err
    manifest = json.load(open(os.path.join(two_runs["swarm"], "run.json")))
    assert manifest["agent_mode"] == "swarm" and manifest["swarm"]["max_subagents"] == 2
    argv = list(two_runs["swarm_argv"])
    argv[argv.index("--swarm-max-subagents") + 1] = "3"
    assert main(argv) == 2
    assert "holds a run with another swarm" in capsys.readouterr().err
    single = [a for a in argv if a not in ("--agent-mode", "swarm")]
    single = single[:single.index("--swarm-subagent-policy")] + single[single.index("--swarm-subagent-policy") + 2:]
    assert main(single) == 2
    assert "holds a run with another agent_mode" in capsys.readouterr().err
    assert main([*two_runs["common"], "--agent", "script:x", "--swarm-subagent-policy", "script:y", "--out",
                 os.path.join(two_runs["root"], "never")]) == 2
    assert "--swarm-subagent-policy needs --agent-mode swarm" in capsys.readouterr().err


def test_compare_swarm_against_single_agent(two_runs, capsys):
    out = os.path.join(two_runs["root"], "cmp")
    assert two_runs["main"](["--compare", two_runs["serial"], two_runs["swarm"], "--out", out]) == 0
    printed = capsys.readouterr().out
    result = json.load(open(os.path.join(out, "compare.json")))
    assert result["runs"]["swarm"]["agent_mode"] == "swarm" and result["runs"]["serial"]["critical_steps"] == 7.0
    pair = result["against_baseline"]["swarm"]
    assert pair["difference"] == 0.0 and pair["accuracy_a"] == pair["accuracy_b"] == 1.0
    eff = pair["efficiency"]
    assert eff["critical_steps"]["a"] == 7.0 and eff["critical_steps"]["b"] == 6.0
    assert eff["critical_steps"]["difference"] == -1.0 and eff["critical_steps"]["ratio"] == pytest.approx(6 / 7)
    assert eff["total_steps"]["difference"] == 3.0 and eff["wall_s"]["a"] > 0 and eff["wall_s"]["b"] > 0
    assert pair["per_task"][TASK]["critical_steps_a"] == 7.0 and pair["per_task"][TASK]["critical_steps_b"] == 6.0
    assert "| critical steps | 7.00 | 6.00 | -1.00 | 0.857 |" in printed
    assert "| 7.0 -> 6.0 |" in printed and "| swarm |" in printed


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
def test_swarm_report_and_comparison_render_in_a_browser(two_runs):
    out = os.path.join(two_runs["root"], "cmp-render")
    assert two_runs["main"](["--compare", two_runs["serial"], two_runs["swarm"], "--out", out]) == 0
    for page in (os.path.join(two_runs["swarm"], "report.html"), os.path.join(out, "compare.html")):
        sizes = {i["id"]: (i["w"], i["h"]) for i in chromium_image_sizes(page)}
        assert sizes.pop("broken-control") == (0, 0)
        assert set(sizes) == {"fig-accuracy", "fig-pareto", "fig-heatmap"}
        assert all(w > 200 and h > 100 for w, h in sizes.values())


def test_unreachable_subagent_server_stores_nothing(two_runs, tmp_path):
    """Sub-agents whose server refuses connections say nothing about the orchestrator: the episode is not stored
    and is retried on resume, as with an unreachable orchestrator."""
    import socket

    from megatron_ext.env.episode import EpisodeConfig
    from megatron_ext.env.sandbox import BubblewrapConfig
    from megatron_ext.env.swarm import SwarmConfig
    from megatron_ext.env.tasks import load_task
    from megatron_ext.eval.agents import make_factory, swarm_setup
    from megatron_ext.eval.harness import RunDir, run_suite

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    task = load_task(os.path.join(two_runs["root"], "task", "task.json"))
    factory = make_factory(f"script:{os.path.join(two_runs['root'], 'orchestrator')}", [task])
    setup = swarm_setup(f"endpoint:http://127.0.0.1:{port}", [task], SwarmConfig(max_subagents=2), timeout_s=5)
    run, lines = RunDir(str(tmp_path / "run")), []
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path)))
    outcome = run_suite([task], factory, run, 1, 1, config, log=lines.append, swarm=setup)
    assert outcome["ran"] == 0 and len(outcome["failed"]) == 1 and "Connection refused" in outcome["failed"][0][2]
    assert run.records([task], 1) == [] and "retried when the run is resumed" in lines[0]
