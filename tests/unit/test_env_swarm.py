"""Agent swarm episodes (megatron_ext/env/swarm.py) with scripted orchestrators and sub-agents: splitting a two-part
task between two sub-agents costs fewer critical steps than a serial agent for the same correctness; sub-agents
really overlap in time while the orchestrator goes on; the PARL terms match hand computation across the annealing
schedules; crashes, timeouts, garbled calls and merge conflicts are observations, never a failed episode."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from megatron_ext.env.agents import AgentError, ScriptAgent
from megatron_ext.env.demo import (AREA_BODY, AREA_PART, AREA_STUB, TWO_PART_ORCHESTRATOR, TWO_PART_SERIAL,
                                   TWO_PART_SUBAGENTS, make_two_part_task)
from megatron_ext.env.episode import EpisodeConfig, run_episode
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.swarm import (ParlSchedule, ScriptedPolicy, SwarmConfig, SwarmResult, make_subagent_policy,
                                    parl_reward, run_swarm_episode)
from megatron_ext.env.tasks import load_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup(tmp_path):
    task = load_task(make_two_part_task(str(tmp_path / "task")))
    return task, EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))


def _observations(result) -> list[str]:
    return [m["content"] for m in result.messages if m["role"] == "tool"]


@pytest.fixture(scope="module")
def split_and_serial(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-part")
    task, config = _setup(tmp)
    serial = run_episode(task, ScriptAgent(TWO_PART_SERIAL), config)
    swarm = run_swarm_episode(task, ScriptAgent(TWO_PART_ORCHESTRATOR), ScriptedPolicy(TWO_PART_SUBAGENTS), config,
                              SwarmConfig(max_subagents=4))
    return task, serial, swarm, tmp / "boxes"


def test_split_task_takes_fewer_critical_steps_with_the_same_correctness(split_and_serial):
    task, serial, swarm, boxes = split_and_serial
    assert isinstance(swarm, SwarmResult) and swarm.status == serial.status == "finished"
    for r in (serial, swarm):  # both fully correct: the hidden tests of both parts pass
        assert r.reward["correctness"] == 1.0 and "2 passed" in r.grading["output"]
        assert r.grading["changed_files"] == ["kit/area.py", "kit/shout.py"]
    # serial: one stage of 7 turns. swarm: turn 1 creates, assigns and waits for two 4-step sub-agents, turn 2
    # merges and finishes -> stages (1 + 4) + (1 + 0) = 6
    assert serial.counts["turns"] == len(TWO_PART_SERIAL) == 7
    assert swarm.stages == [[1, 4], [1, 0]] and swarm.critical_steps == 6 < serial.counts["turns"]
    assert swarm.total_steps == 2 + 4 + 4 and swarm.counts["turns"] == 2
    s = swarm.swarm
    assert (s["subagents_created"], s["assignments"], s["finished"], s["failures"], s["timeouts"]) == (2, 2, 2, 0, 0)
    assert s["merges"] == 2 and s["conflicts"] == 0 and s["peak_concurrency"] in (1, 2)
    # each sub-agent played its own script in its own context; its turns reach the orchestrator only as a report
    by_name = {r["name"]: r for r in swarm.subagents}
    assert [c["name"] for c in by_name["geometry"]["tool_calls"]] == [a["name"] for a in AREA_PART] + ["finish"]
    assert by_name["geometry"]["changed_files"] == ["kit/area.py"] and by_name["text"]["changed_files"] == \
        ["kit/shout.py"]
    assert by_name["geometry"]["transcript"][0]["content"].endswith("You implement geometry code.")
    assert all(r["status"] == "finished" and r["steps"] == 4 and r["merged"] for r in swarm.subagents)
    report = _observations(swarm)[4]
    assert "sub-agent geometry: finished after 4 steps" in report and "files changed: kit/area.py" in report
    assert [c["function"]["name"] for m in swarm.messages for c in m.get("tool_calls", [])] == \
        [a["name"] for turn in TWO_PART_ORCHESTRATOR for a in turn]  # the orchestrator's transcript: its own calls
    assert swarm.to_json()["critical_steps"] == 6 and swarm.to_json()["swarm"]["finished"] == 2
    assert os.listdir(boxes) == []  # every sandbox (orchestrator, sub-agents, graders) removed


def test_parl_terms_equal_hand_values_across_the_schedules(split_and_serial):
    _, _, swarm, _ = split_and_serial
    r = swarm.reward
    # 2 of at most 4 sub-agents assigned; both finished their sub-task; lambdas at step 0 are the defaults (0.1)
    assert r["r_parallel"] == 0.5 and r["r_finish"] == 1.0
    assert r["weights"]["r_parallel"] == r["weights"]["r_finish"] == 0.1
    assert r["total"] == pytest.approx(r["r_task"] + 0.1 * 0.5 + 0.1 * 1.0)
    assert r["swarm_critical_steps"] == 6.0 and r["weights"]["swarm_critical_steps"] == 0.0
    linear, cosine = ParlSchedule(0.4, 0.2, 10, "linear"), ParlSchedule(0.4, 0.2, 10, "cosine")
    hand = {0: (0.4, 0.2, 0.4, 0.2), 5: (0.2, 0.1, 0.2, 0.1), 10: (0.0, 0.0, 0.0, 0.0), 25: (0.0, 0.0, 0.0, 0.0),
            2: (0.32, 0.16, 0.4 * (1 + math.cos(math.pi * 0.2)) / 2, 0.2 * (1 + math.cos(math.pi * 0.2)) / 2)}
    base = {k: v for k, v in r.items() if not k.startswith(("r_", "swarm_"))}
    base["total"] = r["r_task"]
    for step, (l1, l2, c1, c2) in hand.items():
        for schedule, (w1, w2) in ((linear, (l1, l2)), (cosine, (c1, c2))):
            lam = schedule.weights(step)
            assert (lam["r_parallel"], lam["r_finish"]) == pytest.approx((w1, w2))
            assert parl_reward(base, 0.5, 1.0, lam)["total"] == pytest.approx(r["r_task"] + w1 * 0.5 + w2 * 1.0)
    assert ParlSchedule(0.3, 0.7, 0).weights(10_000)["r_parallel"] == 0.3  # anneal steps 0: constant
    with pytest.raises(ValueError, match="--swarm-reward-anneal"):
        ParlSchedule(kind="exponential")


class Recorder:
    """A sub-agent policy that sleeps before each turn and records when each of its turns ran."""

    def __init__(self, scripts, delay_s):
        self.inner, self.turns, self.lock = ScriptedPolicy(scripts, delay_s), [], threading.Lock()

    def agent(self, name):
        agent = self.inner.agent(name)
        act = agent.act

        def timed(messages, tools):
            start = time.monotonic()
            out = act(messages, tools)
            with self.lock:
                self.turns.append((name, start, time.monotonic()))
            return out

        agent.act = timed
        return agent

    def close(self):
        pass


class TimedOrchestrator(ScriptAgent):
    def __init__(self, actions):
        super().__init__(actions)
        self.times = []

    def act(self, messages, tools):
        self.times.append(time.monotonic())
        return super().act(messages, tools)


def test_subagents_run_concurrently_while_the_orchestrator_goes_on(tmp_path):
    task, config = _setup(tmp_path)
    todo = [{"name": "todo", "arguments": {"action": "add", "item": "part"}},
            {"name": "todo", "arguments": {"action": "list"}}]
    policy = Recorder({"a": todo, "b": todo}, delay_s=0.8)  # 3 turns of >= 0.8 s each
    orchestrator = TimedOrchestrator([
        [{"name": "create_subagent", "arguments": {"name": n, "instructions": "help"}} for n in "ab"] +
        [{"name": "assign_task", "arguments": {"subagent": n, "task": "note a part"}} for n in "ab"],
        {"name": "todo", "arguments": {"action": "add", "item": "my own work meanwhile"}},
        {"name": "wait", "arguments": {}}])
    result = run_swarm_episode(task, orchestrator, policy, config, SwarmConfig(max_subagents=2))
    spans = {n: (min(s for m, s, _ in policy.turns if m == n), max(e for m, _, e in policy.turns if m == n))
             for n in "ab"}
    overlap = min(spans["a"][1], spans["b"][1]) - max(spans["a"][0], spans["b"][0])
    assert overlap > 0.6 * min(e - s for s, e in spans.values())  # the two really ran at the same time
    # the orchestrator's second turn came while the sub-agents were still working (assign_task did not block)
    assert orchestrator.times[1] < min(e for _, e in spans.values())
    assert result.swarm["peak_concurrency"] == 2 and result.swarm["mean_concurrency"] > 1.5
    busy = sum(r["wall_s"] for r in result.subagents)
    union = max(e for _, e in spans.values()) - min(s for s, _ in spans.values())
    assert busy >= 2 * 3 * 0.8 and union < 0.75 * sum(e - s for s, e in spans.values())  # not one after the other
    assert result.stages == [[3, 3], [1, 0]] and result.critical_steps == 7 and result.total_steps == 4 + 6


class Failing:
    """Sub-agents that break: 'crasher' raises from act, 'sleeper' is slower than its timeout, 'ghost' has no
    policy (agent() raises)."""

    def agent(self, name):
        if name == "ghost":
            raise AgentError("no server for ghost")
        if name == "crasher":
            agent = ScriptAgent([])

            def boom(messages, tools):
                raise RuntimeError("boom")

            agent.act = boom
            return agent
        return ScriptedPolicy({"*": [{"name": "todo", "arguments": {"action": "list"}}] * 5}, 0.7).agent(name)

    def close(self):
        pass


def test_crash_timeout_and_garbled_calls_are_observations_not_failures(tmp_path):
    task, config = _setup(tmp_path)
    create = [{"name": "create_subagent", "arguments": {"name": n, "instructions": "work"}}
              for n in ("crasher", "sleeper", "ghost")]
    orchestrator = ScriptAgent([
        create + [{"name": "create_subagent", "arguments": {"name": "extra", "instructions": "x"}},  # over the max
                  {"name": "create_subagent", "arguments": {"name": "crasher", "instructions": "again"}},
                  {"name": "create_subagent", "arguments": {"name": "bad", "instructions": "x",
                                                            "tools": ["rm_rf"]}}],
        [{"name": "assign_task", "arguments": {"subagent": "crasher", "task": "t"}},
         {"name": "assign_task", "arguments": {"subagent": "sleeper", "task": "t", "timeout_s": 1}},
         {"name": "assign_task", "arguments": {"subagent": "ghost", "task": "t"}},
         {"name": "assign_task", "arguments": {"subagent": "nobody", "task": "t"}},
         {"name": "assign_task", "arguments": "{not json"},
         {"name": "wait", "arguments": {"subagents": "sleeper"}}],
        {"name": "wait", "arguments": {}},
        {"name": "merge", "arguments": {"subagent": "sleeper"}},
        AREA_PART[1]])  # the orchestrator does part of the work itself, then finish
    result = run_swarm_episode(task, orchestrator, Failing(), config, SwarmConfig(max_subagents=3, close_grace_s=5))
    assert result.status == "finished" and result.error is None
    obs = _observations(result)
    assert "at most 3 sub-agents" in obs[3] and "exists" in obs[4] and "unknown tools ['rm_rf']" in obs[5]
    assert "no sub-agent named 'nobody'" in obs[9] and "not valid JSON" in obs[10]
    assert "argument 'subagents' must be array" in obs[11]
    report = obs[12]
    assert "sub-agent crasher: agent_error after 0 steps" in report and "RuntimeError: boom" in report
    assert "sub-agent sleeper: timeout" in report and "wall-clock limit 1 s; no result to merge" in report
    assert "sub-agent ghost: crashed" in report and "no server for ghost" in report
    assert "left no workspace to merge" in obs[13]
    s = result.swarm
    assert (s["assignments"], s["failures"], s["timeouts"], s["finished"]) == (3, 2, 1, 0)
    assert result.reward["r_parallel"] == 1.0 and result.reward["r_finish"] == 0.0  # 3 of 3 assigned, none finished
    assert result.reward["invalid_calls"] == 7.0  # 3 creates, 2 assigns, 1 wait, 1 merge
    assert result.grading["changed_files"] == ["kit/area.py"] and "1 failed, 1 passed" in result.grading["output"]
    assert os.listdir(tmp_path / "boxes") == []


def test_merge_reports_conflicts_and_keeps_the_orchestrators_version(tmp_path):
    task, config = _setup(tmp_path)
    mine = AREA_BODY.replace("w * h", "h * w")
    orchestrator = ScriptAgent([
        [{"name": "create_subagent", "arguments": {"name": "geometry", "instructions": "geometry"}},
         {"name": "assign_task", "arguments": {"subagent": "geometry", "task": "area"}}],
        {"name": "edit_file", "arguments": {"path": "kit/area.py", "old_text": AREA_STUB, "new_text": mine}},
        [{"name": "wait", "arguments": {}}, {"name": "merge", "arguments": {"subagent": "geometry"}}],
        {"name": "read_file", "arguments": {"path": "kit/area.py"}}])
    result = run_swarm_episode(task, orchestrator, ScriptedPolicy(TWO_PART_SUBAGENTS), config)
    obs = _observations(result)
    assert "0 file(s) applied" in obs[4] and "CONFLICT kit/area.py" in obs[4] and "+    return w * h" in obs[4]
    assert "return h * w" in obs[5] and result.swarm["conflicts"] == 1 and result.reward["correctness"] == 0.0


def test_subagent_policy_specs(tmp_path):
    scripts = tmp_path / "scripts.json"
    scripts.write_text(json.dumps({"geometry": AREA_PART}))
    policy = make_subagent_policy(f"script:{scripts}")
    assert policy.agent("geometry").act([{"role": "user", "content": "x"}], [])["tool_calls"][0]["function"][
        "name"] == "read_file"
    with pytest.raises(AgentError, match="no script for sub-agent 'other'"):
        policy.agent("other")
    scripts.write_text(json.dumps({"geometry": [{"tool": "x"}]}))
    with pytest.raises(AgentError, match=r"\['geometry'\]\[0\]"):
        make_subagent_policy(f"script:{scripts}")
    with pytest.raises(AgentError, match="expected script:SCRIPTS.json"):
        make_subagent_policy("pinned")
    with pytest.raises(AgentError, match="not a checkpoint directory"):
        make_subagent_policy(f"local:{tmp_path / 'none'}")


def test_run_episode_runs_a_swarm_from_the_command_line(tmp_path):
    task = make_two_part_task(str(tmp_path / "task"))
    orchestrator, subagents = tmp_path / "orchestrator.json", tmp_path / "subagents.json"
    orchestrator.write_text(json.dumps(TWO_PART_ORCHESTRATOR))
    subagents.write_text(json.dumps(TWO_PART_SUBAGENTS))
    p = subprocess.run([sys.executable, "-W", "ignore", "tools/run_episode.py", "--task", task, "--agent-mode", "swarm",
                        "--agent", f"script:{orchestrator}", "--swarm-subagent-policy", f"script:{subagents}",
                        "--env-sandbox-dir", str(tmp_path / "boxes")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["status"] == "finished" and out["reward"]["correctness"] == 1.0
    assert out["critical_steps"] == 6 and out["total_steps"] == 10 and out["stages"] == [[1, 4], [1, 0]]
    assert [s["name"] for s in out["subagents"]] == ["geometry", "text"]


def test_endpoint_subagents_call_the_server_concurrently(tmp_path):
    """Sub-agents behind an OpenAI-compatible endpoint (env/agents.py's client): two requests in flight at once."""
    import http.server

    state = {"active": 0, "most": 0, "requests": []}
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                state["active"] += 1
                state["most"] = max(state["most"], state["active"])
                state["requests"].append(body)
            time.sleep(0.8)
            with lock:
                state["active"] -= 1
            message = {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.finish:0", "type":
                       "function", "function": {"name": "finish", "arguments": json.dumps({"message": "done"})}}]}
            data = json.dumps({"choices": [{"message": message}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        task, config = _setup(tmp_path)
        policy = make_subagent_policy(f"endpoint:http://127.0.0.1:{server.server_address[1]}", max_tokens=64)
        orchestrator = ScriptAgent([
            [{"name": "create_subagent", "arguments": {"name": n, "instructions": "help", "tools": ["read_file"]}}
             for n in "ab"] + [{"name": "assign_task", "arguments": {"subagent": n, "task": "t"}} for n in "ab"] +
            [{"name": "wait", "arguments": {}}]])
        result = run_swarm_episode(task, orchestrator, policy, config)
    finally:
        server.shutdown()
        server.server_close()
    assert state["most"] == 2 and len(state["requests"]) == 2
    assert {t["function"]["name"] for t in state["requests"][0]["tools"]} == {"read_file", "finish"}
    assert state["requests"][0]["messages"][1] == {"role": "user", "content": "t"}
    assert result.swarm["finished"] == 2 and result.reward["r_finish"] == 1.0


def test_turn_and_token_budgets_end_a_subagent_with_a_report_and_it_can_be_reassigned(tmp_path):
    task, config = _setup(tmp_path)
    start = [{"name": "create_subagent", "arguments": {"name": "geometry", "instructions": "geometry"}},
             {"name": "assign_task", "arguments": {"subagent": "geometry", "task": "area"}}]
    again = [{"name": "assign_task", "arguments": {"subagent": "geometry", "task": "area, again"}},
             {"name": "wait", "arguments": {}}]
    orchestrator = [start + [{"name": "wait", "arguments": {}}], again, {"name": "merge", "arguments": {
        "subagent": "geometry"}}]
    by_turns = run_swarm_episode(task, ScriptAgent(orchestrator), ScriptedPolicy(TWO_PART_SUBAGENTS), config,
                                 SwarmConfig(subagent_max_turns=2))
    obs = _observations(by_turns)
    assert "sub-agent geometry: max_turns after 2 steps" in obs[2] and "files changed: kit/area.py" in obs[2]
    assert "assigned to geometry (run 1)" in obs[3] and "max_turns after 2 steps" in obs[4]
    assert "merged geometry: 1 file(s) applied" in obs[5]  # the latest collected run is merged
    assert by_turns.stages == [[1, 2], [1, 2], [2, 0]] and by_turns.critical_steps == 8
    assert by_turns.swarm["assignments"] == 2 and by_turns.reward["r_finish"] == 0.0
    by_tokens = run_swarm_episode(task, ScriptAgent([start + [{"name": "wait", "arguments": {}}]]),
                                  ScriptedPolicy(TWO_PART_SUBAGENTS), config, SwarmConfig(subagent_max_tokens=60))
    assert "sub-agent geometry: budget after 1 steps" in _observations(by_tokens)[2]
    assert by_tokens.reward["swarm_wall_s"] == by_tokens.wall_s > 0 and os.listdir(tmp_path / "boxes") == []
