"""RL in the agentic coding environment (rl_composer.py --rl-env coding): the adapter's episodes are token sequences
that equal the rendered transcript, with the model's turns (and only them) trained on; self-summarisation makes a
chain of sequences sharing the episode's reward; a tiny random model trains a few steps over tasks mined from a git
repository through rl_composer.py; reward weights follow an edited weights file from the step the edit is read at."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_ext.data.sft import IM_END, render_chat
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.env.arguments import add_env_args
from megatron_ext.env.demo import ORACLE, make_task
from megatron_ext.env.episode import SUMMARY_REQUEST, SYSTEM_PROMPT
from megatron_ext.env.rewards import DEFAULT_WEIGHTS
from megatron_ext.env.tools import TOOL_SCHEMAS
from megatron_ext.rl.coding import CodingEnvFactory, read_coding_tasks
from megatron_ext.rl.rollout import EpisodeConfig, Sampling, run_groups
from megatron_ext.rl.trainer import RLTrainer
from megatron_ext.rl.types import Sample
from tests.unit.data_fixtures import load_tool, small_corpus, trained_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PENALTIES = ("invalid_calls", "repeated_calls", "unfinished_todos", "forbidden_edits")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    return trained_tokenizer(d, small_corpus(d), vocab_size=1024)


def _suite(root, n: int) -> str:
    """n copies of the demo task (implement calc.add) under distinct ids, as a JSONL suite."""
    lines = []
    for i in range(n):
        with open(make_task(os.path.join(root, f"t{i}"), id=f"calc-add-{i}")) as f:
            task = json.load(f)
        task.update(repo=f"t{i}/repo", hidden_tests=f"t{i}/hidden")  # relative to the suite file
        lines.append(json.dumps(task))
    path = os.path.join(root, "suite.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _env_args(argv):
    p = argparse.ArgumentParser()
    add_env_args(p)
    return p.parse_args(argv)


def _prompt(tokenizer, instruction):
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
    return render_chat(tokenizer, messages, tools=TOOL_SCHEMAS, add_generation_prompt=True).ids


class OracleGenerate:
    """A GenerateFn that plays the demo task's oracle: turn t of every episode is ORACLE[t] as the tokens a model
    emits (the tool call and <|im_end|>); the turn is read off the context (two <|im_end|> per finished turn)."""

    def __init__(self, tokenizer, instruction):
        self.im_end = tokenizer.token_id(IM_END)
        base = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": instruction}]
        self.prompt = _prompt(tokenizer, instruction)
        self.turns = []
        for i, action in enumerate(ORACLE):
            reply = {"role": "assistant", "content": "", "tool_calls": [{
                "id": f"functions.{action['name']}:{i}", "type": "function",
                "function": {"name": action["name"], "arguments": json.dumps(action["arguments"])}}]}
            self.turns.append(render_chat(tokenizer, base + [reply], tools=TOOL_SCHEMAS).ids[len(self.prompt):])

    def __call__(self, prompts, n, sampling):
        out = []
        for ctx in prompts:
            turn = (ctx.count(self.im_end) - self.prompt.count(self.im_end)) // 2
            ids = self.turns[turn]
            out.append([Sample(list(ids), [-0.5] * len(ids), [-0.5] * len(ids), [0] * len(ids), "stop")
                        for _ in range(n)])
        return out


def test_oracle_episodes_are_the_rendered_transcript_and_score_correct(tmp_path, tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    tasks = read_coding_tasks(_suite(str(tmp_path), 1))
    boxes = tmp_path / "boxes"
    factory = CodingEnvFactory(_env_args(["--env-sandbox-dir", str(boxes)]), tokenizer, log=lambda *a: None)
    made = []

    def make_env():
        made.append(factory())
        return made[-1]

    gen = OracleGenerate(tokenizer, tasks[0]["instruction"])
    cfg = EpisodeConfig(2, Sampling(max_tokens=512, stop_token_ids=factory.stop_token_ids), max_turns=12,
                        max_response_length=8192)
    [group] = run_groups(tasks, make_env, gen, cfg)
    assert len(group.rollouts) == 2 and group.advantages == [0.0, 0.0]
    for rollout, env in zip(group.rollouts, made):
        transcript = env.env.result.messages
        # one sequence: the rendered transcript up to the last tool observation (no observation after finish)
        assert rollout.token_ids == render_chat(tokenizer, transcript[:-1], tools=TOOL_SCHEMAS).ids
        assert rollout.token_ids[:len(gen.prompt)] == gen.prompt
        t = rollout.per_token()
        model = [tok for tok, m in zip(rollout.token_ids, t["loss_mask"]) if m]
        assert model == [tok for turn in gen.turns for tok in turn]  # exactly the model's turns are trained on
        assert [s.trainable for s in rollout.segments] == [False, True] * len(ORACLE)
        assert tokenizer.decode(rollout.segments[-1].token_ids).count("finish") == 1
        assert rollout.finish_reason == "stop" and rollout.reward.error is None
        parts = rollout.reward.parts
        assert parts["correctness"] == 1.0 and all(parts[p] == 0.0 for p in PENALTIES)
        w = DEFAULT_WEIGHTS["weights"]
        assert rollout.reward.total == pytest.approx(sum(w[k] * v for k, v in parts.items()))
    assert os.listdir(boxes) == []  # every sandbox copy removed once scored


class SummarizingOracle(OracleGenerate):
    """One episode at a time: the oracle's next action each turn, and a plain-text summary (closed by <|im_end|>)
    whenever the environment asks for one."""

    SUMMARY = "I read calc/__init__.py and added a todo; next: implement add and run it."

    def __init__(self, tokenizer, instruction):
        super().__init__(tokenizer, instruction)
        self.tokenizer, self.next, self.summaries = tokenizer, 0, 0

    def __call__(self, prompts, n, sampling):
        [ctx] = prompts
        if SUMMARY_REQUEST[:40] in self.tokenizer.decode(ctx[-200:]):
            ids, self.summaries = self.tokenizer.encode(self.SUMMARY) + [self.im_end], self.summaries + 1
        else:
            ids, self.next = self.turns[self.next], self.next + 1
        return [[Sample(list(ids), [-0.5] * len(ids), [-0.5] * len(ids), [0] * len(ids), "stop")]]


def test_self_summarising_oracle_is_a_chain_of_sequences_with_the_final_reward(tmp_path, tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    tasks = read_coding_tasks(_suite(str(tmp_path), 1))
    boxes = tmp_path / "boxes"
    factory = CodingEnvFactory(_env_args(["--env-sandbox-dir", str(boxes), "--env-summarize-at", "150"]),
                               tokenizer, log=lambda *a: None)
    gen = SummarizingOracle(tokenizer, tasks[0]["instruction"])
    [group] = run_groups(tasks, factory, gen, EpisodeConfig(1, Sampling(max_tokens=512), max_turns=30,
                                                            max_response_length=8192))
    chain = group.rollouts
    assert gen.summaries >= 1 and len(chain) == gen.summaries + 1 and gen.next == len(ORACLE)
    assert [r.sequence_index for r in chain] == list(range(len(chain))) and {r.sample_index for r in chain} == {0}
    summary = tokenizer.encode(SummarizingOracle.SUMMARY) + [gen.im_end]
    for r in chain[:-1]:  # each closed sequence ends with the model's summary turn
        assert r.segments[-1].trainable and r.segments[-1].token_ids == summary
    for r in chain[1:]:  # ... and the next starts from the instruction, the summary and the task state
        text = tokenizer.decode(r.segments[0].token_ids)
        assert r.segments[0].trainable is False and "Summary of your work so far" in text
        assert SummarizingOracle.SUMMARY in text and "implement calc.add" in text  # the todo item carried over
    model_turns = [s.token_ids for r in chain for s in r.segments if s.trainable]
    assert [t for t in model_turns if t != summary] == gen.turns  # every oracle turn trained on, once
    assert chain[0].reward.parts["correctness"] == 1.0 and all(r.reward == chain[0].reward for r in chain)
    assert group.advantages == [0.0] * len(chain) and os.listdir(boxes) == []


def test_weights_file_changes_take_effect_at_the_step_they_are_read(tmp_path, tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    path = tmp_path / "weights.json"
    path.write_text(json.dumps({"weights": {"communication": 0.3}}))
    logged = []
    factory = CodingEnvFactory(_env_args(["--env-reward-weights", str(path), "--env-reward-weight", "style=-0.01"]),
                               tokenizer, log=logged.append)
    assert factory().env.config.weights["weights"]["communication"] == 0.3
    assert factory.read_weights(3)["weights"]["communication"] == 0.3  # unchanged file: nothing new logged
    path.write_text(json.dumps({"weights": {"communication": 0.7}}))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    config = factory.read_weights(5)
    assert [step for step, _ in factory.weight_file.changes] == [0, 5]
    assert "step 5" in logged[-1] and len(logged) == 2
    assert config["weights"]["communication"] == 0.7 and config["weights"]["style"] == -0.01  # overrides kept
    assert factory().env.config.weights["weights"]["communication"] == 0.3  # until the trainer hands it over
    factory.use_weights(config)
    assert factory().env.config.weights["weights"]["communication"] == 0.7
    # the trainer's hook before a step's rollouts (one rank: no broadcast)
    path.write_text(json.dumps({"weights": {"communication": 0.75}}))
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 2 * 10**9))
    RLTrainer._sync_reward_weights(SimpleNamespace(make_env=factory, rank=0), 8)
    assert [step for step, _ in factory.weight_file.changes] == [0, 5, 8] and "step 8" in logged[-1]
    assert factory().env.config.weights["weights"]["communication"] == 0.75


def _composer():
    spec = importlib.util.spec_from_file_location("rl_composer_main", os.path.join(ROOT, "rl_composer.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra, message", [
    ([], "--rl-env coding needs --tokenizer-model"),
    (["--tokenizer-model", "TOK", "--rl-sft-warmup"], "--rl-sft-warmup"),
    (["--tokenizer-model", "TOK", "--rl-reward-weights", "exact=1"], "--env-reward-weight"),
    (["--tokenizer-model", "TOK", "--seq-length", "512"], "raise --seq-length"),
])
def test_bad_coding_flags_fail_early_and_name_the_flag(tmp_path, tokenizer_dir, capsys, extra, message):
    suite = _suite(str(tmp_path), 1)
    extra = [tokenizer_dir if a == "TOK" else a for a in extra]
    code = _composer().main(["--rl-env", "coding", "--model", "tiny", "--rl-prompts", suite, *extra])
    assert code == 2 and message in capsys.readouterr().err


# 26 s: `make test-all`. The default suite keeps its parts: mining a repository and playing its tasks
# (test_env_mining.py), rl_composer.py --rl-env coding over generated tasks in the sandbox (test_agentic_learning.py)
@pytest.mark.slow
@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="no git")
def test_tiny_model_trains_over_mined_tasks_through_rl_composer(tmp_path, tokenizer_dir):
    from tests.unit.test_env_mining import _git_repo

    suite, logs, boxes = str(tmp_path / "suite" / "mathy.jsonl"), tmp_path / "logs", tmp_path / "boxes"
    assert load_tool("mine_tasks").main([str(_git_repo(tmp_path)), "--out", suite, "--max-tasks", "2"]) == 0
    mined = ["mathy-repo:mathy/__init__.py::add", "mathy-repo:mathy/__init__.py::mul"]
    weights = tmp_path / "weights.json"
    weights.write_text(json.dumps({"weights": {"communication": 0.3, "length": -0.002}}))
    flags = ["--rl-env", "coding", "--model", "tiny", "--tokenizer-model", tokenizer_dir, "--rl-prompts", suite,
             "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
             "--grpo-group-size", "2", "--grpo-prompts-per-step", "1", "--grpo-max-response-length", "16",
             "--grpo-kl-beta", "0", "--lr", "1e-3", "--train-iters", "5", "--rl-log-dir", str(logs),
             "--env-sandbox-dir", str(boxes), "--env-reward-weights", str(weights)]
    p = subprocess.run([sys.executable, "-W", "ignore", "rl_composer.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all 2 prompts of --rl-prompts trained once: stopping at iteration 2" in p.stdout
    assert "reward correctness" in p.stdout and "reward weights: step 0 takes" in p.stdout
    trained = [json.loads(line) for line in open(logs / "trained_groups.jsonl")]
    assert sorted(r["prompt_id"] for r in trained) == mined
    assert [r["step"] for r in trained] == [1, 2]
    tokenizer = build_tokenizer(None, tokenizer_dir)
    tasks = {t["id"]: t for t in read_coding_tasks(suite)}
    im_end = tokenizer.token_id(IM_END)
    rollouts = [json.loads(line) for line in open(logs / "rollouts.jsonl")]
    assert len(rollouts) == 2 * 2
    w = {**DEFAULT_WEIGHTS["weights"], "communication": 0.3, "length": -0.002}
    for r in rollouts:
        prompt = _prompt(tokenizer, tasks[r["prompt_id"]]["instruction"])
        assert r["token_ids"][:len(prompt)] == prompt
        # the model's turns: runs of mask 1 after the prompt, each closed by <|im_end|> unless cut at the budget
        mask = r["loss_mask"]
        assert mask[:len(prompt)] == [0] * len(prompt) and mask[len(prompt)] == 1
        runs, ids = [], r["token_ids"]
        for k in range(len(prompt), len(ids)):
            if mask[k] and (k == len(prompt) or not mask[k - 1]):
                runs.append([])
            if mask[k]:
                runs[-1].append(ids[k])
        assert 1 <= sum(map(len, runs)) <= 16 and all(run[-1] == im_end for run in runs[:-1])
        assert all(im_end not in run[:-1] for run in runs)
        assert r["finish_reason"] != "stop" or runs[-1][-1] == im_end
        assert all(lp <= 0 for lp, m in zip(r["logprobs"], mask) if m)
        assert r["versions"] == [r["step"] - 1 if m else -1 for m in mask]
        parts = r["reward_parts"]
        assert r["reward_error"] is None and parts["correctness"] == 0.0 and 0 <= parts["tests_fraction"] < 1
        # the tool-call penalties are reported (counts; random text rarely even forms a call) and nothing was edited
        assert all(parts[p] >= 0.0 for p in PENALTIES) and parts["forbidden_edits"] == 0.0
        assert r["reward"] == pytest.approx(sum(w[k] * v for k, v in parts.items()))  # the file's weights
    assert os.listdir(boxes) == []


class ChainEnv:
    """Restarts its episode once (self-summarisation): turn 1 closes the prompt [1, 2]'s sequence and [3, 4, 5]
    starts the next; turn 2 gets the observation [7]; turn 3 ends. Reward: the env's creation index (0, 1, ..)."""

    made = 0

    def __init__(self):
        self.index, ChainEnv.made = ChainEnv.made, ChainEnv.made + 1

    def reset(self, task):
        self.turns = 0
        return [1, 2]

    def step(self, model_tokens):
        from megatron_ext.env.token_env import StepResult

        self.turns += 1
        return {1: StepResult([3, 4, 5], False, restart=True), 2: StepResult([7], False)}.get(
            self.turns, StepResult([], True))

    def score(self):
        from megatron_ext.rl.types import Reward

        return Reward({"index": float(self.index)}, float(self.index))


