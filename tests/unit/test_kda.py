"""Kimi Delta Attention: our chunked and recurrent forms against transformers' KimiLinear reference functions."""

import pytest
import torch

from megatron_ext.models import kda

ref = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _inputs(b=2, t=150, n=3, dk=16, dv=16, seed=0, fast_decay=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, n, dk, generator=g)
    k = torch.randn(b, t, n, dk, generator=g)
    v = torch.randn(b, t, n, dv, generator=g)
    A = torch.empty(n).uniform_(1, 16, generator=g)
    f = torch.randn(b, t, n, dk, generator=g) * (4.0 if fast_decay else 1.0)
    gate = -A.view(1, 1, n, 1) * torch.nn.functional.softplus(f)
    beta = torch.rand(b, t, n, generator=g)
    return q, k, v, gate, beta


def _ours(fn, q, k, v, g, beta, state=None):
    return fn(kda.l2norm(q), kda.l2norm(k), v, g, beta, initial_state=state)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 150])  # inside one chunk, at and across chunk boundaries
def test_chunked_equals_recurrent_equals_transformers(t):
    q, k, v, g, beta = _inputs(t=t)
    want, want_state = ref.recurrent_kimi_delta_attention(q, k, v, g, beta, None, True, use_qk_l2norm_in_kernel=True)
    want_chunk, _ = ref.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=None, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    rec, rec_state = _ours(kda.recurrent_kda, q, k, v, g, beta)
    chunk, chunk_state = _ours(kda.chunk_kda, q, k, v, g, beta)
    scale = want.abs().max()
    assert ((rec - want).abs().max() / scale) < 1e-4
    assert ((chunk - want).abs().max() / scale) < 1e-4
    assert ((want_chunk - want).abs().max() / scale) < 1e-4  # the two references agree too
    assert torch.allclose(chunk_state, want_state, atol=1e-4, rtol=1e-4)
    assert torch.allclose(rec_state, want_state, atol=1e-4, rtol=1e-4)


def test_initial_state_and_fast_decay():
    """A prefix summarised as a state continues exactly; decays of thousands of nats per chunk stay finite."""
    q, k, v, g, beta = _inputs(t=130, fast_decay=True)
    full, _ = ref.recurrent_kimi_delta_attention(q, k, v, g, beta, None, True, use_qk_l2norm_in_kernel=True)
    assert g.sum(1).min() < -1000
    head, state = _ours(kda.chunk_kda, q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70])
    tail, _ = _ours(kda.chunk_kda, q[:, 70:], k[:, 70:], v[:, 70:], g[:, 70:], beta[:, 70:], state)
    out = torch.cat((head, tail), 1)
    assert torch.isfinite(out).all()
    assert ((out - full).abs().max() / full.abs().max()) < 1e-4


def test_packed_documents_restart_the_state():
    q, k, v, g, beta = _inputs(b=1, t=200)
    cu = torch.tensor([0, 50, 51, 190, 200])
    out, _ = kda.delta_rule(kda.l2norm(q), kda.l2norm(k), v, g, beta, cu_seqlens=cu)
    for a, z in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want, _ = ref.recurrent_kimi_delta_attention(q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], beta[:, a:z],
                                                     None, False, use_qk_l2norm_in_kernel=True)
        assert ((out[:, a:z] - want).abs().max() / want.abs().max()) < 1e-4


def test_chunked_gradients_equal_recurrent():
    q, k, v, g, beta = _inputs(b=1, t=70, n=2, dk=8, dv=8)
    grads = []
    for fn in (kda.recurrent_kda, kda.chunk_kda):
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        out, state = _ours(fn, *xs)
        (out.pow(2).sum() + state.sum()).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)


def test_short_conv_matches_conv1d_and_stops_at_documents():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 12, 6, generator=g)
    w = torch.randn(6, 1, 4, generator=g)
    want = ref.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), activation="silu").transpose(1, 2)
    assert torch.allclose(kda.short_conv(x, w), want, atol=1e-6)
    docs = torch.tensor([0] * 5 + [1] * 7)
    packed = kda.short_conv(x, w, doc_ids=docs)
    assert torch.allclose(packed[:, 5:], kda.short_conv(x[:, 5:], w), atol=1e-6)
    # decoding: the tail of the previous tokens continues the convolution
    assert torch.allclose(kda.short_conv(x[:, 9:], w, tail=x[:, 6:9]), want[:, 9:], atol=1e-6)
