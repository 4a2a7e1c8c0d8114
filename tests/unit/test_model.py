"""The model as built by model_provider: parameter counts, MTP block, core attention semantics."""

import math
import subprocess
import sys

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.models.attention import CoreAttention
from megatron_ext.models.presets import KIMI_K2_5, parameter_counts
from megatron_ext.models.provider import transformer_config
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


@pytest.fixture(scope="module")
def single_rank():
    yield
    destroy()


@pytest.mark.parametrize("preset", ["tiny", "tiny-no-qlora"])
def test_analytic_counts_match_the_built_model(preset, single_rank):
    args = parse_args(["--model", preset], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)[0]
    built = sum(p.numel() for p in model.parameters())
    total, active = parameter_counts(args.arch.replace(vocab_size=args.padded_vocab_size))
    assert built == total
    assert active < total
    assert model.mtp is not None and len(model.mtp.layers) == args.arch.mtp_num_layers
    # the first layer is dense, the others MoE with a shared expert and expert bias
    layers = model.decoder.layers
    assert not hasattr(layers[0].mlp, "router")
    assert layers[-1].mlp.router.expert_bias is not None
    assert layers[-1].mlp.shared_experts is not None


def test_kimi_k25_dry_run_counts():
    total, active = parameter_counts(KIMI_K2_5)
    assert 1.0e12 < total < 1.06e12  # "about 1.04T"
    assert 31e9 < active < 34e9  # "about 32B active"
    out = subprocess.run([sys.executable, "-W", "ignore", "pretrain_composer.py", "--model", "kimi-k2.5", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ") for line in out.stdout.strip().splitlines() if " parameters" in line)
    assert int(lines["total parameters"]) == total
    assert int(lines["active parameters per token"]) == active


def _naive_attention(q, k, v, scale, mask):
    # q, k: [s, b, n, dk], v: [s, b, n, dv]; mask True = attend
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).flatten(2)


def _core(config_args=("--model", "tiny")):
    from megatron.core.transformer.enums import AttnMaskType

    cfg = transformer_config(parse_args(list(config_args), world_size=1))
    return CoreAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, softmax_scale=0.3)


def test_core_attention_mla_dims_causal():
    torch.manual_seed(0)
    s, b, n = 7, 2, 3
    q, k, v = torch.randn(s, b, n, 24), torch.randn(s, b, n, 24), torch.randn(s, b, n, 16)
    out = _core()(q, k, v, None)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    torch.testing.assert_close(out, _naive_attention(q, k, v, 0.3, causal))


@pytest.mark.parametrize("packed", [False, True])
def test_core_attention_mla_dims_train_in_the_fused_kernel(packed):
    """Values narrower than keys (MLA) train in SDPA's fused kernel, forward and backward, never in its
    score-materialising math path (most of an SFT step before), with the naive reference's output and gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.profiler import profile

    torch.manual_seed(0)
    s, n = 9, 3
    q, k, v = (torch.randn(s, 1, n, d, dtype=torch.float64, requires_grad=True) for d in (24, 24, 16))
    params = None
    if packed:  # two documents: the per-document path
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5,
                                 max_seqlen_kv=5)
    with profile() as prof:
        if packed:
            out = _core()(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params).unsqueeze(1)
        else:
            out = _core()(q, k, v, None)
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    if packed:
        mask[4:, :4] = False
    reference = _naive_attention(q, k, v, 0.3, mask)
    torch.testing.assert_close(out, reference)
    for got, want in zip(grads, torch.autograd.grad(reference.pow(2).sum(), (q, k, v))):
        torch.testing.assert_close(got, want)
    assert grads[2].shape == v.shape


def test_core_attention_packed_documents_do_not_mix():
    from megatron.core.packed_seq_params import PackedSeqParams

    torch.manual_seed(0)
    lengths = [3, 5, 2]
    t, n = sum(lengths), 2
    q, k, v = torch.randn(t, n, 24), torch.randn(t, n, 24), torch.randn(t, n, 16)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    packed = _core()(q, k, v, None, packed_seq_params=params)
    pieces = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        sl = slice(lo, hi)
        pieces.append(_core()(q[sl].unsqueeze(1), k[sl].unsqueeze(1), v[sl].unsqueeze(1), None).squeeze(1))
    torch.testing.assert_close(packed, torch.cat(pieces))


def test_core_attention_decode_is_bottom_right_causal():
    torch.manual_seed(0)
    sk, sq, b, n = 6, 2, 1, 2
    q, k, v = torch.randn(sq, b, n, 24), torch.randn(sk, b, n, 24), torch.randn(sk, b, n, 16)
    out = _core()(q, k, v, None)
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    torch.testing.assert_close(out, _naive_attention(q, k, v, 0.3, mask))
    assert math.isfinite(out.abs().sum().item())
