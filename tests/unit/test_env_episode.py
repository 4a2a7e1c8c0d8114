"""Episodes with scripted agents on a tiny task: the oracle scores 1, a no-op 0, a test editor is caught, malformed
calls are penalised and never fatal; run_episode.py prints the transcript and reward parts as JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_ext.env.agents import ScriptAgent
from megatron_ext.env.episode import SUMMARY_REQUEST, EpisodeConfig, run_episode
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.tasks import TaskError, load_task
from megatron_ext.env.demo import CHEAT_CONFTEST, ORACLE, REFERENCE_BODY, STUB, make_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(tmp_path, actions, **task_overrides):
    task = load_task(make_task(str(tmp_path), **task_overrides))
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
    result = run_episode(task, ScriptAgent(actions), config)
    assert os.listdir(tmp_path / "boxes") == []  # both sandboxes removed
    assert open(os.path.join(task.repo, "calc", "__init__.py")).read() == STUB  # the source is untouched
    return result


def test_oracle_scores_one(tmp_path):
    r = _run(tmp_path, ORACLE)
    reward = r.reward
    assert r.status == "finished" and reward["correctness"] == 1.0 and reward["tests_fraction"] == 1.0
    assert "4 passed" in r.grading["output"]
    assert r.grading["changed_files"] == ["calc/__init__.py"] and r.grading["forbidden_edits"] == []
    assert reward["invalid_calls"] == 0 and reward["unfinished_todos"] == 0 and reward["style"] == 0
    assert reward["communication"] == 1.0
    assert r.counts["tool_calls"] == len(ORACLE) and r.counts["turns"] == len(ORACLE)
    observations = [m["content"] for m in r.messages if m["role"] == "tool"]
    assert "raise NotImplementedError" in observations[1] and observations[3].startswith("5\n")
    # the transcript is what the chat template renders: assistant tool calls answered by tool messages by id
    calls = [c["id"] for m in r.messages if m["role"] == "assistant" for c in m["tool_calls"]]
    assert calls == [m["tool_call_id"] for m in r.messages if m["role"] == "tool"]
    assert calls[0] == "functions.todo:0" and calls[-1] == f"functions.finish:{len(ORACLE) - 1}"
    assert reward["total"] == pytest.approx(sum(reward["weights"][k] * reward[k] for k in reward["weights"]))


def test_noop_scores_zero_and_sees_no_hidden_tests_or_history(tmp_path):
    r = _run(tmp_path, [{"name": "list_dir", "arguments": {"depth": 3}}])
    listing = r.messages[3]["content"].split("\n")
    assert "calc/__init__.py" in listing and "tests/test_visible.py" in listing
    assert not any(".git" in e or "tests_hidden" in e for e in listing)
    assert r.reward["correctness"] == 0.0 and r.reward["tests_fraction"] == 0.0
    assert "4 failed" in r.grading["output"]
    assert r.reward["communication"] == 0.0  # changed nothing: no communication reward (issue 23)


def test_test_file_editor_is_caught_and_restored(tmp_path):
    cheat = [{"name": "write_file", "arguments": {"path": "conftest.py", "content": CHEAT_CONFTEST}},
             {"name": "run_command", "arguments": {"command": "echo 'def test_sub(): pass' > tests/test_visible.py"}}]
    r = _run(tmp_path, cheat)
    assert r.grading["forbidden_edits"] == ["conftest.py", "tests/test_visible.py"]
    assert r.reward["forbidden_edits"] == 2.0 and r.reward["correctness"] == 0.0
    # a task that forbids nothing still cannot be steered by a conftest.py: the grader's own rule restores it
    (tmp_path / "again").mkdir()
    unguarded = _run(tmp_path / "again", cheat, forbidden=[])
    assert unguarded.reward["correctness"] == 0.0 and unguarded.grading["forbidden_edits"] == ["conftest.py"]


def test_malformed_calls_are_penalised_never_fatal(tmp_path):
    actions = [{"name": "edit_file", "arguments": "{not json"},
               {"name": "delete_everything", "arguments": {}},
               {"name": "read_file", "arguments": {"path": "calc/__init__.py", "lines": 3}},
               {"name": "run_command", "arguments": {"command": ["ls"]}},
               {"name": "edit_file", "arguments": {"path": "calc/__init__.py", "old_text": "return a * b",
                                                   "new_text": "return b"}},  # absent
               {"name": "edit_file", "arguments": {"path": "calc/__init__.py", "old_text": '"""Return a',
                                                   "new_text": "x"}},  # ambiguous
               {"name": "todo", "arguments": {"action": "add", "item": "never done"}},
               {"name": "edit_file", "arguments": {"path": "calc/__init__.py",
                                                   "old_text": "    raise NotImplementedError\n",
                                                   "new_text": REFERENCE_BODY.splitlines(True)[1]}},
               {"name": "run_command", "arguments": {"command": "true"}},
               {"name": "run_command", "arguments": {"command": "true"}}]
    r = _run(tmp_path, actions)
    errors = [c.error for c in r.calls]
    assert "not valid JSON" in errors[0] and "unknown tool" in errors[1] and "unknown arguments" in errors[2]
    assert "must be string" in errors[3] and "not found" in errors[4]
    assert "occurs 2 times in calc/__init__.py (lines 5, 10)" in errors[5]
    assert all(e is None for e in errors[6:])
    assert r.status == "finished" and r.reward["correctness"] == 1.0
    assert r.reward["invalid_calls"] == 6 and r.reward["unfinished_todos"] == 1 and r.reward["repeated_calls"] == 1
    assert all(m["content"].startswith("error: ") for m in r.messages[3:15:2])


