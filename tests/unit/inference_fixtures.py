"""The tiny K2.5 with layout-invariant weights and an inference engine on it, for the engine's tests."""

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


@pytest.fixture(scope="module")
def engine():
    """(engine, model): the tiny preset, one rank, eval mode (import this fixture into a test module)."""
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
    model.eval()
    yield InferenceEngine(model), model
    destroy()


def uncached_forward(model, ids: list[int]) -> torch.Tensor:
    """Megatron-Core's own TransformerBlock over `ids` without any cache: the final hidden states [s, 1, h]
    (GPTModel.forward needs labels once MTP layers exist)."""
    tokens = torch.tensor([ids])
    with torch.no_grad():
        return model.decoder(model.embedding(tokens, torch.arange(len(ids)).unsqueeze(0)), attention_mask=None)


def uncached_logits(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits [len(ids), vocab] of the uncached forward."""
    with torch.no_grad():
        return model.output_layer(uncached_forward(model, ids))[0][:, 0].float()
