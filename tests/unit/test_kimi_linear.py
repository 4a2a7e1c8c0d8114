"""The Kimi Linear hybrid: flags, presets, the layer stack, training, and decoding with KDA states + MLA latents."""

import os
import subprocess
import sys

import pytest
import torch

import pretrain_composer as entry
from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.models.kda import KimiDeltaAttention, NoPositionMLA
from megatron_ext.models.presets import PRESETS, parameter_counts, parse_layer_pattern
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model
from tests.tb import scalars

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_layer_pattern_forms_and_errors():
    assert parse_layer_pattern("KKKM KKKM", 8) == "KKKMKKKM"
    assert parse_layer_pattern("kda KDA kda mla", 4) == "KKKM"
    with pytest.raises(ValueError, match="names 3 layers but --num-layers is 4"):
        parse_layer_pattern("KKM", 4)
    with pytest.raises(ValueError, match="unknown layer kind"):
        parse_layer_pattern("KKXM", 4)
    with pytest.raises(ArgumentError, match="--hybrid-layer-pattern"):
        parse_args(["--model", "tiny-kimi-linear", "--mock-data", "--hybrid-layer-pattern", "KKM"], world_size=1)
    with pytest.raises(ArgumentError, match="--kda-num-heads 4 is not divisible"):
        parse_args(["--model", "tiny-kimi-linear", "--mock-data", "--tensor-model-parallel-size", "8",
                    "--sequence-parallel", "--num-attention-heads", "8", "--num-experts", "8"], world_size=8)
    args = parse_args(["--model", "tiny", "--mock-data", "--hybrid-layer-pattern", "KDA MLA KDA MLA",
                       "--kda-num-heads", "2", "--kda-head-dim", "8", "--no-mla-nope"], world_size=1)
    assert args.arch.hybrid_layer_pattern == "KMKM" and not args.arch.mla_nope


def test_kimi_linear_48b_counts_match_the_published_48b_a3b():
    total, active = parameter_counts(PRESETS["kimi-linear-48b"])
    arch = PRESETS["kimi-linear-48b"]
    assert abs(total / 48e9 - 1) < 0.03, total
    # "3B activated": the embedding table is looked up, not multiplied; without it the count is 3.1B
    assert abs((active - arch.vocab_size * arch.hidden_size) / 3e9 - 1) < 0.05, active
    assert arch.hybrid_layer_pattern.count("M") == 7 and arch.hybrid_layer_pattern[-1] == "M"
    out = subprocess.run([sys.executable, "-W", "ignore", "pretrain_composer.py", "--model", "kimi-linear-48b",
                          "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ") for line in out.stdout.strip().splitlines() if " parameters" in line)
    assert int(lines["total parameters"]) == total  # the vocabulary 163,840 needs no padding
    assert abs(int(lines["active parameters per token without the input embedding"]) / 3e9 - 1) < 0.05


