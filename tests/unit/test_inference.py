"""The latent-cache engine against the model's own (uncached) forward."""

import time

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, LatentCache, SamplingParams
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


@pytest.fixture(scope="module", params=["tiny", "tiny-no-qlora"])
def engine(request):
    args = parse_args(["--model", request.param, "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
    model.eval()
    yield InferenceEngine(model), model
    destroy()


def _dev(model):
    """The model's device: the inputs these tests build go there (tests/gpu/run.sh runs this file on a GPU)."""
    return next(model.parameters()).device


def _full_logits(model, ids):
    """Uncached logits through Megatron-Core's own TransformerBlock (GPTModel.forward needs labels once MTP
    layers exist), on the host."""
    tokens = torch.tensor([ids], device=_dev(model))
    with torch.no_grad():
        pos = torch.arange(len(ids), device=tokens.device).unsqueeze(0)
        hidden = model.decoder(model.embedding(tokens, pos), attention_mask=None)
        return model.output_layer(hidden)[0][:, 0].float().cpu()


def _trainer_logprobs(model, ids):
    """-(per-token loss) of the training forward: log p(ids[t+1] | ids[:t+1])."""
    dev = _dev(model)
    tokens, labels = torch.tensor([ids[:-1]], device=dev), torch.tensor([ids[1:]], device=dev)
    with torch.no_grad():
        pos = torch.arange(len(ids) - 1, device=dev).unsqueeze(0)
        return (-model(tokens, pos, None, labels=labels)[0]).tolist()


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_cached_decoding_equals_uncached_forward(engine, form):
    """Prefill then one token at a time, attending over the latents either with the up-projections absorbed
    into query and output or with keys and values expanded from the latents."""
    eng, model = engine
    ids = torch.randint(0, 1024, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    dev = _dev(model)
    cache = LatentCache(len(eng.layers), 1, 32, eng.config.kv_lora_rank, eng.config.qk_pos_emb_head_dim,
                        torch.float32, dev)
    prefix = 12
    saved, eng.absorb_max_tokens = eng.absorb_max_tokens, (1 << 30 if form == "absorbed" else 0)
    try:
        parts = [eng.forward(torch.tensor([ids[:prefix]], device=dev), torch.arange(prefix, device=dev)[None],
                             cache, torch.tensor([0], device=dev))[0]]
        for t in range(prefix, len(ids)):
            parts.append(eng.forward(torch.tensor([[ids[t]]], device=dev), torch.tensor([[t]], device=dev), cache,
                                     torch.tensor([t], device=dev))[0])
    finally:
        eng.absorb_max_tokens = saved
    torch.testing.assert_close(torch.cat(parts).cpu(), _full_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_batched_prompts_of_different_lengths_match_one_by_one(engine):
    eng, _ = engine
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (3, 9, 6)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    together = eng.generate(prompts, params)
    for prompt, got in zip(prompts, together):
        alone = eng.generate([prompt], params)[0]
        assert got.token_ids == alone.token_ids
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


@pytest.mark.parametrize("absorb_max", [0, 1])
def test_attention_runs_in_sdpas_fused_kernel_without_materialised_scores(engine, absorb_max):
    """MLA's value heads are narrower than its query/key heads (rope dims), which sends SDPA with a boolean mask
    to its score-materialising math path (`benchmarks/prefill_memory.py`, 64 prompts of 1,400 tokens: 24 s, 5 s
    fused, on this CPU). A prefill (expanded form) and decode steps (expanded, or absorbed as RL's policy
    decodes) run in the fused kernel, never in the math path or as explicit score products, and generate the tokens
    and log-probabilities of attention done as plain matrix products (the reference here)."""
    import math

    import torch.nn.functional as F
    from torch.profiler import profile

    eng, model = engine
    cfg = model.config
    assert cfg.v_head_dim != cfg.qk_head_dim + cfg.qk_pos_emb_head_dim  # the case in question
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (30, 23, 27)]
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=9)
    saved, eng.absorb_max_tokens = eng.absorb_max_tokens, absorb_max
    try:
        with profile() as prof:
            fused = eng.generate(prompts, params)
        ops = {e.key for e in prof.key_averages()}
        if _dev(model).type == "cpu":  # (which fused kernel CUDA picks depends on the card: not asserted there)
            assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
            assert "aten::_scaled_dot_product_attention_math" not in ops
        assert "aten::baddbmm" not in ops

        def plain(q, k, v, attn_mask=None, scale=None, is_causal=False, **kw):
            scores = q @ k.transpose(-1, -2) * scale
            if is_causal:
                attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            if attn_mask is not None:
                scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool \
                    else scores + attn_mask
            return torch.softmax(scores, -1) @ v

        sdpa, F.scaled_dot_product_attention = F.scaled_dot_product_attention, plain
        try:
            reference = eng.generate(prompts, params)
        finally:
            F.scaled_dot_product_attention = sdpa
    finally:
        eng.absorb_max_tokens = saved
    for a, b in zip(fused, reference):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize("budget", ["rows", "queries"])
def test_attention_in_pieces_equals_one_call(engine, form, budget, monkeypatch):
    """A prefill of many long prompts attends in pieces of bounded score memory (rows, then a row's queries) and
    generates exactly what one attention call over the whole batch does, on both attention paths."""
    import torch.nn.functional as F

    from megatron_ext.inference import engine as engine_module

    eng, _ = engine
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (9, 4, 7)]
    params = SamplingParams(max_tokens=4, temperature=0.0)
    saved, eng.absorb_max_tokens = eng.absorb_max_tokens, (0 if form == "expanded" else 1 << 30)
    try:
        whole = eng.generate(prompts, params)
        heads, width = eng.heads, max(len(p) for p in prompts)
        one_row = heads * width * width * 4  # the prefill's scores of one row
        limit = 2 * one_row if budget == "rows" else one_row // 3
        monkeypatch.setattr(engine_module, "_ATTENTION_MAX_SCORE_BYTES", limit)
        calls = []  # (rows, queries, keys, score bytes) of each attention call
        if form == "expanded":
            sdpa = F.scaled_dot_product_attention

            def counted(q, k, v, **kw):
                rows, n, s = q.shape[:3]
                calls.append((rows, s, k.shape[2], rows * n * s * k.shape[2] * 4))
                return sdpa(q, k, v, **kw)

            monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
        else:
            piece = eng._absorbed_piece

            def counted(q_nope, q_pe, cached, kv_up, hide, scale):
                s, b, n, _ = q_nope.shape
                calls.append((b, s, cached.shape[1], b * n * s * cached.shape[1] * 4))
                return piece(q_nope, q_pe, cached, kv_up, hide, scale)

            monkeypatch.setattr(eng, "_absorbed_piece", counted)
        pieces = eng.generate(prompts, params)
    finally:
        eng.absorb_max_tokens = saved
    prefill = [c for c in calls if c[1] > 1]  # the prefill's calls (decode steps attend one query a row)
    assert prefill and all(c[3] <= limit for c in calls)
    if budget == "rows":  # two rows, then the last one, in each layer
        assert {(c[0], c[1]) for c in prefill} == {(2, width), (1, width)}
    else:  # one row at a time, a third of its queries or fewer per call
        assert {c[0] for c in prefill} == {1} and max(c[1] for c in prefill) < width
    for a, b in zip(whole, pieces):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_logprobs_equal_teacher_forced_forward(engine):
    eng, model = engine
    prompt = torch.randint(0, 1024, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    out = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=5))[0]
    assert len(out.token_ids) == 8
    expected = _trainer_logprobs(model, prompt + out.token_ids)[len(prompt) - 1:]
    assert out.logprobs == pytest.approx(expected, abs=1e-5)


