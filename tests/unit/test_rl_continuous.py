"""The Ray rollout worker's continuous batching (`rl/workers.ContinuousBatcher`, --rl-continuous-batching), in
process: turns of several requests (threads) share decode steps, each returns when its own rows finish with the
samples it draws alone, weights swap only between steps or while nothing decodes, a refused call fails alone and an
engine failure fails every call in flight, after which the worker decodes again."""

import threading
import time

import pytest

from megatron_ext.inference.engine import InferenceEngine, model_weights
from megatron_ext.rl.rollout import EngineGenerate, Sampling
from megatron_ext.rl.workers import ContinuousBatcher
from tests.unit.test_engine_continuous import models  # noqa: F401 (the fixture: two tiny models)
from tests.unit.test_engine_rl import _prompt


def _in_thread(fn, *args):
    box = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["out"] = e
        box["at"] = time.monotonic()
    t = threading.Thread(target=run)
    t.start()
    return t, box


def _tokens(out):
    return [[s.token_ids for s in g] for call in out for g in call]


def test_turns_share_decode_steps_and_each_returns_when_its_own_rows_finish(models):  # noqa: F811
    served, _ = models
    gen = EngineGenerate(InferenceEngine(served))
    batcher = ContinuousBatcher(gen, before=lambda: None)
    # long enough that the short turn joins it on a loaded machine (60 tokens once lost that race under a parallel run)
    long = [([_prompt(1, 5)], 2, Sampling(max_tokens=200, temperature=1.0, seed=3))]
    short = [([_prompt(2, 4)], 1, Sampling(max_tokens=3, temperature=1.0, seed=4)),
             ([_prompt(3, 6)], 2, Sampling(max_tokens=4, temperature=0.0))]
    alone = {"long": gen.many(long), "short": gen.many(short)}
    t_long, long_box = _in_thread(batcher.many, long)
    deadline = time.monotonic() + 60
    while gen.decoding == 0:  # the long turn is decoding before the short one arrives
        assert time.monotonic() < deadline
        time.sleep(0.001)
    t_short, short_box = _in_thread(batcher.many, short)
    t_short.join(60)
    rows_when_short_returned = gen.decoding
    t_long.join(60)
    assert _tokens(short_box["out"]) == _tokens(alone["short"])
    assert _tokens(long_box["out"]) == _tokens(alone["long"])
    assert short_box["out"][0][0][0].logprobs == pytest.approx(alone["short"][0][0][0].logprobs, abs=1e-5)
    # the short turn came back while the long one was still decoding, after sharing steps with it (2 + 3 rows)
    assert short_box["at"] < long_box["at"] and rows_when_short_returned == 2
    assert gen.step_rows[5] >= 1 and gen.step_rows[2] >= 40
    assert batcher.holders == 0 and gen.decoding == 0


def test_swaps_only_between_steps_or_when_idle_and_failures(models, monkeypatch):  # noqa: F811
    served, other = models
    eng = InferenceEngine(served, weights_version=0)
    gen = EngineGenerate(eng)
    old = {k: v.clone() for k, v in model_weights(served).items()}
    new = {k: v.clone() for k, v in model_weights(other).items()}
    staged = []

    def swap():  # the worker's _swap: applies a staged version, if any
        if not staged:
            return False
        eng.update_weights(staged.pop().items(), version=eng.weights_version + 1)
        return True

    eng.between_steps = swap
    batcher = ContinuousBatcher(gen, before=swap)
    call = [([_prompt(5, 4)], 2, Sampling(max_tokens=6, temperature=1.0, seed=1))]
    try:
        staged.append(new)  # staged while idle: applied before the prefill (before), every token is version 1
        out = batcher.many(call)
        assert all(s.versions == [1] * 6 for s in out[0][0])
        # a refused call fails alone; a turn running beside it is unharmed
        t_ok, ok = _in_thread(batcher.many, call)
        bad = _in_thread(batcher.many, [([[10 ** 6]], 1, Sampling(max_tokens=2))])
        t_ok.join(60)
        bad[0].join(60)
        assert isinstance(bad[1]["out"], ValueError) and "outside the vocabulary" in str(bad[1]["out"])
        assert _tokens(ok["out"]) == _tokens(out)
        # the engine failing mid-batch fails every call in flight; the next call decodes in a new batch
        real = gen.advance
        monkeypatch.setattr(gen, "advance", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
        with pytest.raises(RuntimeError, match="device lost"):
            batcher.many(call)
        monkeypatch.setattr(gen, "advance", real)
        assert gen.decoding == 0
        assert _tokens(batcher.many(call)) == _tokens(out)
    finally:
        eng.between_steps = None
        eng.update_weights(old.items(), version=0)
