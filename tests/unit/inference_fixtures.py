"""The tiny K2.5 with layout-invariant weights and an inference engine on it, for the engine's tests; a random
tiny model with a trained tokenizer served over the OpenAI-compatible API, for agent tests."""

import contextlib

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


@contextlib.contextmanager
def served_chat_model(directory: str):
    """(url, tokenizer, tokenizer dir): a random tiny model with a 1024-id tokenizer trained on the standard
    library behind tools/serve.py's HTTP service (uvicorn in this process, a free loopback port)."""
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.inference.server import ModelService, serve
    from tests.unit.data_fixtures import small_corpus, trained_tokenizer

    tokenizer_dir = trained_tokenizer(directory, small_corpus(directory), vocab_size=1024)
    tokenizer = build_tokenizer(None, tokenizer_dir)
    args = parse_args(["--model", "tiny", "--mock-data", "--vocab-size", str(tokenizer.vocab_size),
                       "--seq-length", "8192", "--max-position-embeddings", "8192"], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)
        httpd = serve(ModelService(InferenceEngine(model[0]), "tiny", tokenizer=tokenizer), "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{httpd.server_address[1]}", tokenizer, tokenizer_dir
        finally:
            httpd.shutdown()
    finally:
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