def test_sampling_is_seeded_and_stops(engine):
    eng, _ = engine
    prompt = [1, 2, 3]
    a = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=11))[0]
    b = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=11))[0]
    assert a.token_ids == b.token_ids
    stop = a.token_ids[3]
    c = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=11,
                                              stop_token_ids=(stop,)))[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == stop and len(c.token_ids) <= 4
    assert a.finish_reason == "length"
    greedy = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert greedy.token_ids == eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


def test_stop_strings_need_text(engine):
    eng, _ = engine
    eng_text = InferenceEngine(eng.model, detokenize=lambda ids: " ".join(str(i) for i in ids))
    first = eng_text.generate([[5, 6]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    target = str(first.token_ids[1])
    out = eng_text.generate([[5, 6]], SamplingParams(max_tokens=5, temperature=0.0, stop=(target,)))[0]
    assert out.finish_reason == "stop" and target not in out.text


def test_routing_choices_are_reported(engine):
    eng, _ = engine
    out = eng.generate([[4, 5, 6]], SamplingParams(max_tokens=3, temperature=0.0, return_routing=True))[0]
    moe_layers = sum(1 for layer in eng.layers if hasattr(layer.mlp, "router"))
    # every token, the prompt's and all generated ones (the last included)
    assert out.routing.dtype == torch.int16
    assert tuple(out.routing.shape) == (3 + 3, moe_layers, eng.config.moe_router_topk)
    assert int(out.routing.min()) >= 0 and int(out.routing.max()) < eng.config.num_moe_experts


def test_bad_requests_are_refused(engine):
    eng, _ = engine
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.generate([[5000]], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([[1]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="exceeds"):
        eng.generate([[1]], SamplingParams(max_tokens=100000))


def test_latent_cache_is_much_smaller_than_full_kv(engine):
    eng, _ = engine
    cfg = eng.config
    cache = LatentCache(len(eng.layers), 1, 100, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, torch.float32, "cpu")
    per_head = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim
    full = len(eng.layers) * 100 * cfg.num_attention_heads * per_head * 4
    assert cache.bytes() * 3 < full


def test_mtp_forward_matches_megatron_mtp_block(engine):
    eng, model = engine
    ids = torch.randint(0, 1024, (14,), generator=torch.Generator().manual_seed(4)).tolist()
    dev = _dev(model)
    tokens, pos = torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev).unsqueeze(0)
    with torch.no_grad():
        hidden = model.decoder(model.embedding(tokens, pos), attention_mask=None)
        both = model.mtp(input_ids=tokens, position_ids=pos, hidden_states=hidden, attention_mask=None,
                         embedding=model.embedding)
        reference = model.output_layer(torch.chunk(both, 2, dim=0)[1])[0][:, 0].float()
    cache = LatentCache(1, 1, 32, eng.config.kv_lora_rank, eng.config.qk_pos_emb_head_dim, torch.float32, dev)
    s = len(ids) - 1  # the last position has no next token to embed
    ours = eng.mtp_forward(hidden[:s], tokens[:, 1:], pos[:, :s], cache, torch.tensor([0], device=dev))[0]
    torch.testing.assert_close(ours, reference[:s], rtol=1e-5, atol=1e-5)


def test_speculative_greedy_is_lossless(engine):
    from megatron_ext.inference.speculative import SpeculationStats, generate_speculative

    eng, _ = engine
    for seed in range(3):
        prompt = torch.randint(0, 1024, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(max_tokens=12, temperature=0.0)
        stats = SpeculationStats()
        spec = generate_speculative(eng, prompt, params, stats)
        plain = eng.generate([prompt], params)[0]
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
        assert stats.main_forwards <= len(spec.token_ids) and stats.drafted > 0


def test_speculative_sampling_keeps_the_main_distribution(engine):
    """Next-token frequencies after a fixed prompt match the main model's distribution (chi-square-free check:
    total variation over 400 draws)."""
    from megatron_ext.inference.speculative import generate_speculative

    eng, model = engine
    if eng.config.q_lora_rank is None:
        pytest.skip("one architecture is enough for this statistical check")
    prompt = [7, 8, 9]
    params = dict(max_tokens=2, temperature=1.0, top_k=4)
    counts = torch.zeros(1024)
    for seed in range(400):
        out = generate_speculative(eng, prompt, SamplingParams(seed=seed, **params))
        counts[out.token_ids[1]] += 1
    # the exact marginal of the second token under the main model with top-k 4 sampling
    logits = _full_logits(model, prompt)[-1]
    kth = torch.topk(logits, 4).values[-1]
    first = torch.softmax(logits.masked_fill(logits < kth, float("-inf")).double(), -1)
    marginal = torch.zeros(1024, dtype=torch.float64)
    for t in torch.nonzero(first).flatten().tolist():
        nxt = _full_logits(model, prompt + [t])[-1]
        kth2 = torch.topk(nxt, 4).values[-1]
        marginal += first[t] * torch.softmax(nxt.masked_fill(nxt < kth2, float("-inf")).double(), -1)
    tv = 0.5 * (counts.double() / counts.sum() - marginal).abs().sum().item()
    assert tv < 0.12


def test_router_shortcut_matches_megatron_router(engine):
    """The engine's few-op routing chooses the experts and weights Megatron-Core's TopKRouter chooses."""
    eng, model = engine
    layer = next(layer for layer in eng.layers if hasattr(layer.mlp, "router"))
    router = layer.mlp.router
    x = torch.randn(9, eng.config.hidden_size, generator=torch.Generator().manual_seed(6)).to(_dev(model))
    with torch.no_grad():
        fast = eng._route(router, x, routing=[])
    eng._fast_router[id(router)] = False
    try:
        with torch.no_grad():
            slow = eng._route(router, x, routing=[])
    finally:
        del eng._fast_router[id(router)]
    for (experts, weights), token in zip(zip(*fast), range(len(x))):
        assert experts.tolist() == slow[0][token].tolist()  # both in the router's top-k order
        assert weights.tolist() == pytest.approx(slow[1][token].tolist(), abs=1e-6)


def test_pipeline_parallel_models_are_refused(engine):
    _, model = engine
    model.post_process = False
    try:
        with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
            InferenceEngine(model)
    finally:
        model.post_process = True


@pytest.fixture(scope="module")
def engine_mtp2(engine):
    """The tiny preset with two MTP layers (built under the same one-rank process groups)."""
    eng, _ = engine
    if eng.config.q_lora_rank is None:
        pytest.skip("one architecture is enough for the MTP-depth checks")
    args = parse_args(["--model", "tiny", "--mock-data", "--mtp-num-layers", "2"], world_size=1)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=8))[0]
    model.eval()
    return InferenceEngine(model), model


def test_mtp_chain_matches_megatron_mtp_block(engine_mtp2):
    """MTP layer 2 takes MTP layer 1's output and the token two ahead, as Megatron-Core's MTP block does."""
    eng, model = engine_mtp2
    ids = torch.randint(0, 1024, (14,), generator=torch.Generator().manual_seed(9)).tolist()
    dev = _dev(model)
    tokens, pos = torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev).unsqueeze(0)
    with torch.no_grad():
        hidden = model.decoder(model.embedding(tokens, pos), attention_mask=None)
        chunks = torch.chunk(model.mtp(input_ids=tokens, position_ids=pos, hidden_states=hidden,
                                       attention_mask=None, embedding=model.embedding), 3, dim=0)
        reference = [model.output_layer(c)[0][:, 0].float() for c in chunks[1:]]
    cache = eng.new_cache(2, 1, 32)
    n = len(ids)
    zero = torch.tensor([0], device=dev)
    first = eng.mtp_hidden(0, hidden[: n - 1], tokens[:, 1:], pos[:, : n - 1], cache, zero)
    second = eng.mtp_hidden(1, first[: n - 2], tokens[:, 2:], pos[:, : n - 2], cache, zero)
    torch.testing.assert_close(eng.logits(first)[0], reference[0][: n - 1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eng.logits(second)[0], reference[1][: n - 2], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("depth", [1, 2])
def test_speculative_greedy_with_several_drafts_is_lossless(engine_mtp2, depth):
    from megatron_ext.inference.speculative import SpeculationStats, generate_speculative

    eng, _ = engine_mtp2
    for seed in range(2):
        prompt = torch.randint(0, 1024, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(max_tokens=11, temperature=0.0)
        stats = SpeculationStats()
        spec = generate_speculative(eng, prompt, params, stats, depth=depth)
        plain = eng.generate([prompt], params)[0]
        assert spec.token_ids == plain.token_ids
        assert spec.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
        assert len(stats.checked_by_depth) <= depth and stats.drafted == sum(stats.checked_by_depth)
    with pytest.raises(ValueError, match="draft depth"):
        generate_speculative(eng, [1, 2], SamplingParams(), depth=3)


def test_speculative_honours_stop_strings(engine):
    from megatron_ext.inference.speculative import generate_speculative

    eng, _ = engine
    eng_text = InferenceEngine(eng.model, detokenize=lambda ids: " ".join(str(i) for i in ids))
    first = eng_text.generate([[5, 6]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, stop=(str(first.token_ids[2]),))
    plain = eng_text.generate([[5, 6]], params)[0]
    spec = generate_speculative(eng_text, [5, 6], params)
    assert (spec.text, spec.finish_reason, spec.token_ids) == (plain.text, plain.finish_reason, plain.token_ids)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every read of tensor values on the host (a device-to-host sync on a GPU); `strict`: raises at the
    first one instead."""

    READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
             torch.Tensor.cpu, torch.Tensor.numpy, torch.equal)

    def __init__(self, strict: bool = False):
        super().__init__()
        self.strict, self.names = strict, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            if self.strict:
                raise AssertionError(f"host sync: {func.__name__}")
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _NoHostSync():
    return _HostReads(strict=True)


@pytest.mark.parametrize("rows", [3, 9])
def test_gpu_decode_moe_has_no_host_sync_and_matches_the_sparse_path(engine, rows, monkeypatch):
    from megatron_ext.inference import engine as engine_module

    eng, model = engine
    assert engine_module._dense_decode(torch.zeros(64, 8, device="meta"), 8, 384) is False  # not on a GPU
    monkeypatch.setattr(engine_module, "_ALL_EXPERTS_MAX_WORK", 0)  # the CPU's host-synced paths, not _moe_all
    monkeypatch.setattr(engine_module, "_HOST_GROUPED_MM", False)  # nor torch's grouped GEMM (its sync is in C++)
    monkeypatch.setattr(eng, "host_sync_free", False)  # the host-synced paths also where the model is on a GPU
    mlp = next(layer.mlp for layer in eng.layers if hasattr(layer.mlp, "router"))
    h = torch.randn(rows, 1, eng.config.hidden_size, generator=torch.Generator().manual_seed(rows)).to(_dev(model))
    with torch.no_grad():
        sparse = eng._moe(mlp, h, None)
        with pytest.raises(AssertionError, match="host sync"), _NoHostSync():  # the check has teeth
            eng._moe(mlp, h, None)
        monkeypatch.setattr(engine_module, "_dense_decode", lambda *a: True)  # what a CUDA decode batch takes
        with _NoHostSync():
            dense = eng._moe(mlp, h, None)
    assert torch.allclose(dense, sparse, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("grouped", [False, True], ids=["gathered-experts", "grouped-gemm"])
def test_gpu_path_reads_only_the_sampled_tokens_on_the_host(engine, grouped, monkeypatch):
    """Issue 27 item 11. On a GPU the engine's prefill and decode steps read nothing back from the device (the MoE
    layers' routed experts and token counts, the cache lengths, the sampler's flags), so the host can queue a
    step ahead; the one read per step is the sampled tokens with their logprobs (one transfer). Emulated on the
    CPU by switching the GPU path on; tokens and logprobs equal the host-synced path's. `grouped`: the routed
    experts as torch's grouped GEMM (the bf16 Hopper kernel; its CPU stand-in here), else each decode token's
    experts gathered from the stacked weights."""
    eng, _ = engine
    _assert_reads_only_sampled_tokens(eng, grouped, monkeypatch)


@pytest.mark.parametrize("grouped", [False, True], ids=["gathered-experts", "grouped-gemm"])
def test_gpu_path_has_no_host_sync_on_a_distributed_optimizer_model(engine, grouped, monkeypatch, request):
    """The same on the model RL generates with: wrapped in DDP with the distributed optimizer, whose buffer holds
    the experts last first (Megatron-Core lays parameters out in reverse). Those are stacked as they lie (a
    descending view, no copy), not sent down the host-synced path."""
    from megatron_ext.inference.engine import _ExpertStack

    preset = request.node.callspec.params["engine"]  # the fixture's preset, on its distributed state
    args = parse_args(["--model", preset, "--mock-data", "--use-distributed-optimizer"], world_size=1)
    ddp = build_model(args, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
    ddp.eval()
    eng = InferenceEngine(ddp)
    layers = [layer.mlp for layer in eng.layers if hasattr(layer.mlp, "router")]
    stacks = [_ExpertStack(eng._experts[id(mlp)]) for mlp in layers]
    assert layers and all(s.fc1 is not None and s.descending for s in stacks)  # reversed in the shared buffer
    for mlp, stack in zip(layers, stacks):
        experts = eng._experts[id(mlp)]
        assert all(stack.fc1[len(experts) - 1 - i].data_ptr() == fc1.data_ptr() for i, (fc1, _) in enumerate(experts))
    _assert_reads_only_sampled_tokens(eng, grouped, monkeypatch)


def _assert_reads_only_sampled_tokens(eng, grouped, monkeypatch):
    from megatron_ext.inference import engine as engine_module

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 11)]
    cases = [([prompts[0]], SamplingParams(max_tokens=6, temperature=0.0, seed=0)),  # one sequence, greedy
             (prompts, [SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=1),
                        SamplingParams(max_tokens=4, temperature=0.0, seed=2)])]  # a batch; a row leaves early
    for batch, params in cases:
        expected = eng.generate(batch, params)
        eng.host_sync_free = True
        if grouped:
            monkeypatch.setattr(engine_module, "_grouped_kernel", lambda x: True)
        try:
            with _HostReads() as reads:
                got = eng.generate(batch, params)
        finally:
            eng.host_sync_free = None
            monkeypatch.undo()
        steps = max(len(c.token_ids) for c in got)
        assert reads.names == ["tolist"] * steps
        for a, b in zip(got, expected):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def _plan_costs(eng, costs):
    """Injects measured costs for one draft position (restored by the caller's finally)."""
    saved = dict(eng.draft_costs), dict(eng.speculation_decisions)
    eng.draft_costs[(1, 1, "single")] = costs  # the one-sequence path's
    eng.speculation_decisions.clear()
    return saved


@pytest.mark.parametrize("case", ["cannot-pay", "pays", "acceptance-too-low"])
def test_speculation_steps_aside_unless_drafting_pays(engine, case, caplog):
    """Issue 32 item 3. Costs as measured at start-up (here given): a draft round of one MTP draft costs a
    verify forward and a draft. Where even perfectly accepted drafts cannot beat plain steps, or the acceptance
    observed so far cannot, `policy="auto"` decodes plainly (exactly plain greedy's tokens, nothing drafted) and
    logs one line; where drafting pays it keeps speculating (lossless)."""
    from megatron_ext.inference.speculative import DraftCosts, SpeculationStats, generate_speculative

    eng, _ = engine
    costs = {"cannot-pay": DraftCosts(main=1.0, verify=1.6, draft=0.5),  # 2 tokens for 2.1 steps at best
             "pays": DraftCosts(main=1.0, verify=1.1, draft=0.1),  # 2 tokens for 1.2 steps at best
             "acceptance-too-low": DraftCosts(main=1.0, verify=1.1, draft=0.1)}[case]
    stats = SpeculationStats()
    if case == "acceptance-too-low":  # 1 + 0.1 tokens per 1.2 steps
        stats.checked_by_depth, stats.accepted_by_depth, stats.drafted, stats.accepted = [100], [10], 100, 10
    drafted_before = stats.drafted
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    saved = _plan_costs(eng, costs)
    try:
        with caplog.at_level("INFO", logger="megatron_ext.inference.speculative"):
            out = generate_speculative(eng, prompt, params, stats, policy="auto")
            again = generate_speculative(eng, prompt, params, stats, policy="auto")
    finally:
        eng.draft_costs, eng.speculation_decisions = saved
    plain = eng.generate([prompt], params)[0]
    assert out.token_ids == again.token_ids == plain.token_ids
    assert out.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    lines = [r.getMessage() for r in caplog.records if "speculative decoding" in r.getMessage()]
    assert len(lines) == 1  # the decision, logged once
    if case == "pays":
        assert stats.plan.speculate and stats.plan.speedup == pytest.approx(2 / 1.2)
        assert stats.drafted > 0 and "on:" in lines[0]
    else:
        assert not stats.plan.speculate and stats.plan.speedup < 1
        assert stats.drafted == drafted_before and stats.main_forwards == 0
        assert "off (decoding plainly)" in lines[0]


def test_draft_costs_are_measured_once_per_engine(engine):
    import megatron_ext.inference.speculative_batch  # noqa: F401  (runs the batched path's rounds)
    from megatron_ext.inference.speculative import (HOST_MEASURED_MARGIN, SPECULATION_MARGIN, DraftCosts,
                                                    measure_draft_costs, plan_speculation)

    eng, _ = engine
    assert DraftCosts(main=1.0, verify=1.0, draft=0.0).speedup([0.5, 0.5]) == pytest.approx(1.75)
    costs = measure_draft_costs(eng, 1, repeats=2)
    assert all(0 < getattr(costs, k) < 10 for k in ("main", "verify", "draft")) and not costs.host_measured
    for path, batch in (("single", 1), ("batched", 1), ("batched", 2)):
        costs = measure_draft_costs(eng, 1, repeats=2, batch=batch, host=path)
        assert costs.host_measured and 0 <= costs.main_host < 10 and 0 <= costs.round_host < 10
    saved = dict(eng.draft_costs), dict(eng.speculation_decisions)
    eng.draft_costs.clear()
    try:
        plan = plan_speculation(eng, 1, path="single")
        assert eng.draft_costs[(1, 1, "single")] is plan.costs
        assert plan_speculation(eng, 1, path="single").costs is plan.costs
        assert plan.costs.host_measured and plan.costs.margin == HOST_MEASURED_MARGIN
        with pytest.raises(ValueError, match="one sequence"):
            plan_speculation(eng, 1, rows=2, path="single")
        with pytest.raises(ValueError, match="path must be one of"):
            plan_speculation(eng, 1, path="host")
        batched = plan_speculation(eng, 1, rows=3)  # a batch of 3: measured at 4 rows, once, its host work too
        assert batched.batch == 4 and eng.draft_costs[(1, 4, "batched")] is batched.costs
        assert all(0 < getattr(batched.costs, k) < 10 for k in ("main", "verify", "draft"))
        assert batched.costs.host_measured and batched.costs.margin == HOST_MEASURED_MARGIN
        assert plan_speculation(eng, 1, rows=1).costs is not plan.costs  # the two paths are measured apart
        assert DraftCosts(main=1.0, verify=1.0, draft=0.0).margin == SPECULATION_MARGIN  # host work not measured
        assert plan.acceptance == [1.0] and plan.speculate == (plan.speedup > HOST_MEASURED_MARGIN)
    finally:
        eng.draft_costs, eng.speculation_decisions = saved


@pytest.mark.parametrize("path", ["single", "batched"])
def test_a_rounds_host_work_is_measured_and_weighs_in_the_decision(engine, monkeypatch, path):
    """Host-side work of a round (here 100 ms added to every acceptance check of a row) is measured from real
    generations of the path (one sequence; two rows decoded together) and counted against drafting, not against
    plain steps; where it was measured, a smaller margin applies than where it was not."""
    from megatron_ext.inference import speculative, speculative_batch
    from megatron_ext.inference.speculative import DraftCosts, measure_draft_costs, measure_host_work, plan_speculation

    eng, _ = engine
    module = speculative_batch if path == "batched" else speculative
    verify, checks = module.verify_drafts, []
    monkeypatch.setattr(module, "verify_drafts", lambda *a: (checks.append(1), time.sleep(0.1), verify(*a))[2])
    rows = 2 if path == "batched" else 1
    step, round_ = measure_host_work(eng, 1, list(range(3, 35)), tokens=3, repeats=3, rows=rows,
                                     batched=path == "batched")
    # the sleep is charged to rounds, not to plain steps (a tiny model's step takes milliseconds on an idle
    # machine; both sides grow alike on a busy one)
    assert checks and round_ >= 0.1 * rows and round_ - step >= 0.05 * rows
    monkeypatch.undo()
    monkeypatch.setattr(speculative, "measure_host_work", lambda *a, **k: (50.0, 100.0))  # seconds, as measured
    costs = measure_draft_costs(eng, 1, repeats=1, batch=rows, host=path)
    assert costs.main_host == pytest.approx(50.0 - costs.main)
    assert costs.round_host == pytest.approx(100.0 - costs.verify - costs.draft)
    monkeypatch.undo()
    # 2 tokens a round for 1 + 0.7 steps: 1.18x, above the measured-host margin, below the other
    measured = DraftCosts(main=1.0, verify=1.6, draft=0.1, host_measured=True)
    assert DraftCosts(main=1.0, verify=1.0, draft=0.1, round_host=0.6).speedup([1.0]) == pytest.approx(2 / 1.7)
    assert DraftCosts(main=1.0, verify=1.6, draft=0.1, main_host=0.1).speedup([1.0]) == pytest.approx(2.2 / 1.7)
    for costs, speculate in ((measured, True), (DraftCosts(main=1.0, verify=1.6, draft=0.1), False)):
        saved = _plan_costs(eng, costs)
        try:
            plan = plan_speculation(eng, 1, path="single")
        finally:
            eng.draft_costs, eng.speculation_decisions = saved
        assert plan.speedup == pytest.approx(2 / 1.7) and plan.speculate == speculate


@pytest.mark.parametrize("descending", [False, True], ids=["ascending", "descending"])
@pytest.mark.parametrize("grouped", [False, True])
def test_sync_free_experts_skip_other_ranks_experts(grouped, descending):
    """Expert parallelism: a rank holding experts 4-7 of 8 sums only the (token, expert) pairs routed to its own
    experts; pairs of other ranks' experts contribute nothing (their rows, sorted last, are computed but masked)."""
    from megatron_ext.inference.engine import _moe_indexed, _swiglu

    g = torch.Generator().manual_seed(0)
    flat = torch.randn(5, 8, generator=g)
    chosen = torch.tensor([[0, 5], [4, 7], [1, 2], [6, 4], [7, 3]])
    weights = torch.rand(5, 2, generator=g)
    fc1, fc2 = torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g)  # 16-byte rows (grouped GEMM)
    expected = torch.zeros_like(flat)
    for t in range(5):
        for e, w in zip(chosen[t].tolist(), weights[t].tolist()):
            if 4 <= e < 8:
                expected[t] += w * _swiglu(flat[t: t + 1], fc1[e - 4], fc2[e - 4])[0]
    if descending:  # stacks holding the last expert first (a distributed optimizer's buffer)
        fc1, fc2 = fc1.flip(0), fc2.flip(0)
    got = _moe_indexed(flat, chosen, weights, fc1, fc2, 4, grouped, descending)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("descending", [False, True], ids=["ascending", "descending"])
def test_all_experts_moe_on_one_rank_weights_each_token_by_its_own_choices(descending):
    """`_moe_all` with every expert on this rank (the routing matrix made by one scatter) against each token's
    chosen experts summed one by one, in either stack order."""
    from megatron_ext.inference.engine import _moe_all, _swiglu

    g = torch.Generator().manual_seed(1)
    flat = torch.randn(4, 8, generator=g)
    chosen = torch.tensor([[0, 5], [7, 2], [3, 6], [5, 1]])
    weights = torch.rand(4, 2, generator=g)
    fc1, fc2 = torch.randn(8, 16, 8, generator=g), torch.randn(8, 8, 8, generator=g)
    expected = torch.stack([sum(w * _swiglu(flat[t: t + 1], fc1[e], fc2[e])[0]
                                for e, w in zip(chosen[t].tolist(), weights[t].tolist())) for t in range(4)])
    if descending:
        fc1, fc2 = fc1.flip(0), fc2.flip(0)
    got = _moe_all(flat, chosen, weights, fc1, fc2, 0, descending, total=8)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if descending:  # the wrong order gives another sum
        assert not torch.allclose(_moe_all(flat, chosen, weights, fc1, fc2, 0, False, total=8), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_the_pairs_megatron_core_rotates_and_keeps_them_interleaved(dtype):
    """The engine's rope (one complex product in fp32, cos/sin in bf16) gives Megatron-Core's MLA rope up to the
    order of the dims: pair i stays at (2i, 2i + 1) where Megatron-Core puts it at (i, i + dr / 2). Query and key
    are permuted alike, so the scores are Megatron-Core's."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_ext.inference.engine import _rope

    s, b, heads, dr = 5, 2, 3, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(s, b, heads, dr, generator=g).to(dtype)
    angles = torch.rand(s, 1, 1, dr // 2, generator=g) * 6
    freqs = torch.cat((angles, angles), dim=-1)  # Megatron-Core's table: the frequencies repeated over both halves
    mscale = 1.3
    megatron = _apply_rotary_pos_emb_bshd(x, freqs, multi_latent_attention=True, mscale=mscale)
    cos, sin = (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)
    rotation = torch.complex(cos, sin) if dtype == torch.float32 else (cos, sin)
    ours = _rope(x, rotation)
    assert ours.shape == x.shape and ours.dtype == dtype
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours[..., 0::2], megatron[..., : dr // 2], **tol)
    torch.testing.assert_close(ours[..., 1::2], megatron[..., dr // 2:], **tol)
    # a query and a key rotated at the same position: the same dot product either way
    torch.testing.assert_close((ours[:, :, :1] * ours[:, :, 1:2]).sum(-1),
                               (megatron[:, :, :1] * megatron[:, :, 1:2]).sum(-1), **tol)


@pytest.mark.parametrize("path", ["all-experts", "grouped-mm", "expert-loop"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_decode_moe_equals_megatron_moe_layer(engine, tokens, path, monkeypatch):
    """The engine's host-synced paths of the routed experts against Megatron-Core's MoE layer itself: one token
    (its shared expert summed with them in one pass); several tokens with every expert run on every token (small
    experts, `_moe_all`), or else token by token (up to _FEW_TOKENS), or more tokens grouped by expert: torch's
    grouped GEMM over the stacked experts, or a loop over the experts touched."""
    from megatron_ext.inference import engine as engine_module

    eng, model = engine
    layer = next(layer for layer in eng.layers if getattr(layer.mlp, "router", None) is not None)
    mlp = layer.mlp
    all_experts = path == "all-experts"
    if not all_experts:
        monkeypatch.setattr(engine_module, "_ALL_EXPERTS_MAX_WORK", 0)
    monkeypatch.setattr(engine_module, "_HOST_GROUPED_MM", path != "expert-loop")
    grouped, real_indexed = [], engine_module._moe_indexed
    monkeypatch.setattr(engine_module, "_moe_indexed", lambda *a: grouped.append(a[6]) or real_indexed(*a))
    called, real_all = [], engine_module._moe_all
    monkeypatch.setattr(engine_module, "_moe_all", lambda *a, **k: called.append(1) or real_all(*a, **k))
    monkeypatch.setattr(eng, "host_sync_free", False)  # these paths also where the model is on a GPU
    h = torch.randn(tokens, 1, eng.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    h = h.to(_dev(model))
    folded = eng._foldable_shared(mlp, h.view(tokens, -1))
    assert (folded is not None) == (tokens == 1)  # the tiny models' shared expert has the routed experts' shape
    with torch.no_grad():
        expected = mlp(h)[0]
    if all_experts and tokens > 1:
        with _NoHostSync():  # every expert on every token: nothing read back to choose weights
            got = eng._moe(mlp, h, None)
    else:
        got = eng._moe(mlp, h, None)
    assert bool(called) == (all_experts and tokens > 1)
    on_cpu_grouped = path == "grouped-mm" and tokens > engine_module._FEW_TOKENS and h.device.type == "cpu"
    assert grouped == ([True] if on_cpu_grouped else [])  # a GPU keeps its own paths
    assert got.shape == h.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prefill_memory_benchmark_generates_the_same_tokens_with_whole_attention():
    """benchmarks/prefill_memory.py at a small size: whole and in pieces, on the engine's path and the absorbed one,
    each reports memory, and all agree on the tokens."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = []
    absorbed = ["--attention", "absorbed"]
    settings = ([], ["--whole-attention"], absorbed, absorbed + ["--whole-attention"])
    for flags in settings:
        done = subprocess.run([sys.executable, "-W", "ignore", "benchmarks/prefill_memory.py", "--prompts", "3",
                               "--tokens", "40", *flags], cwd=root, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        lines.append(done.stdout.strip().splitlines()[-1])
    found = [re.search(r"attention(| \(absorbed\)) (whole|in pieces of at most 256 MiB of scores): peak resident "
                       r"memory ([0-9.]+) GB before, ([0-9.]+) GB after; [0-9.]+ s; tokens ([0-9a-f]{12})$", line)
             for line in lines]
    assert all(found), lines
    pieces, whole = "in pieces of at most 256 MiB of scores", "whole"
    assert [m.group(1, 2) for m in found] == [("", pieces), ("", whole), (" (absorbed)", pieces),
                                              (" (absorbed)", whole)]
    assert len({m.group(5) for m in found}) == 1  # the same tokens on either path, in pieces or whole
    assert all(float(m.group(4)) >= float(m.group(3)) > 0 for m in found)
    # --no-prefix-store only changes how a second turn is prefilled: alone it is refused, not ignored
    alone = subprocess.run([sys.executable, "-W", "ignore", "benchmarks/prefill_memory.py", "--no-prefix-store"],
                           cwd=root, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": root})
    assert alone.returncode == 2 and "--no-prefix-store compares a second turn: give --next-turn N" in alone.stderr


def _count_onednn(monkeypatch):
    """Every product `platform.linear` sends to oneDNN, counted (by weight shape)."""
    from megatron_ext import platform

    taken, real = [], platform.onednn_linear

    def counted(weight):
        yes = real(weight)
        if yes:
            taken.append(tuple(weight.shape))
        return yes

    monkeypatch.setattr(platform, "onednn_linear", counted)
    return taken


def test_onednn_products_give_the_models_logits_and_moe(engine, monkeypatch):
    """With every fp32 product sent to oneDNN (the threshold lowered to 0; the tiny models' weights are below
    the real one): cached decoding equals Megatron-Core's uncached forward, and the MoE layer's one-token path
    (shared expert folded in) and its many-token path (a loop over the experts, which takes over from torch's
    grouped GEMM where oneDNN runs) equal Megatron-Core's MoE layer."""
    from megatron_ext import platform
    from megatron_ext.inference import engine as engine_module

    eng, model = engine
    if not platform.CPU_LINEAR_ONEDNN or _dev(model).type != "cpu":
        pytest.skip("oneDNN products are for x86 CPUs")
    monkeypatch.setattr(platform, "ONEDNN_LINEAR_MIN_BYTES", 0)
    monkeypatch.setattr(platform, "CPU_LINEAR_CHOICE", "onednn")  # whatever this CPU measured
    taken = _count_onednn(monkeypatch)
    ids = torch.randint(0, 1024, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = LatentCache(len(eng.layers), 1, 32, eng.config.kv_lora_rank, eng.config.qk_pos_emb_head_dim,
                        torch.float32, _dev(model))
    prefix = 9
    parts = [eng.forward(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], cache, torch.tensor([0]))[0]]
    for t in range(prefix, len(ids)):
        parts.append(eng.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache, torch.tensor([t]))[0])
    torch.testing.assert_close(torch.cat(parts), _full_logits(model, ids), rtol=1e-5, atol=1e-5)
    vocab = model.output_layer.weight.shape
    assert tuple(vocab) in taken and len(set(taken)) >= 4, set(taken)  # projections, experts, output layer

    layer = next(layer for layer in eng.layers if getattr(layer.mlp, "router", None) is not None)
    mlp = layer.mlp
    expert_fc1 = tuple(eng._experts[id(mlp)][0][0].shape)
    monkeypatch.setattr(engine_module, "_ALL_EXPERTS_MAX_WORK", 0)
    grouped, real_indexed = [], engine_module._moe_indexed
    monkeypatch.setattr(engine_module, "_moe_indexed", lambda *a: grouped.append(a[6]) or real_indexed(*a))
    for tokens in (1, 8):
        h = torch.randn(tokens, 1, eng.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
        taken.clear()
        with torch.no_grad():
            expected = mlp(h)[0]
            got = eng._moe(mlp, h, None)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert expert_fc1 in taken
    assert grouped == []  # the loop over the experts, not torch's grouped GEMM


def test_prefix_store_prefills_only_a_continued_prompts_new_tokens(engine):
    """A multi-turn episode's next prompt (the last prompt, its sampled tokens, a tool's output) starts from the
    finished row's cache: only the new tokens are prefilled, and the tokens and log-probabilities are those of a
    prefill of the whole conversation. Stale weights, prompts that do not continue an entry and the byte budget
    fall back to a full prefill."""
    eng, _ = engine
    version = eng.weights_version
    g = torch.Generator().manual_seed(6)
    first = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (40, 25, 33)]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    observation = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (7, 12, 3)]
    try:
        store = eng.enable_prefix_store(64)
        turn1 = eng.generate(first, params)
        assert len(store.entries) == 3
        second = [p + c.token_ids + o for p, c, o in zip(first, turn1, observation)]
        before = eng.prefill_tokens
        cached = eng.generate(second, params)
        # each row's newest sampled token (never fed) and the observation
        assert eng.prefill_tokens - before == sum(1 + len(o) for o in observation)
        assert store.hits == 3 and store.reused_tokens == sum(len(p) + len(c.token_ids) - 1
                                                              for p, c in zip(first, turn1))
        eng.enable_prefix_store(0)
        before = eng.prefill_tokens
        whole = eng.generate(second, params)
        assert eng.prefill_tokens - before == sum(len(p) for p in second)
        for a, b in zip(cached, whole):
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)

        store = eng.enable_prefix_store(64)  # other weights: the entry is never used
        turn1 = eng.generate(first[:1], params)
        eng.weights_version += 1
        eng.generate([first[0] + turn1[0].token_ids + [5]], params)
        assert store.hits == 0 and [v for _, _, v in store.entries.values()] == [eng.weights_version]
        eng.generate(first[:1], params)  # a prompt that is not a continuation, or the same prompt again: no hit
        eng.generate(first[:1], params)
        assert store.hits == 0
        small = eng.enable_prefix_store(1e-6)  # smaller than any entry: nothing kept
        eng.generate(first, params)
        assert not small.entries and small.bytes == 0
    finally:
        eng.enable_prefix_store(0)
        eng.weights_version = version
