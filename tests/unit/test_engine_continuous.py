"""Continuous batching (`InferenceEngine.continuous`, issue 29): requests join a running decode batch between
steps and return as soon as their own rows finish; each request's samples, log-probabilities and routing are the
ones it draws alone, also across an in-flight weight swap and on the Kimi Linear hybrid (KDA states)."""

import dataclasses

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams, model_weights
from megatron_ext.training.initialize import destroy, initialize_distributed
from tests.unit.test_engine_rl import _model, _prompt, _teacher_forced


@pytest.fixture(scope="module")
def models():
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    yield _model(args, 3), _model(args, 4)
    destroy()


def _same(got, want):
    """Two request results ([prompt][sample] completions) are the same samples."""
    assert [len(g) for g in got] == [len(g) for g in want]
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.prompt_ids == b.prompt_ids and a.token_ids == b.token_ids
            assert a.finish_reason == b.finish_reason and a.versions == b.versions
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert a.sampled_logprobs == pytest.approx(b.sampled_logprobs, abs=1e-5)
            if b.routing is not None:
                assert torch.equal(a.routing, b.routing)


def _drive(batch, joins: dict[int, tuple], steps_max: int = 200):
    """Step `batch`, adding joins[s] = (prompts, n, params) before step s; (results by request, the step each
    finished at, the rows decoding at each step)."""
    ids, results, at, rows = {}, {}, {}, []
    for s in range(steps_max):
        if s in joins:
            ids[batch.add(*joins[s])] = s
        if not batch.decoding and len(ids) == len(joins):
            break
        rows.append(batch.decoding)
        for rid, out in batch.step().items():
            results[ids[rid]], at[ids[rid]] = out, s
    return results, at, rows


def test_a_request_joins_mid_batch_decodes_with_it_and_returns_when_its_own_rows_finish(models):
    served, _ = models
    eng = InferenceEngine(served)
    long = ([_prompt(1, 5), _prompt(2, 9)], 2, SamplingParams(max_tokens=14, temperature=1.0, seed=5,
                                                               return_routing=True))
    short = ([_prompt(3, 3)], 3, SamplingParams(max_tokens=4, temperature=0.0, return_routing=True))
    late = ([_prompt(4, 6), _prompt(5, 2)], [1, 2],
            [SamplingParams(max_tokens=3, temperature=0.7, top_k=20, seed=9),
             SamplingParams(max_tokens=5, temperature=1.3, top_p=0.9, seed=11)])
    alone = {0: eng.generate_groups(*long), 3: eng.generate_groups(*short), 6: eng.generate_groups(*late)}
    results, at, rows = _drive(eng.continuous(), {0: long, 3: short, 6: late})
    for s in alone:
        _same(results[s], alone[s])
    # the short request joined at step 3 and left 4 tokens later, while the long one kept decoding
    assert at[3] == 3 + 4 - 1 and at[0] == 13 and at[6] < at[0]
    # it decoded in the same steps as the long request's rows: 4 rows, then 4 + 3, then + 1 + 2
    assert rows[:3] == [4, 4, 4] and rows[3:6] == [7, 7, 7] and rows[6] == 10


def test_a_swap_between_steps_re_encodes_every_request_in_flight(models):
    served, other = models
    eng = InferenceEngine(served, weights_version=1)
    new_weights = {k: v.clone() for k, v in model_weights(other).items()}
    old_weights = {k: v.clone() for k, v in model_weights(served).items()}
    calls = []

    def between_steps():
        calls.append(1)
        if len(calls) == 3:
            eng.update_weights(new_weights.items(), version=2)
            return True
        return False

    eng.between_steps = between_steps
    first = ([[5, 9, 13, 2]], 1, SamplingParams(max_tokens=8, temperature=1.0, seed=1))
    second = ([[7, 1]], 2, SamplingParams(max_tokens=5, temperature=1.0, seed=2))
    try:
        results, _, _ = _drive(eng.continuous(), {0: first, 2: second})
    finally:
        eng.between_steps = None
        eng.update_weights(old_weights.items(), version=1)
    # the swap came before the third forward: tokens 1-3 of the first request were drawn by version 1; the
    # second request joined at step 2 and drew one token with version 1
    (c,), = results[0]
    assert c.versions == [1, 1, 1] + [2] * 5
    for j, s in enumerate(results[2][0]):
        assert s.versions == [1] + [2] * 4, j
    for c in [results[0][0][0]] + results[2][0]:
        ids = c.prompt_ids + c.token_ids
        n, k = len(c.prompt_ids), c.versions.count(1)
        assert c.logprobs[:k] == pytest.approx(_teacher_forced(served, ids)[0][n - 1: n - 1 + k].tolist(), abs=1e-5)
        assert c.logprobs[k:] == pytest.approx(_teacher_forced(other, ids)[0][n - 1 + k:].tolist(), abs=1e-5)