@pytest.fixture(scope="module")
def hybrid():
    args = parse_args(["--model", "tiny-kimi-linear", "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=5))[0]
    model.eval()
    yield model
    destroy()


def _full_logits(model, ids, offset=0):
    """Megatron-Core's TransformerBlock without any cache (GPTModel.forward wants labels once MTP exists)."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        positions = torch.arange(len(ids)).unsqueeze(0) + offset
        h = model.decoder(model.embedding(tokens, positions), attention_mask=None)
        return model.output_layer(h)[0][:, 0].float()


def test_layers_follow_the_pattern(hybrid):
    kinds = ["K" if isinstance(layer.self_attention, KimiDeltaAttention) else "M" for layer in hybrid.decoder.layers]
    assert "".join(kinds) == "KKKM"
    mla = hybrid.decoder.layers[3].self_attention
    assert isinstance(mla, NoPositionMLA) and not mla.rotary_pos_emb.inv_freq.any()
    assert isinstance(hybrid.mtp.layers[0].transformer_layer.self_attention, NoPositionMLA)


def test_decode_with_state_cache_equals_full_forward(hybrid):
    engine = InferenceEngine(hybrid)
    ids = torch.randint(0, 1000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    full = _full_logits(hybrid, ids)
    cache = engine.new_cache(len(engine.layers), 1, len(ids))
    prefill = 70  # > one 64-token chunk
    logits = [engine.forward(torch.tensor([ids[:prefill]]), torch.arange(prefill).unsqueeze(0), cache,
                             torch.tensor([0]))[0]]
    for t in range(prefill, len(ids)):
        logits.append(engine.forward(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache, torch.tensor([t]))[0])
    ours = torch.cat(logits)
    assert ((ours - full).abs().max() / full.abs().max()).item() < 1e-4
    kda_states = [s for s in cache.states if s is not None]
    assert len(kda_states) == 3 and kda_states[0][1].shape == (1, 4, 16, 16)
    assert [t.size(1) for t in cache.kv] == [0, 0, 0, len(ids)]  # latents only for the MLA layer


def test_batched_generation_of_unequal_prompts_equals_one_by_one(hybrid):
    """Right-padded prefill must not leak padding into the KDA state or convolution tail; groups fork the state."""
    engine = InferenceEngine(hybrid)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = SamplingParams(max_tokens=6, temperature=0)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for a, b in zip(together, alone):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    groups = engine.generate_groups(prompts[:2], 2, SamplingParams(max_tokens=4, temperature=0))
    assert [c.token_ids for c in groups[1]] == [alone[1].token_ids[:4]] * 2


def test_packed_documents_equal_separate_sequences(hybrid):
    """THD packing: the KDA layer restarts its convolution and state at every document start."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attn = hybrid.decoder.layers[1].self_attention
    g = torch.Generator().manual_seed(4)
    docs = [torch.randn(n, 1, 64, generator=g) for n in (30, 1, 70)]
    cu = torch.tensor([0, 30, 31, 101], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=70, max_seqlen_kv=70)
    with torch.no_grad():
        packed, _ = attn(torch.cat(docs), packed_seq_params=params)
        alone = torch.cat([attn(d)[0] for d in docs])
    assert torch.allclose(packed, alone, atol=1e-5)
    with torch.no_grad():
        joined, _ = attn(torch.cat(docs))  # without the boundaries the later documents see the earlier ones
    assert not torch.allclose(joined[31:], alone[31:], atol=1e-3)



def test_mtp_on_the_hybrid_matches_megatron_and_speculation_is_refused(hybrid):
    """The MTP layer (MLA without positions, like the last decoder layer) in the engine = Megatron-Core's MTP
    block on the hybrid trunk's hidden states; speculative decoding is refused (states cannot roll back)."""
    from megatron_ext.inference.engine import LatentCache
    from megatron_ext.inference.speculative import SpeculationStats, generate_speculative

    engine = InferenceEngine(hybrid)
    ids = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    tokens, pos = torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)
    with torch.no_grad():
        hidden = hybrid.decoder(hybrid.embedding(tokens, pos), attention_mask=None)
        both = hybrid.mtp(input_ids=tokens, position_ids=pos, hidden_states=hidden, attention_mask=None,
                          embedding=hybrid.embedding)
        reference = hybrid.output_layer(torch.chunk(both, 2, dim=0)[1])[0][:, 0].float()
    cache = engine.new_cache(1, 1, 32)
    assert isinstance(cache, LatentCache) and cache.states == [None]
    s = len(ids) - 1
    ours = engine.mtp_forward(hidden[:s], tokens[:, 1:], pos[:, :s], cache, torch.tensor([0]))[0]
    torch.testing.assert_close(ours, reference[:s], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not supported for Kimi Linear"):
        generate_speculative(engine, ids[:5], SamplingParams(max_tokens=4, temperature=0), SpeculationStats())

# last: pretrain_composer.main tears down the process groups the module fixture's model was built with
def test_tiny_kimi_linear_trains_and_resumes(tmp_path):
    flags = ["--model", "tiny-kimi-linear", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--lr", "3e-3", "--seq-length", "32", "--log-interval", "1", "--train-iters", "8",
             "--lr-warmup-iters", "2"]
    save = str(tmp_path / "ckpt")
    assert entry.main(flags + ["--tensorboard-dir", str(tmp_path / "full")]) == 0
    full = scalars(str(tmp_path / "full"))
    assert full["lm loss"][8] < full["lm loss"][1]
    assert entry.main(flags + ["--save", save, "--save-interval", "4", "--exit-interval", "4"]) == 0
    assert entry.main(flags + ["--load", save, "--tensorboard-dir", str(tmp_path / "resumed")]) == 0
    resumed = scalars(str(tmp_path / "resumed"))
    for step in (5, 6, 7, 8):
        assert resumed["lm loss"][step] == full["lm loss"][step]
