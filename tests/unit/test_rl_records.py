"""RL records, the digit environment, episodes with a fake sampler, packing and the exactly-once ledger."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatron_ext.rl import env as E
from megatron_ext.rl.batch import micro_batches
from megatron_ext.rl.ledger import Ledger, group_from_json, group_to_json, trained_counts
from megatron_ext.rl.rollout import EpisodeConfig, Sampling, reference_groups, run_groups
from megatron_ext.rl.types import Sample, TrainingSample


def fake_generate(answers: dict):
    """A sampler that answers each prompt from `answers` (by prompt tokens), logprob -0.5 per token, and records
    the calls it got."""
    calls = []

    def generate(prompts, n, sampling):
        calls.append((len(prompts), n, sampling.seed))
        out = []
        for p in prompts:
            group = []
            for j in range(n):
                ids = answers(p, j)[: sampling.max_tokens]
                finish = "stop" if E.VOCAB.eos in ids else "length"
                group.append(Sample(ids, [-0.5] * len(ids), [-0.4] * len(ids), [3] * len(ids), finish,
                                    np.full((len(p) + len(ids), 2, 2), j, np.int16)))
            out.append(group)
        return out

    return generate, calls


def test_digit_tasks_are_deterministic_and_heldout_is_disjoint():
    a, b = E.digit_tasks("train", 50, seed=3), E.digit_tasks("train", 50, seed=3)
    assert a == b and len({t["id"] for t in a}) == 50
    held = E.digit_tasks("heldout", 40, seed=3)
    pool = {(t["op"], t["input"]) for t in E.digit_tasks("train", 20_000, seed=3, min_len=2, max_len=3)}
    assert len(pool) > 1500  # nearly all of the 2 x 1100 short pairs, minus the held-out tenth
    assert not {(t["op"], t["input"]) for t in held} & pool
    assert all(E.is_heldout(t["op"], t["input"]) for t in held)
    assert {len(t["input"]) for t in held} == {3, 4, 5, 6}  # the same lengths as training, not only rare ones
    for t in a:
        assert t["answer"] == E.OPS[t["op"]](t["input"])


def test_one_digit_ops_answer_by_rule_and_keep_earlier_token_ids():
    tasks = E.digit_tasks("train", 400, seed=5, ops=["max", "min", "first", "last"], min_len=5, max_len=8)
    expect = {"max": lambda s: str(max(int(c) for c in s)), "min": lambda s: str(min(int(c) for c in s)),
              "first": lambda s: s[0], "last": lambda s: s[-1]}
    assert {t["op"] for t in tasks} == set(expect) and {len(t["input"]) for t in tasks} == {5, 6, 7, 8}
    for t in tasks:
        assert t["answer"] == expect[t["op"]](t["input"]) and not E.is_heldout(t["op"], t["input"])
    # the sequence ops and digits keep their ids (checkpoints of the earlier tasks stay valid); all ids < 32
    assert E.VOCAB.items[4:17] == ["reverse", "sort", "copy"] + [str(d) for d in range(10)] and len(E.VOCAB) <= 32
    t = {"op": "max", "input": "30871", "answer": "8"}
    assert E.prompt_tokens(t) == [E.VOCAB.bos, E.VOCAB.ids["max"], 10, 7, 15, 14, 8, E.VOCAB.eq]
    env = E.DigitEnv()
    env.reset(t)
    env.step(E.answer_tokens(t))
    assert env.score().parts["exact"] == 1.0
    env.reset(t)
    env.step(E.VOCAB.encode_digits("87") + [E.VOCAB.eos])  # an extra digit is wrong
    assert env.score().parts["exact"] == 0.0
    assert E.digit_tasks("train", 5, seed=5) == E.digit_tasks("train", 5, seed=5, ops=E.DEFAULT_OPS)
    with pytest.raises(ValueError, match="unknown digit op 'mean'"):
        E.digit_tasks("train", 1, ops=["mean"])


def test_rubric_scores_parts_and_records_a_failing_reward():
    task = {"id": "x", "op": "reverse", "input": "123", "answer": "321"}
    right = E.VOCAB.encode_digits("321") + [E.VOCAB.eos]
    wrong = E.VOCAB.encode_digits("331") + [E.VOCAB.eos]
    rubric = E.Rubric(E.DIGIT_REWARDS, {"exact": 1.0, "char_accuracy": 0.5})
    assert rubric.score(task, right).total == pytest.approx(1.5)
    r = rubric.score(task, wrong)
    assert r.parts == {"exact": 0.0, "char_accuracy": pytest.approx(2 / 3)} and r.total == pytest.approx(1 / 3)

    def broken(task, tokens):
        raise KeyError("boom")

    failing = E.Rubric({"exact": E.exact, "broken": broken}, {"exact": 1.0, "broken": 1.0})
    r = failing.score(task, right)
    assert r.total == 0.0 and "broken: KeyError" in r.error
    with pytest.raises(ValueError, match="unknown parts"):
        E.Rubric(E.DIGIT_REWARDS, {"nope": 1.0})
    assert E.parse_weights("exact=1, char_accuracy=0.2") == {"exact": 1.0, "char_accuracy": 0.2}


def test_episodes_keep_sampler_tokens_and_score_groups():
    tasks = E.digit_tasks("train", 3, seed=1)
    by_prompt = {tuple(E.prompt_tokens(t)): t for t in tasks}

    def answers(prompt, j):  # sample 0 right, the others wrong
        t = by_prompt[tuple(prompt)]
        return E.answer_tokens(t) if j == 0 else E.VOCAB.encode_digits("9" * len(t["answer"])) + [E.VOCAB.eos]

    gen, calls = fake_generate(answers)
    groups = run_groups(tasks, E.DigitEnv, gen, EpisodeConfig(4, Sampling(max_tokens=10, seed=5)))
    assert calls == [(3, 4, 5)]  # one call: all prompts, G samples each
    for t, g in zip(tasks, groups):
        assert g.prompt_id == t["id"]
        expected = [1.0] + [float(t["answer"] == "9" * len(t["answer"]))] * 3
        assert g.rewards == expected
        r0 = g.rollouts[0]
        flat = r0.per_token()
        assert flat["token_ids"].tolist() == E.prompt_tokens(t) + E.answer_tokens(t)
        assert flat["loss_mask"].tolist() == [0.0] * len(E.prompt_tokens(t)) + [1.0] * len(E.answer_tokens(t))
        assert flat["versions"].tolist() == [-1] * len(E.prompt_tokens(t)) + [3] * len(E.answer_tokens(t))
        assert g.advantages == pytest.approx(list(np.array(expected) - np.mean(expected)))
        assert r0.routing.shape == (len(flat["token_ids"]), 2, 2)


class TwoTurnEnv:
    """Asks twice: the observation after the first answer is [7, 7]; reward = number of model tokens."""

    def reset(self, task):
        self.turns, self.tokens = 0, []
        return [1, 2]

    def step(self, model_tokens):
        self.turns += 1
        self.tokens += model_tokens
        return E.StepResult([7, 7], False) if self.turns < 2 else E.StepResult([], True)

    def score(self):
        return E.Reward({"n": float(len(self.tokens))}, float(len(self.tokens)))


def test_multi_turn_appends_turns_to_one_sequence():
    gen, calls = fake_generate(lambda p, j: [10 + len(p)] * 2)
    groups = run_groups([{"id": "a"}], TwoTurnEnv, gen, EpisodeConfig(2, Sampling(max_tokens=4, seed=0), max_turns=3))
    r = groups[0].rollouts[1]
    # prompt, turn 1 (generated after 2 prompt tokens), observation, turn 2 (after 6 context tokens)
    assert r.token_ids == [1, 2, 12, 12, 7, 7, 16, 16]
    assert r.per_token()["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert r.finish_reason == "length" and r.reward.total == 4.0
    assert calls[0] == (1, 2, 0) and [c[:2] for c in calls[1:]] == [(1, 1), (1, 1)]


class GrowingEnv(TwoTurnEnv):
    """Never finishes on its own: each observation is 5 tokens, so the context fills up."""

    def step(self, model_tokens):
        self.turns += 1
        self.tokens += model_tokens
        return E.StepResult([7] * 5, False)


def test_multi_turn_sequence_ends_when_the_context_is_full():
    """Observations grow a sequence past what the generator holds: each turn asks for at most the room left, and the
    sequence ends ("length") when no room is left, instead of a request the engine refuses (which crashed RL)."""
    gen, calls = fake_generate(lambda p, j: [10 + len(p)] * 4)
    asked = []

    def limited(prompts, n, sampling):
        assert all(len(p) + sampling.max_tokens <= 20 for p in prompts), (prompts, sampling.max_tokens)
        asked.append([len(p) + sampling.max_tokens for p in prompts])
        return gen(prompts, n, sampling)

    limited.max_sequence_length = 20
    groups = run_groups([{"id": "a"}], GrowingEnv, limited, EpisodeConfig(1, Sampling(max_tokens=4, seed=0),
                                                                           max_turns=10, max_response_length=100))
    r = groups[0].rollouts[0]
    # prompt 2 + 4 generated, +5 observed, +4, +5 = 20: full, so the sequence ends there after turn 2's observation
    assert len(r.token_ids) <= 20 and r.finish_reason == "length"
    assert r.per_token()["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert max(max(a) for a in asked) <= 20


def test_packing_aligns_labels_and_per_token_fields():
    tasks = E.digit_tasks("train", 2, seed=0)
    groups = reference_groups(tasks, E.DigitEnv)
    samples = [TrainingSample.from_rollout(g.rollouts[0], 0.25 * (i + 1), i) for i, g in enumerate(groups)]
    weights = [s.loss_mask * 10 for s in samples]
    mbs = micro_batches(samples, weights, seq_length=32, micro_batch_size=1, pad_id=0, num_microbatches=2,
                        global_ids=[5, 6])
    assert len(mbs) == 2
    row = {k: v[0] for k, v in mbs[0].items()}
    n = samples[0].positions
    assert row["tokens"][:n].tolist() == samples[0].token_ids[:-1].tolist()
    assert row["labels"][:n].tolist() == samples[0].token_ids[1:].tolist()
    assert row["loss_mask"][:n].tolist() == samples[0].loss_mask[1:].tolist()
    assert row["agg_weight"][:n].tolist() == (samples[0].loss_mask[1:] * 10).tolist()
    assert set(row["sample_ids"][:n].tolist()) == {5} and set(row["sample_ids"][n:2 * n + 2].tolist()) <= {6, -1}
    assert row["advantage"][0] == 0.25
    cu = row["cu_seqlens"][row["cu_seqlens"] >= 0].tolist()
    assert cu[0] == 0 and cu[-1] == 32 and n in cu
    # two micro-batches wanted, one row's worth of samples: the row is split so both micro-batches train
    assert [float(mb["loss_mask"].sum()) for mb in mbs] == [float(s.loss_mask[1:].sum()) for s in samples]
    one = micro_batches(samples, weights, seq_length=32, micro_batch_size=1, pad_id=0, global_ids=[5, 6])
    assert len(one) == 1 and one[0]["sample_ids"][0].tolist().count(6) == samples[1].positions
    with pytest.raises(ValueError, match="--seq-length"):
        micro_batches(samples, weights, seq_length=4, micro_batch_size=1, pad_id=0)


def test_ledger_state_round_trip_and_log_reconcile(tmp_path):
    tasks = E.digit_tasks("train", 5, seed=0)
    ids = [t["id"] for t in tasks]
    led = Ledger(ids, str(tmp_path))
    assert led.admit(2) == ids[:2]
    groups = reference_groups(tasks[:2], E.DigitEnv)
    led.finish(groups[0])  # the second stays in flight, the first is pending
    state = json.loads(json.dumps(led.state_dict()))  # what goes into the checkpoint must be plain data
    again = Ledger(ids, str(tmp_path))
    again.load_state_dict(state)
    assert again.cursor == 2 and again.in_flight == [ids[1]]
    assert group_to_json(again.pending[0]) == group_to_json(groups[0])
    assert again.admit(2) == [ids[1], ids[2]]  # the in-flight prompt is generated again, first
    # logs: steps after the checkpoint are dropped on resume, as is a torn last line
    led.log_trained(1, groups[:1])
    led.log_trained(2, groups[1:])
    with open(os.path.join(tmp_path, "trained_groups.jsonl"), "a") as f:
        f.write('{"prompt_id": "torn')
    with open(os.path.join(tmp_path, "eval.jsonl"), "w") as f:
        f.write('{"iteration": 0}\n{"iteration": 1}\n{"iteration": 2}\n')
    assert led.reconcile(1) == {"trained_groups.jsonl": 2, "eval.jsonl": 1}
    assert trained_counts(str(tmp_path)) == {ids[0]: 1}
    # a fresh start (killed before the first checkpoint) keeps nothing: iteration 0 is evaluated again
    assert led.reconcile(0) == {"trained_groups.jsonl": 1, "eval.jsonl": 2}
    assert trained_counts(str(tmp_path)) == {} and open(os.path.join(tmp_path, "eval.jsonl")).read() == ""
    with pytest.raises(ValueError, match="same prompt file"):
        Ledger(ids[:3]).load_state_dict(state)
    rt = group_from_json(group_to_json(groups[1]))
    assert rt.rollouts[0].token_ids == groups[1].rollouts[0].token_ids


def test_prompt_file_errors_name_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "op": "copy", "input": "1", "answer": "1"}\n{"id": "a", "op": "copy", "input": "2", '
                 '"answer": "2"}\n')
    with pytest.raises(ValueError, match="p.jsonl:2: duplicate prompt id 'a'"):
        E.read_prompts(str(p))
