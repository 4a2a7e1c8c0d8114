"""MTP self-distillation against a direct computation, and the detached trunk."""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.arguments import parse_args
from megatron_ext.data.mock import mock_batch
from megatron_ext.mtp import distill
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


def _model(flags):
    args = parse_args(["--model", "tiny", "--mock-data", *flags], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=2))[0]
    return args, model


def _batch(args):
    b = mock_batch(range(2), args.seq_length, args.vocab_size, args.seed)
    b["loss_mask"][0, -5:] = 0  # masked targets must not count
    return b


def _forward(model, b):
    return model(b["tokens"], b["position_ids"], None, labels=b["labels"], loss_mask=b["loss_mask"])


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_self_distillation_equals_direct_kl(temperature):
    args, model = _model(["--mtp-distill-temperature", str(temperature)])
    try:
        b = _batch(args)
        distill.pop_metrics(1)
        _forward(model, b)
        got = distill.pop_metrics(1)["mtp_1 distill loss"]
        with torch.no_grad():  # the reference: Megatron's decoder and MTP block, then the KL by hand
            pos = b["position_ids"]
            hidden = model.decoder(model.embedding(b["tokens"], pos), attention_mask=None)
            both = model.mtp(input_ids=b["tokens"], position_ids=pos, hidden_states=hidden, attention_mask=None,
                             embedding=model.embedding)
            main, mtp = (model.output_layer(h)[0].float().transpose(0, 1) for h in torch.chunk(both, 2, dim=0))
            p = F.log_softmax(main[:, 1:] / temperature, -1)  # target: the main head one position later
            q = F.log_softmax(mtp[:, :-1] / temperature, -1)
            kl = (p.exp() * (p - q)).sum(-1)
            mask = b["loss_mask"][:, 1:] * b["loss_mask"][:, :-1]
            want = float((kl * mask).sum() / mask.sum())
        assert got == pytest.approx(want, rel=1e-5)
    finally:
        destroy()


def _trunk_grads(flags):
    args, model = _model(flags)
    try:
        model.train()
        b = _batch(args)
        loss = (_forward(model, b) * b["loss_mask"]).sum() / b["loss_mask"].sum()
        loss.backward()
        distill.pop_metrics(1)
        return {n: p.grad.clone() for n, p in model.named_parameters()
                if not n.startswith("mtp.") and p.grad is not None}
    finally:
        destroy()


def test_detached_trunk_gets_exactly_the_main_loss_gradients():
    without_mtp = _trunk_grads(["--mtp-num-layers", "0"])  # same trunk weights (initialised by checkpoint key)
    detached = _trunk_grads(["--mtp-loss-scaling-factor", "0.5", "--mtp-detach-trunk"])
    attached = _trunk_grads(["--mtp-loss-scaling-factor", "0.5"])
    assert set(detached) == set(without_mtp)
    for name, grad in without_mtp.items():
        assert torch.equal(detached[name], grad), name
    # the check can fail: without detaching, MTP gradients reach the trunk, embedding and head
    assert any(not torch.allclose(attached[n], g) for n, g in without_mtp.items())


def test_packed_documents_do_not_distill_across_boundaries():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    mask = distill.shifted_mask(torch.ones(1, 10), 1, params)
    assert mask.tolist() == [[1, 1, 0, 1, 1, 1, 0, 1, 1, 0]]
