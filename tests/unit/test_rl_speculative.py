"""Speculative rollouts (--rl-speculative): EngineGenerate decoding with MTP drafts is lossless and keeps every
token's logprobs, versions and routing; the trainer logs the acceptance each step."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.inference.engine import sampling_probs
from megatron_ext.rl.arguments import add_rl_args, validate_rl_args
from megatron_ext.rl.rollout import EngineGenerate, Sampling
from tests.unit.inference_fixtures import engine, uncached_logits  # noqa: F401 - the module fixture

PROMPTS = [[1, 2, 3, 4], [40, 50, 60], [7, 7, 7, 7, 7]]


@pytest.mark.parametrize("drafts", ["mtp", "oracle"])
def test_greedy_speculative_rollouts_are_the_plain_ones(engine, monkeypatch, drafts):  # noqa: F811
    """The tiny model's untrained MTP layer drafts badly (every draft rejected); an oracle drafting the plain
    continuation gets drafts accepted, so the tokens, logprobs and routing of accepted drafts are checked too."""
    from megatron_ext.inference import speculative_batch

    eng, _ = engine
    sampling = Sampling(max_tokens=10, temperature=0.0, stop_token_ids=(5,), return_routing=True)
    plain = EngineGenerate(eng)(PROMPTS, 2, sampling)
    if drafts == "oracle":
        whole = {tuple(p): p + g[0].token_ids for p, g in zip(PROMPTS, plain)}

        def oracle(self):  # each active row's plain continuation as its drafts
            drafts = []
            for r in self.active:
                seq = next(w for p, w in whole.items() if tuple(self.tokens[r][: len(p)]) == p)
                L = len(self.tokens[r])
                drafts.append([seq[k] if k < len(seq) else 0 for k in range(L, L + self.depth)])
            return drafts, [[None] * self.depth for _ in self.active]

        monkeypatch.setattr(speculative_batch._Rows, "_draft", oracle)
    gen = EngineGenerate(eng, speculative=True)
    spec = gen(PROMPTS, 2, sampling)
    for gs, gp in zip(spec, plain):
        for a, b in zip(gs, gp):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert a.sampled_logprobs == b.sampled_logprobs == [0.0] * len(a.token_ids)
            assert a.versions == b.versions == [eng.weights_version] * len(a.token_ids)
            assert a.routing.dtype == np.int16 and np.array_equal(a.routing, b.routing)
    counts = gen.pop_speculation()
    tokens = sum(len(s.token_ids) for g in spec for s in g)
    assert counts["tokens"] == tokens and counts["drafted"] > 0 and counts["accepted"] <= counts["drafted"]
    if drafts == "oracle":  # every draft inside the continuation is right; rounds emit two tokens
        assert counts["accepted"] >= counts["drafted"] - 6
        assert counts["main_forwards"] <= tokens // 2 + 3 * 6
    assert gen.pop_speculation() == {"drafted": 0, "accepted": 0, "main_forwards": 0, "tokens": 0}


def test_sampled_speculative_rollouts_carry_the_main_models_logprobs(engine):  # noqa: F811
    eng, model = engine
    sampling = Sampling(max_tokens=8, temperature=0.9, top_k=30, seed=21)
    gen = EngineGenerate(eng, speculative=True)
    groups = gen(PROMPTS, 3, sampling)
    assert [[s.token_ids for s in g] for g in gen(PROMPTS, 3, sampling)] == [[s.token_ids for s in g] for g in groups]
    params = dataclasses.replace(_params(sampling))
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(s.token_ids) for s in group}) > 1  # sample j draws with its own seed
        for s in group:
            logits = uncached_logits(model, prompt + s.token_ids)[len(prompt) - 1: -1]
            raw = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            assert s.logprobs == pytest.approx(raw.tolist(), abs=1e-5)  # what the trainer recomputes
            q = sampling_probs(logits, params).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0].log()
            assert s.sampled_logprobs == pytest.approx(q.tolist(), abs=1e-5)
    assert gen.pop_speculation()["drafted"] > 0


def _params(sampling):
    from megatron_ext.inference.engine import SamplingParams

    return SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p)


@pytest.fixture(scope="module")
def engine_mtp2(engine):  # noqa: F811
    """The tiny preset with two MTP layers (under the same one-rank process groups)."""
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.step import build_model

    args = parse_args(["--model", "tiny", "--mock-data", "--mtp-num-layers", "2"], world_size=1)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=8))[0]
    model.eval()
    return InferenceEngine(model)


BATCH_PROMPTS = [[1, 2, 3, 4], [40, 50, 60], [7, 7, 7, 7, 7, 9, 9]]


@pytest.mark.parametrize("model, depth", [("mtp1", 1), ("mtp2", 1), ("mtp2", 2)])
@pytest.mark.parametrize("kind", ["greedy with a stop id", "top-k", "temperature 1"])
def test_batched_speculation_equals_one_sample_at_a_time(engine, engine_mtp2, model, depth, kind):  # noqa: F811
    """Every row of the batched speculative decoder draws exactly what inference/speculative.py draws for that
    sample alone with the same seed (tokens, logprobs, routing), drafts checked and accepted included."""
    from megatron_ext.inference.engine import SamplingParams
    from megatron_ext.inference.speculative import SpeculationStats, generate_speculative
    from megatron_ext.inference.speculative_batch import generate_speculative_groups

    eng = engine[0] if model == "mtp1" else engine_mtp2
    params = {"greedy with a stop id": SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(5,)),
              "top-k": SamplingParams(max_tokens=9, temperature=0.9, top_k=30, seed=21),
              "temperature 1": SamplingParams(max_tokens=12, temperature=1.0, seed=3)}[kind]
    params = dataclasses.replace(params, return_routing=True)
    batched, alone = SpeculationStats(), SpeculationStats()
    groups = generate_speculative_groups(eng, BATCH_PROMPTS, 3, params, batched, depth)
    for prompt, group in zip(BATCH_PROMPTS, groups):
        assert [c.prompt_ids for c in group] == [prompt] * 3
        for j, c in enumerate(group):
            seed = None if params.seed is None else params.seed + j
            want = generate_speculative(eng, prompt, dataclasses.replace(params, seed=seed), alone, depth)
            assert c.token_ids == want.token_ids and c.finish_reason == want.finish_reason
            assert c.logprobs == pytest.approx(want.logprobs, abs=1e-5)
            assert c.sampled_logprobs == pytest.approx(want.sampled_logprobs, abs=1e-5)
            assert torch.equal(c.routing, want.routing)
    assert (batched.drafted, batched.accepted, batched.tokens) == (alone.drafted, alone.accepted, alone.tokens)
    assert batched.checked_by_depth == alone.checked_by_depth and 1 <= len(batched.checked_by_depth) <= depth
    if kind == "temperature 1":
        assert batched.accepted > 0  # the accepting branch ran


@pytest.mark.parametrize("case", ["cannot-pay", "pays"])
def test_speculative_rollouts_step_aside_per_batch_size(engine, case, caplog):  # noqa: F811
    """Issue 32 item 3, batched. Costs measured per batch-size bucket (here given for the bucket of 6 rows: 8):
    where drafting cannot pay at that size, `speculation_policy="auto"` decodes the call plainly (the very tokens,
    nothing drafted) and logs one line naming the batch; where it pays, the call drafts (lossless). A pop starts
    acceptance over, so a later step probes again."""
    from megatron_ext.inference.speculative import DraftCosts, batch_bucket

    eng, _ = engine
    assert [batch_bucket(n) for n in (1, 2, 3, 6, 8, 9, 500)] == [1, 2, 4, 8, 8, 16, 64]
    costs = {"cannot-pay": DraftCosts(main=1.0, verify=1.6, draft=0.5),
             "pays": DraftCosts(main=1.0, verify=1.1, draft=0.1)}[case]
    sampling = Sampling(max_tokens=8, temperature=0.0, return_routing=True)
    plain = EngineGenerate(eng)(PROMPTS, 2, sampling)
    saved = dict(eng.draft_costs), dict(eng.speculation_decisions)
    eng.draft_costs[(1, 8, "batched")] = costs
    eng.speculation_decisions.clear()
    try:
        gen = EngineGenerate(eng, speculative=True, speculation_policy="auto")
        with caplog.at_level("INFO", logger="megatron_ext.inference.speculative"):
            spec = gen(PROMPTS, 2, sampling)
    finally:
        eng.draft_costs, eng.speculation_decisions = saved
    for gs, gp in zip(spec, plain):
        for a, b in zip(gs, gp):
            assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert np.array_equal(a.routing, b.routing)
    lines = [r.getMessage() for r in caplog.records if "speculative decoding at batch 8" in r.getMessage()]
    assert len(lines) == 1
    counts = gen.pop_speculation()
    if case == "pays":
        assert "on:" in lines[0] and counts["drafted"] > 0
    else:
        assert "off (decoding plainly)" in lines[0] and counts["drafted"] == 0 and counts["tokens"] == 0
    with pytest.raises(ValueError, match="policy"):
        EngineGenerate(eng, speculative=True, speculation_policy="sometimes")


def test_a_model_without_mtp_layers_is_refused(engine):  # noqa: F811
    eng, _ = engine

    class NoMTP:
        mtp_layers = []

    with pytest.raises(ValueError, match="MTP layers"):
        EngineGenerate(NoMTP(), speculative=True)
    assert EngineGenerate(eng).pop_speculation()["drafted"] == 0


@pytest.mark.parametrize("flags, words", [
    (["--mtp-num-layers", "0", "--rl-speculative"], "needs --mtp-num-layers >= 1"),
    (["--rl-speculative-depth", "1"], "needs --rl-speculative"),
    (["--rl-speculative", "--rl-speculative-depth", "2"], "between 1 and --mtp-num-layers (1)"),
    (["--rl-speculative-policy", "always"], "needs --rl-speculative"),
    (["--rl-speculative", "--rl-speculative-policy", "auto", "--rl-remote-servers", "http://127.0.0.1:1",
      "--rl-remote-weights-dir", "/tmp/w"],
     "serve.py --speculation"),
])
def test_speculative_flags_are_checked(flags, words):
    args = parse_args(["--model", "tiny", "--mock-data", "--rl-prompts", "x.jsonl", *flags], world_size=1,
                      extra=[add_rl_args])
    with pytest.raises(ArgumentError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate_rl_args(args)


def test_rl_run_logs_the_acceptance_every_step(tmp_path):
    """Two tensor-parallel ranks (one generation replica) with routing replay: the step's acceptance in the log line
    and TensorBoard, the sampler's routing and log-probabilities still those the trainer recomputes."""
    from tests.unit.test_rl_composer import TINY, _prompts, _run

    logs = str(tmp_path / "logs")
    tb = str(tmp_path / "tb")
    p = _run(TINY + ["--rl-prompts", _prompts(tmp_path, 4), "--rl-log-dir", logs, "--train-iters", "2",
                     "--rl-speculative", "--rl-speculative-policy", "always", "--tensorboard-dir", tb,
                     "--grpo-max-response-length", "12",
                     "--tensor-model-parallel-size", "2", "--sequence-parallel", "--rl-routing-replay"], nproc=2)
    lines = [line for line in p.stdout.splitlines() if " iteration " in line and "mtp acceptance" in line]
    assert len(lines) == 2, p.stdout[-2000:]

    def value(line, key):
        return float(line.split(f"{key}: ")[1].split(" ")[0])

    for line in lines:
        assert 0.0 <= value(line, "mtp acceptance") <= 1.0 and value(line, "mtp tokens per forward") >= 1.0
        assert value(line, "routing replay agreement") > 0.99  # the experts the trainer's routers would choose
        assert value(line, "mismatch_max") < 1e-4  # sampler and trainer log-probabilities agree
    with open(os.path.join(logs, "trained_groups.jsonl")) as f:
        trained = [json.loads(x) for x in f]
    assert len(trained) == 4  # the rollouts were trained on as usual
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    assert [e.step for e in events.Scalars("mtp acceptance")] == [1, 2]
