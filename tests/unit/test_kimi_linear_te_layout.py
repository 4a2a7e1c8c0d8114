"""The Kimi Linear hybrid under Megatron-Core's Transformer Engine spec (built from CPU modules with TE's names):
KDA layers and position-free MLA replace the TE spec's attention, checkpoint keys equal the local backend's, and a
local checkpoint loads into the TE-shaped model with the same losses."""

import argparse

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.models.kda import KimiDeltaAttention, NoPositionMLA
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model
from tests.unit.test_te_layout import _checkpoint_keys, _logits, _te_args, _te_model


@pytest.fixture(scope="module")
def args():
    args = parse_args(["--model", "tiny-kimi-linear", "--no-save-optim"], world_size=1)
    initialize_distributed(args)
    yield args
    destroy()


def test_te_spec_hybrid_matches_local(args, tmp_path):
    local = build_model(args, wrap_ddp=False)
    init_layout_invariant_(local[0], seed=3)
    te = _te_model(_te_args(args))
    layers = te[0].decoder.layers
    assert [type(layer.self_attention) is KimiDeltaAttention for layer in layers] == [True, True, True, False]
    assert isinstance(layers[3].self_attention, NoPositionMLA)
    assert type(layers[0].input_layernorm).__name__ == "RMSNorm"  # a real norm before KDA under the TE spec
    assert _checkpoint_keys(local[0]) == _checkpoint_keys(te[0])
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = _logits(local[0], tokens)
    save_checkpoint(argparse.Namespace(**{**vars(args), "save": str(tmp_path / "local")}), 1, local, None, None)
    te_args = _te_args(args, load=str(tmp_path / "local"))
    load_checkpoint(te_args, te, None, None, log=lambda *a, **k: None)
    assert torch.allclose(_logits(te[0], tokens), expected, atol=1e-5)
