"""Sampling draws from exactly the temperature / top-k / top-p distribution of the model's logits.

Two checks: the engine's distribution function (`sampling_probs`) equals an independent reference built from the
definitions at several positions of real logits; and every token `generate` draws is the one a seeded draw from the
reference distribution of the uncached forward picks, so the engine samples from that distribution, at the right
position, with its per-request generator. Different seeds give different continuations.
"""

import numpy as np
import pytest
import torch

from megatron_ext.inference.engine import SamplingParams, sampling_probs
from tests.unit.inference_fixtures import engine, uncached_logits  # noqa: F401  (engine: a fixture)

SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.5, top_k=40, top_p=0.6),
    dict(temperature=2.0, top_k=1),
]


def reference_probs(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """From the definitions, one row at a time: softmax(logits / T); keep the k most likely (ties with the k-th
    kept); keep the smallest most-likely-first prefix whose renormalised mass reaches p; renormalise."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if top_k:
        keep &= p >= np.sort(p)[::-1][top_k - 1]
    if top_p < 1.0:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        before = np.concatenate(([0.0], np.cumsum(q[order])[:-1]))  # mass of the more likely tokens
        nucleus = np.zeros_like(keep)
        nucleus[order[before < top_p]] = True
        keep &= nucleus
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def _positions(model, n=6, seed=0):
    ids = torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return uncached_logits(model, ids)  # one row per position: several different next-token distributions


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampling_distribution_is_exact(engine, setting):
    _, model = engine
    logits = _positions(model)
    got = sampling_probs(logits, SamplingParams(**setting)).numpy()
    for row, probs in zip(logits.numpy(), got):
        want = reference_probs(row, **setting)
        np.testing.assert_allclose(probs, want, rtol=1e-9, atol=1e-12)
        support = int((want > 0).sum())
        if setting.get("top_k"):
            assert support == setting["top_k"] or (support < setting["top_k"] and setting.get("top_p", 1) < 1)
        if setting.get("top_p", 1.0) < 1.0:
            assert 1 < support < len(want)  # the nucleus is a proper subset here: the cut-off is exercised
    greedy = sampling_probs(logits, SamplingParams(temperature=0.0)).numpy()
    assert (greedy.argmax(-1) == logits.numpy().argmax(-1)).all() and (greedy.sum(-1) == 1).all()


@pytest.mark.parametrize("setting", SETTINGS[1:5], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_generated_tokens_are_seeded_draws_from_the_distribution(engine, setting):
    """Replay the request's generator (seed + sample index) against the reference distribution of the uncached
    forward at each generated position: the same tokens come out."""
    eng, model = engine
    prompts = [[7, 8, 9, 10], [300, 301]]
    seed, n = 21, 6
    outs = eng.generate(prompts, SamplingParams(max_tokens=n, seed=seed, **setting))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ids = prompt + out.token_ids
        logits = uncached_logits(model, ids)[len(prompt) - 1: len(ids) - 1]
        generator = torch.Generator().manual_seed(seed + i)
        reference = [torch.from_numpy(reference_probs(row, **setting)) for row in logits.numpy()]
        replay = [int(torch.multinomial(q, 1, generator=generator)) for q in reference]
        assert out.token_ids == replay
        # log q of the drawn token under the sampled distribution, log p under the raw one (temperature 1)
        assert out.sampled_logprobs == pytest.approx(
            [float(torch.log(q[t])) for q, t in zip(reference, out.token_ids)], abs=1e-5)
        assert out.logprobs == pytest.approx(
            [float(torch.log_softmax(row.double(), -1)[t]) for row, t in zip(logits, out.token_ids)], abs=1e-5)


def test_different_seeds_draw_different_tokens(engine):
    eng, _ = engine
    draws = {tuple(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=1.0, seed=s))[0].token_ids)
             for s in range(3)}
    assert len(draws) == 3
    # unseeded requests draw fresh seeds
    unseeded = {tuple(eng.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=1.0))[0].token_ids)
                for _ in range(2)}
    assert len(unseeded) > 1
