"""The Kimi Linear hybrid's training step makes every tensor on the model's device (the meta device standing in
for the GPU: a host tensor meeting a device tensor raises), KDA's chunked recurrence included."""

import torch
from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

import pretrain_composer as entry
from megatron_ext.arguments import parse_args
from megatron_ext.models.kda import KimiDeltaAttention
from megatron_ext.models.provider import model_provider
from megatron_ext.mtp import distill
from megatron_ext.testing import meta_device_as_gpu
from megatron_ext.training.initialize import destroy, initialize_distributed


def test_hybrid_training_step_runs_with_every_tensor_on_the_device():
    # dense (--num-experts 0): Megatron-Core's MoE dispatcher has ops without meta kernels
    args = parse_args(["--model", "tiny-kimi-linear", "--mock-data", "--num-experts", "0", "--seq-length", "80",
                       "--micro-batch-size", "2"], world_size=1)
    initialize_distributed(args)
    try:
        with meta_device_as_gpu():
            with torch.device("meta"):
                model = model_provider(args)
            assert isinstance(model.decoder.layers[0].self_attention, KimiDeltaAttention)
            assert {p.device.type for p in model.parameters()} == {"meta"}
            output, loss_func = entry.forward_step(entry.train_data_iterator(args, 0), model)
            loss, _, _ = loss_func(output)
            loss.backward()
        assert output.device.type == loss.device.type == "meta" and output.shape == (2, 80)  # two KDA chunks
        assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)
    finally:
        distill._METRICS.clear()
        MTPLossLoggingHelper.tracker.clear()
        clear_aux_losses_tracker()
        destroy()
