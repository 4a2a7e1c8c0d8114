"""The inference engine on a model built with Megatron-Core's Transformer Engine spec (from CPU modules with TE's
parameter names, `te_spec_on_cpu`): the MLA latent norms and a dense layer's pre-MLP norm are identity modules
there, their weights fused into the next linear as ``layer_norm_weight``; routed experts may be TE's grouped GEMM
(``experts.linear_fc{1,2}.weight{i}``). The engine must read both, and agree with the model's own forward and with
the local-spec model holding the same weights."""

import argparse

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, LatentCache, SamplingParams, model_weights
from megatron_ext.inference.speculative import SpeculationStats, generate_speculative
from megatron_ext.models.te_layout import NormColumnParallelLinear, te_spec_on_cpu
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model
from tests.unit.inference_fixtures import uncached_forward, uncached_logits
from tests.unit.test_routing_capture import _compare as compare_with_megatron_routing

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _build(args, seed: int, te: bool):
    def init(m):
        init_layout_invariant_(m, seed=seed)  # keyed by checkpoint key: the same values under either spec

    if not te:
        model = build_model(args, wrap_ddp=False, init_fn=init)[0]
    else:
        te_args = argparse.Namespace(**{**vars(args), "transformer_impl": "transformer_engine"})
        with te_spec_on_cpu():
            model = build_model(te_args, wrap_ddp=False, init_fn=init)[0]
    return model.eval()


@pytest.fixture(scope="module")
def setup():
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    te, local = _build(args, 3, te=True), _build(args, 3, te=False)
    yield args, te, local
    destroy()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fused_linears(model) -> dict[str, NormColumnParallelLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, NormColumnParallelLinear)}


def test_the_model_is_te_shaped_with_non_unit_fused_norms(setup):
    """What makes the other tests meaningful: the norms the engine must apply sit in the linears (the norm
    modules are identities), in the decoder and the MTP layer, and their weights are not ones."""
    args, te, _ = setup
    layer0 = te.decoder.layers[0]
    attn = layer0.self_attention
    assert [type(m).__name__ for m in (attn.q_layernorm, attn.kv_layernorm, layer0.pre_mlp_layernorm)] == \
        ["IdentityOp"] * 3
    fused = _fused_linears(te)
    assert "decoder.layers.0.mlp.linear_fc1" in fused and "mtp.layers.0.transformer_layer.self_attention." \
        "linear_kv_up_proj" in fused
    assert len(fused) == 2 * (args.num_layers + args.mtp_num_layers) + args.first_k_dense_replace
    for m in fused.values():
        assert (m.layer_norm_weight - 1).abs().min() > 0 and m.layer_norm_weight.abs().min() > 0


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_cached_logits_equal_the_te_models_forward(setup, form):
    _, te, _ = setup
    eng = InferenceEngine(te)
    eng.absorb_max_tokens = 1 << 30 if form == "absorbed" else 0
    ids = _ids(0, 18)
    cache = LatentCache(len(eng.layers), 1, 32, eng.config.kv_lora_rank, eng.config.qk_pos_emb_head_dim,
                        torch.float32, "cpu")
    prefix = 11
    parts = [eng.forward(torch.tensor([ids[:prefix]]), torch.arange(prefix).unsqueeze(0), cache, torch.tensor([0]))[0]]
    for t in range(prefix, len(ids)):
        parts.append(eng.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache, torch.tensor([t]))[0])
    torch.testing.assert_close(torch.cat(parts), uncached_logits(te, ids), rtol=1e-5, atol=1e-5)


def test_logprobs_equal_the_te_models_teacher_forced_forward(setup):
    _, te, _ = setup
    prompt = _ids(2, 7)
    out = InferenceEngine(te).generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=5))[0]
    ids = prompt + out.token_ids
    with torch.no_grad():
        losses = te(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1).unsqueeze(0), None,
                    labels=torch.tensor([ids[1:]]))[0]
    assert out.logprobs == pytest.approx((-losses).tolist()[len(prompt) - 1:], abs=1e-5)


def _argmax_rollout(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(uncached_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_greedy_generation_equals_the_argmax_rollout_and_the_local_model(setup):
    _, te, local = setup
    prompts = [_ids(10, 5), _ids(11, 9)]
    ours = InferenceEngine(te).generate(prompts, GREEDY)
    theirs = InferenceEngine(local).generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, ours, theirs):
        assert a.token_ids == _argmax_rollout(te, prompt, GREEDY.max_tokens)
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_mtp_and_speculative_decoding(setup):
    """The MTP layer's fused norms: its logits equal Megatron-Core's MTP block; speculative greedy decoding
    is lossless and drafts exactly as on the local model."""
    _, te, local = setup
    eng = InferenceEngine(te)
    ids = _ids(4, 14)
    tokens, pos = torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)
    with torch.no_grad():
        hidden = uncached_forward(te, ids)
        both = te.mtp(input_ids=tokens, position_ids=pos, hidden_states=hidden, attention_mask=None,
                      embedding=te.embedding)
        reference = te.output_layer(torch.chunk(both, 2, dim=0)[1])[0][:, 0].float()
    cache = LatentCache(1, 1, 32, eng.config.kv_lora_rank, eng.config.qk_pos_emb_head_dim, torch.float32, "cpu")
    s = len(ids) - 1
    ours = eng.mtp_forward(hidden[:s], tokens[:, 1:], pos[:, :s], cache, torch.tensor([0]))[0]
    torch.testing.assert_close(ours, reference[:s], rtol=1e-5, atol=1e-5)

    prompt = _ids(5, 6)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    stats, local_stats = SpeculationStats(), SpeculationStats()
    spec = generate_speculative(eng, prompt, params, stats)
    plain = eng.generate([prompt], params)[0]
    assert spec.token_ids == plain.token_ids and spec.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    generate_speculative(InferenceEngine(local), prompt, params, local_stats)
    assert stats.drafted > 0 and (stats.accepted_by_depth, stats.main_forwards) == \
        (local_stats.accepted_by_depth, local_stats.main_forwards)
    sampled = generate_speculative(eng, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3))
    assert len(sampled.token_ids) == 6 and all(lp <= 0 for lp in sampled.logprobs)