def test_weights_changed_outside_the_hook_and_bad_requests_are_refused_without_harm(models):
    served, other = models
    eng = InferenceEngine(served, weights_version=1)
    batch = eng.continuous()
    params = SamplingParams(max_tokens=6, temperature=0.0, return_routing=True)  # a last forward for routing
    want = eng.generate_groups([_prompt(7, 4)], 1, params)
    rid = batch.add([_prompt(7, 4)], 1, params)
    batch.step()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        batch.add([[10 ** 6]], 1, params)
    with pytest.raises(ValueError, match="n must be"):
        batch.add([[1, 2]], 0, params)
    eng.weights_version = 3  # a change the batch was not told about between steps
    with pytest.raises(RuntimeError, match="outside the engine's between_steps hook"):
        batch.add([[1, 2]], 1, params)
    eng.weights_version = 1
    out = {}
    while batch.decoding:
        out.update(batch.step())
    _same(out[rid], want)
    assert batch.requests == 0 and batch.decoding == 0
    # an empty batch starts over: a request after an update outside a step is fine
    eng.weights_version = 4
    rid = batch.add([_prompt(7, 4)], 1, params)
    while batch.decoding:
        out.update(batch.step())
    assert out[rid][0][0].token_ids == want[0][0].token_ids and out[rid][0][0].versions == [4] * 6


def test_kimi_linear_rows_join_with_their_recurrent_states():
    args = parse_args(["--model", "tiny-kimi-linear", "--mock-data"], world_size=1)
    initialize_distributed(args)
    try:
        eng = InferenceEngine(_model(args, 3))
        a = ([_prompt(8, 7), _prompt(9, 3)], 2, SamplingParams(max_tokens=9, temperature=1.0, seed=3,
                                                                return_routing=True))
        b = ([_prompt(10, 5)], 2, dataclasses.replace(a[2], max_tokens=4, seed=8))
        alone = [eng.generate_groups(*a), eng.generate_groups(*b)]
        results, at, _ = _drive(eng.continuous(), {0: a, 2: b})
        _same(results[0], alone[0])
        _same(results[2], alone[1])
        assert at[2] == 2 + 4 - 1 < at[0]
    finally:
        destroy()


def test_a_batch_that_never_empties_keeps_only_its_live_rows(models):
    served, _ = models
    eng = InferenceEngine(served)
    batch = eng.continuous()
    long = batch.add([_prompt(11, 3)], 1, SamplingParams(max_tokens=40, temperature=0.0))
    done = {}
    for k in range(6):  # short requests come and go while the long one decodes
        batch.add([_prompt(12 + k, 4)], 2, SamplingParams(max_tokens=3, temperature=1.0, seed=k))
        for _ in range(4):
            done.update(batch.step())
        assert len(batch._batch.rows) == len(batch._batch.out) == 1 == batch.decoding  # the long row alone
    while batch.decoding:
        done.update(batch.step())
    assert len(done) == 7 and len(done[long][0][0].token_ids) == 40 and batch._batch.rows == {}


def test_a_prefill_that_fails_leaves_the_batch_whole(models, monkeypatch):
    """A joining request whose prefill raises (out of memory, say) fails alone: nothing of it was recorded, and
    the rows in flight finish with the samples they draw alone."""
    served, _ = models
    eng = InferenceEngine(served)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, return_routing=True)
    want = eng.generate_groups([_prompt(3, 5)], 2, params)
    batch = eng.continuous()
    rid = batch.add([_prompt(3, 5)], 2, params)
    batch.step()
    hidden = eng.hidden

    def failing(tokens, *args, **kwargs):
        if tokens.size(1) > 1:  # a prefill, not a decode step
            raise RuntimeError("out of memory (simulated)")
        return hidden(tokens, *args, **kwargs)

    monkeypatch.setattr(eng, "hidden", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        batch.add([_prompt(9, 7)], 3, params)
    monkeypatch.undo()
    assert batch.decoding == 2 and batch.requests == 1
    out = {}
    while batch.decoding:
        out.update(batch.step())
    assert list(out) == [rid]
    _same(out[rid], want)
