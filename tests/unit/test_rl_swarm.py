"""RL with the agent swarm (rl_composer.py --rl-env swarm): an orchestrator's rollout holds only its own turns as
trainable tokens (sub-agents' turns reach it as observations), its reward carries the PARL terms with the step's
annealed lambdas, the pinned-engine sub-agent policy renders and parses turns, and a tiny model trains through
rl_composer.py with the swarm tools."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from megatron_ext.data.sft import SECTION_BEGIN, render_chat
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.env.arguments import add_env_args, add_swarm_args
from megatron_ext.env.demo import TWO_PART_ORCHESTRATOR, TWO_PART_SUBAGENTS, make_two_part_task
from megatron_ext.env.rewards import DEFAULT_WEIGHTS
from megatron_ext.env.episode import ContextExceeded
from megatron_ext.env.swarm import SWARM_SYSTEM_PROMPT, SWARM_TOOL_SCHEMAS, EnginePolicy
from megatron_ext.rl.coding import read_coding_tasks
from megatron_ext.rl.rollout import EpisodeConfig, Sampling, run_groups
from megatron_ext.rl.swarm import SwarmEnvFactory
from megatron_ext.rl.types import Sample
from tests.unit.data_fixtures import small_corpus, trained_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    return trained_tokenizer(d, small_corpus(d), vocab_size=1024)


def _args(argv):
    p = argparse.ArgumentParser()
    add_env_args(p)
    add_swarm_args(p)
    return p.parse_args(argv)


def _turn(i, turn):
    calls = turn if isinstance(turn, list) else [turn]
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"functions.{a['name']}:{i * 10 + k}", "type": "function",
         "function": {"name": a["name"], "arguments": json.dumps(a["arguments"])}} for k, a in enumerate(calls)]}


class OrchestratorOracle:
    """A GenerateFn playing TWO_PART_ORCHESTRATOR as model tokens; the turn is read off the context (one tool-call
    section per finished turn)."""

    def __init__(self, tokenizer, instruction):
        base = [{"role": "system", "content": SWARM_SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
        self.prompt = render_chat(tokenizer, base, tools=SWARM_TOOL_SCHEMAS, add_generation_prompt=True).ids
        self.section = tokenizer.token_id(SECTION_BEGIN)
        self.turns = [render_chat(tokenizer, base + [_turn(i, t)], tools=SWARM_TOOL_SCHEMAS).ids[len(self.prompt):]
                      for i, t in enumerate(TWO_PART_ORCHESTRATOR)]

    def __call__(self, prompts, n, sampling):
        out = []
        for ctx in prompts:
            ids = self.turns[ctx.count(self.section) - self.prompt.count(self.section)]
            out.append([Sample(list(ids), [-0.5] * len(ids), [-0.5] * len(ids), [0] * len(ids), "stop")
                        for _ in range(n)])
        return out


def test_orchestrator_rollouts_train_only_its_turns_and_carry_the_annealed_parl_terms(tmp_path, tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    suite = tmp_path / "suite.jsonl"
    with open(make_two_part_task(str(tmp_path / "t"))) as f:
        task = json.load(f)
    task.update(repo="t/repo", hidden_tests="t/hidden")
    suite.write_text(json.dumps(task) + "\n")
    scripts = tmp_path / "subagents.json"
    scripts.write_text(json.dumps(TWO_PART_SUBAGENTS))
    boxes = tmp_path / "boxes"
    factory = SwarmEnvFactory(_args(["--env-sandbox-dir", str(boxes), "--swarm-subagent-policy", f"script:{scripts}",
                                     "--swarm-parallel-reward-weight", "0.4", "--swarm-finish-reward-weight", "0.2",
                                     "--swarm-reward-anneal-steps", "10"]), tokenizer, log=lambda *a: None)
    assert factory.concurrency == 1  # a step may run sub-agents on a shared policy: one environment call at a time
    factory.use_weights(factory.read_weights(5))  # what the trainer does before step 5's rollouts: lambdas halved
    assert factory.config.weights["swarm"] == {"r_parallel": 0.2, "r_finish": 0.1, "step": 5}
    tasks = read_coding_tasks(str(suite))
    gen = OrchestratorOracle(tokenizer, tasks[0]["instruction"])
    assert factory.prompt_length(tasks[0]) == len(gen.prompt)
    cfg = EpisodeConfig(2, Sampling(max_tokens=1024, stop_token_ids=factory.stop_token_ids), max_turns=10,
                        max_response_length=8192)
    [group] = run_groups(tasks, factory, gen, cfg)
    assert len(group.rollouts) == 2 and group.advantages == [0.0, 0.0]
    for rollout in group.rollouts:
        assert rollout.token_ids[:len(gen.prompt)] == gen.prompt and rollout.finish_reason == "stop"
        assert [s.trainable for s in rollout.segments] == [False, True, False, True]
        assert [s.token_ids for s in rollout.segments if s.trainable] == gen.turns  # only the orchestrator's turns
        observation = tokenizer.decode(rollout.segments[2].token_ids)
        assert "sub-agent geometry: finished after 4 steps" in observation  # sub-agents' work: an observation
        parts = rollout.reward.parts
        assert parts["correctness"] == 1.0 and parts["r_parallel"] == 0.5 and parts["r_finish"] == 1.0
        assert parts["swarm_critical_steps"] == 6.0 and parts["swarm_total_steps"] == 10.0
        w = {**DEFAULT_WEIGHTS["weights"], "r_parallel": 0.2, "r_finish": 0.1}
        assert rollout.reward.total == pytest.approx(sum(w.get(k, 0.0) * v for k, v in parts.items()))
    assert os.listdir(boxes) == []


class FakeEngine:
    """Stands in for an InferenceEngine: answers every prompt with one rendered tool call; records concurrency."""

    def __init__(self, reply_ids, context: int = 4096):
        self.reply_ids, self.weights_version, self.active, self.most = reply_ids, 3, 0, 0
        self.prompts, self.guard, self.params = [], threading.Lock(), []
        self.model = SimpleNamespace(max_sequence_length=context)

    def generate(self, prompts, params):
        self.params.append(params)
        with self.guard:
            self.active += 1
            self.most = max(self.most, self.active)
        self.prompts += prompts
        with self.guard:
            self.active -= 1
        return [SimpleNamespace(token_ids=list(self.reply_ids))]

    def update_weights(self, model, version):
        self.weights_version = version


def test_pinned_engine_policy_renders_parses_and_serialises_turns(tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    call = _turn(0, {"name": "read_file", "arguments": {"path": "kit/area.py"}})
    prompt = render_chat(tokenizer, base, tools=SWARM_TOOL_SCHEMAS[:8], add_generation_prompt=True).ids
    reply = render_chat(tokenizer, base + [call], tools=SWARM_TOOL_SCHEMAS[:8]).ids[len(prompt):]
    engine = FakeEngine(reply)
    policy = EnginePolicy(engine, tokenizer, max_tokens=64, temperature=0.0)
    threads = [threading.Thread(target=lambda: policy.agent("x").act(base, SWARM_TOOL_SCHEMAS[:8])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.prompts == [prompt] * 4 and engine.most == 1  # one turn at a time on the shared engine copy
    message = policy.act(base, SWARM_TOOL_SCHEMAS[:8])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["read_file"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"path": "kit/area.py"}
    policy.pin(None, 7)
    assert policy.version == 7
    # turns fit the engine's context: max_tokens clamped to the room left; no room ends the sub-agent's episode
    assert engine.params[-1].max_tokens == 64
    short = EnginePolicy(FakeEngine(reply, context=len(prompt) + 10), tokenizer, max_tokens=64)
    short.act(base, SWARM_TOOL_SCHEMAS[:8])
    assert short.engine.params[-1].max_tokens == 10
    with pytest.raises(ContextExceeded, match="fills the model's context"):
        EnginePolicy(FakeEngine(reply, context=len(prompt)), tokenizer).act(base, SWARM_TOOL_SCHEMAS[:8])


def test_swarm_flags_fail_early_and_name_the_flag(tmp_path, tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    with pytest.raises(ValueError, match="--rl-env swarm needs --swarm-subagent-policy"):
        SwarmEnvFactory(_args([]), tokenizer)
    with pytest.raises(ValueError, match="--swarm-max-subagents must be >= 1"):
        SwarmEnvFactory(_args(["--swarm-subagent-policy", "pinned", "--swarm-max-subagents", "0"]), tokenizer)
    with pytest.raises(ValueError, match="--swarm-finish-reward-weight must be >= 0"):
        SwarmEnvFactory(_args(["--swarm-subagent-policy", "pinned", "--swarm-finish-reward-weight", "-1"]), tokenizer)
    args = _args(["--swarm-subagent-policy", "pinned"])
    args.tensor_model_parallel_size = 2
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 1"):
        SwarmEnvFactory(args, tokenizer)


@pytest.mark.slow  # about 100 s on a shared 2-core CPU: the swarm prompt declares 12 tools (2.7K tokens)
@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_tiny_model_trains_with_the_swarm_tools_through_rl_composer(tmp_path, tokenizer_dir):
    from tests.unit.data_fixtures import load_tool
    from tests.unit.test_env_mining import _git_repo

    suite, logs, boxes = str(tmp_path / "suite" / "mathy.jsonl"), tmp_path / "logs", tmp_path / "boxes"
    assert load_tool("mine_tasks").main([str(_git_repo(tmp_path)), "--out", suite, "--max-tasks", "2"]) == 0
    flags = ["--rl-env", "swarm", "--swarm-subagent-policy", "pinned", "--swarm-subagent-tokens-per-turn", "8",
             "--swarm-reward-anneal-steps", "4", "--swarm-parallel-reward-weight", "0.5",
             "--model", "tiny", "--tokenizer-model", tokenizer_dir, "--rl-prompts", suite,
             "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
             "--grpo-group-size", "2", "--grpo-prompts-per-step", "1", "--grpo-max-response-length", "16",
             "--grpo-kl-beta", "0", "--lr", "1e-3", "--train-iters", "5", "--rl-log-dir", str(logs),
             "--env-sandbox-dir", str(boxes)]
    p = subprocess.run([sys.executable, "-W", "ignore", "rl_composer.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all 2 prompts of --rl-prompts trained once: stopping at iteration 2" in p.stdout
    assert "swarm: sub-agents run the policy's weights at version 0 in a local engine copy" in p.stdout
    assert "reward r_parallel" in p.stdout and "reward swarm_critical_steps" in p.stdout
    rollouts = [json.loads(line) for line in open(logs / "rollouts.jsonl")]
    assert len(rollouts) == 4
    for r in rollouts:
        parts = r["reward_parts"]
        assert r["reward_error"] is None and {"r_parallel", "r_finish", "swarm_critical_steps"} <= set(parts)
        assert parts["swarm_critical_steps"] >= 1 and 0 <= parts["r_parallel"] <= 1
        assert 1 <= sum(r["loss_mask"]) <= 16  # the orchestrator's tokens, within the generation budget
    assert os.listdir(boxes) == []


@pytest.mark.parametrize("extra, message", [
    ([], "--rl-env swarm needs --tokenizer-model"),
    (["--tokenizer-model", "TOK"], "--rl-env swarm needs --swarm-subagent-policy"),
    (["--tokenizer-model", "TOK", "--swarm-subagent-policy", "endpoint:http://x", "--rl-sft-warmup"],
     "--rl-sft-warmup"),
    (["--tokenizer-model", "TOK", "--swarm-subagent-policy", "pinned", "--swarm-reward-anneal-steps", "-1"],
     "--swarm-reward-anneal-steps must be >= 0"),
])
def test_rl_composer_swarm_flags_fail_early(tmp_path, tokenizer_dir, capsys, extra, message):
    from tests.unit.test_rl_coding import _composer

    with open(make_two_part_task(str(tmp_path / "t"))) as f:
        task = json.load(f)
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({**task, "repo": "t/repo", "hidden_tests": "t/hidden"}) + "\n")
    extra = [tokenizer_dir if a == "TOK" else a for a in extra]
    code = _composer().main(["--rl-env", "swarm", "--model", "tiny", "--rl-prompts", str(suite), *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_fleet_policy_sends_concurrent_turns_to_the_run_servers(tokenizer_dir):
    """--swarm-subagent-policy fleet: sub-agent turns are requests to the RL run's inference servers, several at
    once (never serialised behind each other or the orchestrator), each with its own seed; the reply is parsed
    into tool calls; a prompt filling the context ends the sub-agent's episode. Without --rl-remote-servers the
    flag fails early, naming it."""
    import time

    from megatron_ext.env.swarm import GeneratePolicy
    from megatron_ext.rl.remote import RemoteGenerate

    tokenizer = build_tokenizer(None, tokenizer_dir)
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    call = _turn(0, {"name": "read_file", "arguments": {"path": "kit/area.py"}})
    prompt = render_chat(tokenizer, base, tools=SWARM_TOOL_SCHEMAS[:8], add_generation_prompt=True).ids
    reply = render_chat(tokenizer, base + [call], tools=SWARM_TOOL_SCHEMAS[:8]).ids[len(prompt):]
    seen, lock, active = [], threading.Lock(), [0, 0]

    def generate(prompts, n, sampling):
        with lock:
            active[0] += 1
            active[1] = max(active[1], active[0])
            seen.append((prompts, n, sampling))
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return [[Sample(list(reply), [0.0] * len(reply), [0.0] * len(reply), [3] * len(reply), "stop")]]

    policy = GeneratePolicy(generate, tokenizer, max_context=len(prompt) + 40, max_tokens=64, temperature=0.7)
    out = []
    threads = [threading.Thread(target=lambda: out.append(policy.agent("x").act(base, SWARM_TOOL_SCHEMAS[:8])))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert active[1] == 4  # all four turns in flight at once
    assert all(p == [prompt] and n == 1 for p, n, _ in seen)
    assert len({s.seed for _, _, s in seen}) == 4 and {s.max_tokens for _, _, s in seen} == {40}  # clamped to room
    assert all([c["function"]["name"] for c in m["tool_calls"]] == ["read_file"] for m in out)
    with pytest.raises(ContextExceeded, match="fills the model's context"):
        GeneratePolicy(generate, tokenizer, max_context=len(prompt)).act(base, SWARM_TOOL_SCHEMAS[:8])
    with pytest.raises(ValueError, match="needs --rl-remote-servers"):
        SwarmEnvFactory(_args(["--swarm-subagent-policy", "fleet"]), tokenizer)
    args = _args(["--swarm-subagent-policy", "fleet"])
    args.rl_remote_servers, args.seq_length, args.seed = ["http://127.0.0.1:9"], 4096, 1
    factory = SwarmEnvFactory(args, tokenizer, log=lambda *a, **k: None)
    factory.attach(SimpleNamespace(cfg=SimpleNamespace(remote_servers=args.rl_remote_servers), iteration=0))
    assert isinstance(factory.policy, GeneratePolicy) and isinstance(factory.policy.generate, RemoteGenerate)
    assert factory.policy.generate.urls == ["http://127.0.0.1:9"] and factory.policy.generate.failover
