"""The MoE routing the engine reports is the routing Megatron-Core's own router chooses for the same tokens.

Reference: a teacher-forced forward of prompt + generated tokens through Megatron-Core's TransformerBlock, with a
hook on every MoE layer's TopKRouter recording its routing map. The engine's capture must name the same experts
for every prompt and generated token, in every MoE layer (R3-style routing replay trains on exactly these).
"""

import pytest
import torch

from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from tests.unit.inference_fixtures import engine, uncached_forward  # noqa: F401  (engine: a fixture)

# A token whose k-th and (k+1)-th routing scores lie closer than this may legitimately flip between two orders of
# floating-point operations (cached vs uncached attention); every other token must match exactly.
TIE_MARGIN = 1e-4


def _moe_routers(model):
    return [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]


def megatron_routing(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, moe layers, k] ascending, margin [T, moe layers]) chosen by Megatron-Core's routers in an
    uncached forward of `ids`; margin is the gap between the k-th and (k+1)-th selection score."""
    experts, margins, hooks = [], [], []

    def record(router, inputs, output):
        _, routing_map = output
        k = router.topk
        chosen = routing_map.nonzero()
        assert torch.equal(chosen[:, 0], torch.arange(len(ids)).repeat_interleave(k)), "not k experts per token"
        experts.append(chosen[:, 1].view(len(ids), k))
        logits = router.gating(inputs[0].reshape(-1, inputs[0].size(-1)))
        scores = torch.sigmoid(logits.float()) if router.score_function == "sigmoid" else torch.softmax(logits, -1)
        if router.expert_bias is not None:
            scores = scores + router.expert_bias
        top = torch.topk(scores, k + 1, dim=-1).values
        margins.append(top[:, k - 1] - top[:, k])

    for router in _moe_routers(model):
        hooks.append(router.register_forward_hook(record))
    try:
        uncached_forward(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(experts, dim=1), torch.stack(margins, dim=1)


def engine_routing(eng: InferenceEngine, completion) -> tuple[int, torch.Tensor]:
    """(position of the first token covered, experts [tokens, moe layers, k] ascending) as the engine reports
    them for a completion. A tensor `routing` covers prompt and generated tokens from position 0. A list
    `routing` (one entry per decode step) covers the generated tokens fed back; the prompt's routing is then
    taken from the engine's prefill capture, the same mechanism, on the prompt alone."""
    routing = completion.routing
    if torch.is_tensor(routing):
        return 0, routing.to(torch.int64).sort(dim=-1).values
    prompt = completion.prompt_ids
    pairs = []
    cache = eng.new_cache(len(eng.layers), 1, len(prompt))
    eng.hidden(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), cache, torch.tensor([0]), pairs)
    prefill = torch.stack([p[:, 1].view(len(prompt), -1) for p in pairs], dim=1)  # rows are positions (b = 1)
    decoded = torch.tensor(routing, dtype=torch.int64).view(len(routing), prefill.size(1), -1)
    return 0, torch.cat((prefill, decoded)).sort(dim=-1).values


def _compare(eng, model, completion):
    ids = completion.prompt_ids + completion.token_ids
    want, margin = megatron_routing(model, ids)
    first, got = engine_routing(eng, completion)
    # Every token the model reads: the prompt and each generated token fed back (the last one may be left out:
    # no forward reads it during generation).
    assert first == 0 and len(ids) - 1 <= got.size(0) <= len(ids), got.shape
    assert got.shape[1:] == want.shape[1:]
    want, margin = want[: got.size(0)], margin[: got.size(0)]
    differs = (got != want).any(dim=-1)  # [tokens, layers]
    assert not (differs & (margin >= TIE_MARGIN)).any(), (
        f"experts differ at (token, layer) {differs.nonzero().tolist()} with margins {margin[differs].tolist()}")
    assert (margin >= TIE_MARGIN).float().mean() > 0.9  # the comparison is not vacuous
    return got


def test_routing_of_prompt_and_generated_tokens_matches_megatron_router(engine):
    eng, model = engine
    prompt = torch.randint(0, 1024, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    out = eng.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=2, return_routing=True))[0]
    assert len(out.token_ids) == 6
    got = _compare(eng, model, out)
    assert len(set(got.flatten().tolist())) > got.size(-1)  # tokens do not all go to the same experts


def test_routing_of_a_batch_is_reported_per_sample(engine):
    """Prompts of different lengths decoded together: each completion carries its own tokens' routing."""
    eng, model = engine
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (3, 8)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=5, temperature=1.0, seed=9, return_routing=True))
    for out in outs:
        _compare(eng, model, out)