def _counting_generate(prompts, n, sampling):
    """Answers two tokens, both the context's length + 20."""
    return [[Sample([20 + len(p)] * 2, [-0.5] * 2, [-0.5] * 2, [0] * 2, "stop") for _ in range(n)] for p in prompts]


def test_self_summarisation_chains_are_sequences_sharing_the_episode_reward():
    from megatron_ext.rl.ledger import group_from_json, group_to_json

    ChainEnv.made = 0
    [group] = run_groups([{"id": "a"}], ChainEnv, _counting_generate, EpisodeConfig(2, Sampling(max_tokens=4),
                                                                                     max_turns=5, max_response_length=16))
    assert [(r.sample_index, r.sequence_index) for r in group.rollouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    first, second = group.rollouts[:2]
    assert first.token_ids == [1, 2, 22, 22] and first.per_token()["loss_mask"].tolist() == [0, 0, 1, 1]
    # the next sequence starts from the environment's new prompt; its turns see only this sequence's context
    assert second.token_ids == [3, 4, 5, 23, 23, 7, 26, 26]
    assert second.per_token()["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert group.rewards == [0.0, 0.0, 1.0, 1.0] and group.advantages == [-0.5, -0.5, 0.5, 0.5]
    assert group.episode_rewards().tolist() == [0.0, 1.0]
    assert group.episode_sums([1, 2, 3, 4]).tolist() == [3.0, 7.0]  # k1 of an episode: summed over its chain
    back = group_from_json(json.loads(json.dumps(group_to_json(group))))
    assert [r.sequence_index for r in back.rollouts] == [0, 1, 0, 1] and back.advantages == group.advantages
    # turns count over the whole episode: two turns allowed end it in the second sequence
    [cut] = run_groups([{"id": "a"}], ChainEnv, _counting_generate, EpisodeConfig(1, Sampling(max_tokens=4),
                                                                                   max_turns=2, max_response_length=16))
    assert [r.finish_reason for r in cut.rollouts] == ["stop", "length"]
    assert cut.rollouts[1].token_ids == [3, 4, 5, 23, 23]


def test_a_failing_sampler_leaves_no_sandbox_behind(tmp_path, tokenizer_dir):
    tokenizer = build_tokenizer(None, tokenizer_dir)
    boxes = tmp_path / "boxes"
    factory = CodingEnvFactory(_env_args(["--env-sandbox-dir", str(boxes)]), tokenizer, log=lambda *a: None)

    def broken(prompts, n, sampling):
        assert len(os.listdir(boxes)) == 2  # both episodes' sandboxes exist while sampling
        raise RuntimeError("the sampler died")

    with pytest.raises(RuntimeError, match="the sampler died"):
        run_groups(read_coding_tasks(_suite(str(tmp_path), 1)), factory, broken, EpisodeConfig(2, Sampling(8)))
    assert os.listdir(boxes) == []


class SlowEnv:
    """Two turns, then done; each call sleeps 50 ms and is logged (env index, call) so that overlap and each
    episode's own order can be checked. Reward: the sum of the model's tokens (so results depend on the samples)."""

    lock, active, most, made = None, 0, 0, []
    fail_at = None  # (env index, turn) whose step raises

    def __init__(self):
        self.index, self.calls, self.tokens = len(SlowEnv.made), [], 0
        SlowEnv.made.append(self)

    def _enter(self, call):
        import time

        with SlowEnv.lock:
            SlowEnv.active += 1
            SlowEnv.most = max(SlowEnv.most, SlowEnv.active)
        self.calls.append(call)
        time.sleep(0.05)
        with SlowEnv.lock:
            SlowEnv.active -= 1

    def reset(self, task):
        self._enter("reset")
        self.turns = 0
        return [1, 2]

    def step(self, model_tokens):
        from megatron_ext.env.token_env import StepResult

        self._enter(f"step{self.turns}")
        self.turns += 1
        self.tokens += sum(model_tokens)
        if SlowEnv.fail_at == (self.index, self.turns):
            raise RuntimeError(f"tool of episode {self.index} crashed")
        return StepResult([7], False) if self.turns < 2 else StepResult([], True)

    def score(self):
        from megatron_ext.rl.types import Reward

        self._enter("score")
        return Reward({"tokens": float(self.tokens)}, float(self.tokens))

    def close(self):
        self.calls.append("close")


def _slow_factory(workers):
    import threading

    SlowEnv.lock, SlowEnv.active, SlowEnv.most, SlowEnv.made, SlowEnv.fail_at = threading.Lock(), 0, 0, [], None

    def make_env():
        return SlowEnv()

    make_env.concurrency = workers
    return make_env


def test_environment_calls_of_different_episodes_overlap_and_give_the_serial_groups():
    """run_groups runs reset/step/score of different episodes `make_env.concurrency` at a time: the groups are the
    ones serial calls give (samples depend on the context, rewards on the samples), each episode's calls stay in
    order, and no more than that many run at once."""
    import time

    tasks = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    cfg = EpisodeConfig(4, Sampling(max_tokens=4), max_turns=5, max_response_length=16)
    results = {}
    for workers in (1, 4):
        factory = _slow_factory(workers)
        start = time.monotonic()
        groups = run_groups(tasks, factory, _counting_generate, cfg)
        results[workers] = (time.monotonic() - start, SlowEnv.most, groups, [e.calls for e in SlowEnv.made])
    serial, parallel = results[1], results[4]
    assert serial[1] == 1 and parallel[1] == 4  # 12 episodes: the pool fills up, and never beyond its size
    assert [[(r.token_ids, r.reward.total, r.finish_reason) for r in g.rollouts] for g in parallel[2]] == \
        [[(r.token_ids, r.reward.total, r.finish_reason) for r in g.rollouts] for g in serial[2]]
    assert all(calls == ["reset", "step0", "step1", "score"] for calls in parallel[3])
    # 12 episodes x 4 calls x 50 ms: 2.4 s one after another, a quarter of it four at a time (loose bound: CI)
    assert serial[0] > 2.3 and parallel[0] < serial[0] * 0.6


def test_a_failing_environment_call_raises_after_the_others_returned_and_closes_every_episode():
    factory = _slow_factory(4)
    SlowEnv.fail_at = (2, 1)  # episode 2's first step
    with pytest.raises(RuntimeError, match="tool of episode 2 crashed"):
        run_groups([{"id": "a"}, {"id": "b"}], factory, _counting_generate,
                   EpisodeConfig(3, Sampling(max_tokens=4), max_turns=5, max_response_length=16))
    assert SlowEnv.active == 0  # nothing still running in a pool thread when the error surfaced
    assert len(SlowEnv.made) == 6 and all(e.calls[-1] == "close" for e in SlowEnv.made)
    assert all(e.calls[:2] == ["reset", "step0"] for e in SlowEnv.made)  # the turn's other steps ran to the end


def test_concurrent_coding_episodes_in_sandboxes_score_like_serial_ones(tmp_path, tokenizer_dir):
    """Oracle episodes of three tasks, two each, with --env-concurrency 4: every episode correct, its transcript
    the oracle's, and every sandbox removed; the swarm factory keeps one call at a time; 0 is refused."""
    tokenizer = build_tokenizer(None, tokenizer_dir)
    tasks = read_coding_tasks(_suite(str(tmp_path), 3))
    boxes = tmp_path / "boxes"
    factory = CodingEnvFactory(_env_args(["--env-sandbox-dir", str(boxes), "--env-concurrency", "4"]), tokenizer,
                               log=lambda *a: None)
    assert factory.concurrency == 4 and _env_args([]).env_concurrency == 8
    gen = OracleGenerate(tokenizer, tasks[0]["instruction"])
    cfg = EpisodeConfig(2, Sampling(max_tokens=512, stop_token_ids=factory.stop_token_ids), max_turns=12,
                        max_response_length=8192)
    groups = run_groups(tasks, factory, gen, cfg)
    assert [g.prompt_id for g in groups] == [t["id"] for t in tasks]
    for group in groups:
        assert len(group.rollouts) == 2
        for rollout in group.rollouts:
            assert rollout.reward.error is None and rollout.reward.parts["correctness"] == 1.0
            model = [tok for tok, m in zip(rollout.token_ids, rollout.per_token()["loss_mask"]) if m]
            assert model == [tok for turn in gen.turns for tok in turn]
    assert os.listdir(boxes) == []
    with pytest.raises(ValueError, match="--env-concurrency must be positive"):
        CodingEnvFactory(_env_args(["--env-concurrency", "0"]), tokenizer, log=lambda *a: None)