def test_routing_capture_equals_megatrons_routers(setup):
    _, te, local = setup
    eng = InferenceEngine(te)
    prompt = _ids(6, 9)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2, return_routing=True)
    out = eng.generate([prompt], params)[0]
    got = compare_with_megatron_routing(eng, te, out)
    assert len(set(got.flatten().tolist())) > got.size(-1)
    same = InferenceEngine(local).generate([prompt], params)[0]
    assert out.token_ids == same.token_ids and torch.equal(out.routing, same.routing)


class GroupedExperts(torch.nn.Module):
    """TE's TEGroupedMLP as the engine sees it (``--moe-grouped-gemm``; TE's grouped linears need a GPU):
    ``linear_fc1.weight{i}`` / ``linear_fc2.weight{i}`` for local expert i, no ``local_experts``."""

    def __init__(self, sequential):
        super().__init__()
        self.num_local_experts = len(sequential.local_experts)
        self.linear_fc1, self.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        for i, expert in enumerate(sequential.local_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                weight = getattr(expert, fc).weight.detach().clone()
                getattr(self, fc).register_parameter(f"weight{i}", torch.nn.Parameter(weight))


def test_grouped_gemm_experts(setup):
    """The same weights as TE grouped-GEMM experts: the same logits, tokens and routing; update_weights by the
    grouped names reaches them."""
    args, te, _ = setup
    grouped = _build(args, 3, te=True)
    moe = [layer.mlp for layer in list(grouped.decoder.layers) + [m.transformer_layer for m in grouped.mtp.layers]
           if hasattr(layer.mlp, "router")]
    assert moe
    for mlp in moe:
        mlp.experts = GroupedExperts(mlp.experts)
    names = model_weights(grouped)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight0" in names
    assert not any("local_experts" in k for k in names)

    prompt = _ids(7, 8)
    params = SamplingParams(max_tokens=6, temperature=0.0, return_routing=True)
    eng, reference = InferenceEngine(grouped), InferenceEngine(te)
    a, b = eng.generate([prompt], params)[0], reference.generate([prompt], params)[0]
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert torch.equal(a.routing, b.routing)
    ids = prompt + a.token_ids
    cache = eng.new_cache(len(eng.layers), 1, len(ids))
    logits = eng.forward(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache, torch.tensor([0]))[0]
    torch.testing.assert_close(logits, uncached_logits(te, ids), rtol=1e-5, atol=1e-5)
    spec = generate_speculative(eng, prompt, SamplingParams(max_tokens=6, temperature=0.0))
    assert spec.token_ids == a.token_ids

    # a zeroed expert through update_weights changes the output: the engine reads the grouped parameters
    name = "decoder.layers.1.mlp.experts.linear_fc2.weight0"
    eng.update_weights([(name, torch.zeros_like(names[name]))], strict=False)
    cache = eng.new_cache(len(eng.layers), 1, len(ids))
    changed = eng.forward(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache, torch.tensor([0]))[0]
    assert not torch.allclose(changed, logits, atol=1e-4)


def test_unknown_expert_modules_are_refused(setup):
    args, _, _ = setup
    model = _build(args, 3, te=True)
    mlp = next(layer.mlp for layer in model.decoder.layers if hasattr(layer.mlp, "router"))
    mlp.experts = torch.nn.Module()  # e.g. the legacy GroupedMLP (weight1 / weight2)
    with pytest.raises(ValueError, match="legacy-grouped-gemm"):
        InferenceEngine(model)


def test_update_weights_from_a_te_shaped_trainer(setup):
    args, _, _ = setup
    trainer, served = _build(args, 11, te=True), _build(args, 5, te=True)
    prompt = _ids(8, 6)
    want = _argmax_rollout(trainer, prompt, GREEDY.max_tokens)
    engine = InferenceEngine(served)
    assert engine.generate([prompt], GREEDY)[0].token_ids != want
    assert engine.update_weights(trainer) == 1
    fused = "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight"
    assert torch.equal(model_weights(served)[fused], model_weights(trainer)[fused])
    got = engine.generate([prompt], GREEDY)[0]
    assert got.token_ids == want and got.versions == [1] * len(want)