def test_agent_that_raises_ends_the_episode_not_the_run(tmp_path):
    class Broken:
        def act(self, messages, tools):
            raise ConnectionError("server went away")
    task = load_task(make_task(str(tmp_path)))
    r = run_episode(task, Broken(), EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes"))))
    assert r.status == "agent_error" and "server went away" in r.error and r.reward["correctness"] == 0.0


def test_task_validation(tmp_path):
    path = make_task(str(tmp_path))
    record = json.load(open(path))
    for change, message in (({"timeout_s": "10"}, "'timeout_s' has the wrong type"),
                            ({"repo": "missing"}, "neither a directory"),
                            ({"hidden_tests": "repo/tests"}, "inside the repo"),
                            ({"surprise": 1}, "unknown fields")):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**record, **change}))
        with pytest.raises(TaskError, match=message):
            load_task(str(bad))
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps(record) + "\n" + json.dumps({**record, "id": "two"}) + "\n")
    assert load_task(f"{suite}#two").id == "two"
    with pytest.raises(TaskError, match="choose one"):
        load_task(str(suite))


def test_run_episode_cli_prints_reward_json(tmp_path, capsys):
    path = make_task(str(tmp_path))
    actions = tmp_path / "actions.json"
    actions.write_text(json.dumps(ORACLE[2:3]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "run_episode.py"), "--task", path,
                          "--agent", f"script:{actions}", "--env-reward-weight", "correctness=2",
                          "--env-reward-weight", "length=0", "--env-max-processes", "64"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    reward = result["reward"]
    assert reward["correctness"] == 1.0 and result["status"] == "finished"
    assert reward["weights"]["correctness"] == 2.0 and reward["weights"]["length"] == 0.0
    assert reward["total"] == pytest.approx(sum(reward["weights"][k] * reward[k] for k in reward["weights"]))
    assert [c["name"] for c in result["tool_calls"]] == ["edit_file", "finish"]
    assert result["transcript"][-1] == {"role": "tool", "tool_call_id": "functions.finish:1", "content": "finished"}
    from tests.unit.data_fixtures import load_tool

    run_episode_tool = load_tool("run_episode")
    for extra, message in ((["--agent", "robot:x"], "expected script:ACTIONS.json"),
                           (["--agent", f"script:{actions}", "--env-reward-weight", "corectness=1"], "unknown part"),
                           (["--agent", f"script:{actions}", "--env-memory-gb", "0"], "--env-memory-gb must be")):
        try:  # in-process: the flags are refused (argparse's exit, or main's return) before any episode
            code = run_episode_tool.main(["--task", path, *extra])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and message in err, err[-500:]


def test_endpoint_agent_against_our_server(tmp_path):
    """An episode whose agent is tools/serve.py's HTTP service (a random tiny model: it answers without tool
    calls, so the episode ends after one turn and scores 0); the oracle's multi-turn transcript, tool calls and
    tool results included, renders through the same server."""
    from megatron_ext.env.agents import EndpointAgent
    from megatron_ext.env.tools import TOOL_SCHEMAS
    from tests.unit.inference_fixtures import served_chat_model

    with served_chat_model(str(tmp_path)) as (url, _, _):
        task = load_task(make_task(str(tmp_path / "t")))
        config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")))
        r = run_episode(task, EndpointAgent(url, max_tokens=8), config)
        assert r.status == "no_tool_calls" and r.error is None and r.counts["turns"] == 1, r.error
        assert r.messages[-1]["role"] == "assistant" and isinstance(r.messages[-1]["content"], str)
        assert r.reward["correctness"] == 0.0
        oracle = run_episode(task, ScriptAgent(ORACLE), config)
        reply = EndpointAgent(url, max_tokens=4).act(oracle.messages, TOOL_SCHEMAS)
        assert reply["role"] == "assistant" and isinstance(reply["content"], str)


def test_self_summarisation_restarts_from_the_summary_and_task_state(tmp_path):
    task = load_task(make_task(str(tmp_path)))
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")), summarize_at=150)
    r = run_episode(task, ScriptAgent(ORACLE), config)
    assert r.status == "finished" and r.reward["correctness"] == 1.0 and len(r.segments) >= 1
    first = r.segments[0]
    assert first[-2] == {"role": "user", "content": SUMMARY_REQUEST}
    assert first[-1]["content"].startswith("Scripted agent: played todo, read_file")
    restart = (r.segments[1] if len(r.segments) > 1 else r.messages)[1]["content"]
    assert restart.startswith(task.instruction) and "## Summary of your work so far\nScripted agent: played" in restart
    assert "1. [ ] implement calc.add" in restart
    # every action was played once across the segments; the summaries are turns without tool calls
    calls = [c["function"]["name"] for seg in r.segments + [r.messages] for m in seg for c in m.get("tool_calls", [])]
    assert calls == [a["name"] for a in ORACLE]
    assert r.counts["turns"] == len(ORACLE) + len(r.segments)


@pytest.mark.slow
def test_local_checkpoint_agent(tmp_path):
    """local:CKPT serves the checkpoint with tools/serve.py on a loopback port for the episode."""
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.env.agents import make_agent
    from tests.unit.data_fixtures import small_corpus, trained_tokenizer

    tok_dir = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024)
    vocab = build_tokenizer(None, tok_dir).vocab_size
    save = str(tmp_path / "ckpt")
    train = subprocess.run([sys.executable, "-W", "ignore", "pretrain_composer.py", "--model", "tiny", "--mock-data",
                            "--vocab-size", str(vocab), "--seq-length", "4096", "--max-position-embeddings", "4096",
                            "--train-iters", "1", "--global-batch-size", "1", "--micro-batch-size", "1",
                            "--save", save], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr[-2000:]
    agent = make_agent(f"local:{save}", serve_args=("--tokenizer-model", tok_dir), max_tokens=8)
    try:
        task = load_task(make_task(str(tmp_path / "t")))
        r = run_episode(task, agent, EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes"))))
    finally:
        agent.close()
    assert agent.process.poll() is not None  # the server is gone with the agent
    assert r.error is None and r.status in ("no_tool_calls", "finished", "max_turns") and r.counts["turns"] >= 1
    assert r.messages[2]["role"] == "assistant"


def test_planted_symlinks_cannot_redirect_grading_writes(tmp_path):
    """The agent turns the forbidden tests folder and the hidden tests' folder into symlinks to a host folder;
    restoring the tests and laying the hidden tests over the workspace must not write there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    plant = f"rm -rf tests && ln -s {outside} tests && ln -s {outside} tests_hidden && ln -s {outside} conftest.py"
    r = _run(tmp_path, [{"name": "run_command", "arguments": {"command": plant}}])
    assert os.listdir(outside) == []
    assert "4 failed" in r.grading["output"] and r.reward["correctness"] == 0.0
    assert set(r.grading["forbidden_edits"]) == {"conftest.py", "tests", "tests/test_visible.py", "tests_hidden"}
