"""Every tensor the training step builds lands on the model's device (checked with the meta device as the GPU:
a host tensor meeting a device tensor raises), and collectives use tensors on the process group's device."""

import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

import pretrain_composer as entry
from megatron_ext import platform
from megatron_ext.arguments import parse_args
from megatron_ext.data import batches
from megatron_ext.training import lm
from megatron_ext.models.provider import model_provider
from megatron_ext.mtp import distill
from megatron_ext.testing import DevicePlacementError, meta_device_as_gpu
from megatron_ext.training import loop
from megatron_ext.training.initialize import destroy, initialize_distributed


@pytest.fixture(scope="module")
def dense_args():
    # Dense: Megatron-Core's MoE dispatcher has ops without meta kernels (masked_select); attention, MLA, rotary,
    # MTP self-distillation, embedding, head and loss all run.
    args = parse_args(["--model", "tiny", "--mock-data", "--num-experts", "0", "--seq-length", "32",
                       "--micro-batch-size", "2"], world_size=1)
    initialize_distributed(args)
    yield args
    # the MTP metrics recorded on meta tensors must not reach a later test's step
    distill._METRICS.clear()
    MTPLossLoggingHelper.tracker.clear()
    clear_aux_losses_tracker()
    destroy()


def test_training_step_runs_with_every_tensor_on_the_device(dense_args):
    with meta_device_as_gpu():
        with torch.device("meta"):
            model = model_provider(dense_args)
        assert {p.device.type for p in model.parameters()} == {"meta"}
        output, loss_func = entry.forward_step(entry.train_data_iterator(dense_args, 0), model)
        loss, num_tokens, report = loss_func(output)
        loss.backward()
    assert output.device.type == loss.device.type == num_tokens.device.type == "meta"
    assert output.shape == (2, 32) and report["lm loss"].device.type == "meta"
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)


def test_the_check_catches_a_host_batch(dense_args, monkeypatch):
    """The check has teeth: batches left on the host (the bug this fixes) raise at the embedding."""
    monkeypatch.setattr(lm, "to_device", lambda batch, packed=None, device=None: (batch, packed))
    with meta_device_as_gpu():
        with torch.device("meta"):
            model = model_provider(dense_args)
        with pytest.raises(DevicePlacementError, match="embedding"):
            entry.forward_step(entry.train_data_iterator(dense_args, 0), model)


def test_micro_batches_and_packed_params_on_the_device():
    fetch = lambda idx: {"tokens": torch.arange(8).view(1, 8).repeat(len(idx), 1),
                         "loss_mask": torch.ones(len(idx), 8),
                         "cu_seqlens": torch.tensor([[0, 3, 8, -1]] * len(idx), dtype=torch.int32)}
    with meta_device_as_gpu():
        flat, params = lm.prepare_batch(next(batches.microbatches(fetch, 0, 4, 2, 0, 1)))
    assert flat["tokens"].device.type == flat["loss_mask"].device.type == "meta" and "cu_seqlens" not in flat
    assert params.cu_seqlens_q.device.type == params.cu_seqlens_kv.device.type == "meta"
    assert params.max_seqlen_q == 5  # documents 0-3, 3-8, 8-11, 11-16
    assert params.cu_seqlens_q.shape == (5,) and params.cu_seqlens_q.dtype == torch.int32


def test_sigterm_check_reduces_a_tensor_on_the_group_device(dense_args, monkeypatch):
    seen = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(platform, "device", lambda: torch.device("meta"))
    sigterm = loop.SigtermWatcher()
    try:
        with pytest.raises(RuntimeError, match="meta"):  # the meta flag cannot be read back; its device is what counts
            sigterm.any_rank()
    finally:
        sigterm.restore()
    assert seen == [torch.device("meta")]

