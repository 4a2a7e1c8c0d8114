"""One checkpoint layout for both backends: the local spec saves Transformer Engine's keys (fused latent and
pre-MLP norms as ``layer_norm_weight``), and checkpoints move between the local model and a TE-shaped model
(Megatron-Core's own TE spec built from CPU modules with TE's parameter names) in both directions."""

import argparse

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megatron_ext.arguments import parse_args
from megatron_ext.models.te_layout import NormColumnParallelLinear, te_spec_on_cpu
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


@pytest.fixture(scope="module")
def args():
    args = parse_args(["--model", "tiny", "--no-save-optim"], world_size=1)
    initialize_distributed(args)
    yield args
    destroy()


def _te_args(args, **changes):
    return argparse.Namespace(**{**vars(args), "transformer_impl": "transformer_engine", **changes})


def _te_model(args):
    with te_spec_on_cpu():
        return build_model(args, wrap_ddp=False)


def _checkpoint_keys(model) -> set[str]:
    sharded = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    return {v.key for v in sharded.values() if not isinstance(v, ShardedObject)}


def test_local_checkpoint_keys_are_exactly_the_te_specs(args):
    local = build_model(args, wrap_ddp=False)[0]
    te = _te_model(_te_args(args))[0]
    # the TE-shaped model really is Megatron-Core's TE spec: norms fused into the next linear, identities left
    layer0, layer1 = te.decoder.layers[0], te.decoder.layers[1]
    assert isinstance(layer0.self_attention.linear_q_up_proj, NormColumnParallelLinear)
    assert isinstance(layer0.mlp.linear_fc1, NormColumnParallelLinear)
    assert type(layer0.pre_mlp_layernorm).__name__ == "IdentityOp"
    assert type(layer1.pre_mlp_layernorm).__name__ == "RMSNorm"  # MoE: the router reads the normed input
    keys = _checkpoint_keys(local)
    assert keys == _checkpoint_keys(te)
    fused = {k for k in keys if k.endswith("layer_norm_weight")}
    n, mtp = args.num_layers, args.mtp_num_layers
    assert len(fused) == 2 * (n + mtp) + args.first_k_dense_replace
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in fused
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight" in fused
    assert not any("q_layernorm" in k or "kv_layernorm" in k for k in keys)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in keys and "decoder.layers.1.pre_mlp_layernorm.weight" in keys


def _logits(model, tokens):
    """Per-token LM losses against shifted tokens (the model takes labels when it has MTP layers)."""
    model.eval()
    with torch.no_grad():
        positions = torch.arange(tokens.size(1)).expand_as(tokens)
        return model(tokens, positions, None, labels=tokens.roll(-1, 1))


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def test_checkpoints_move_between_backends(args, tmp_path):
    local = build_model(args, wrap_ddp=False)
    init_layout_invariant_(local[0], seed=3)  # norms away from one: a skipped norm would show
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = _logits(local[0], tokens)
    save_checkpoint(argparse.Namespace(**{**vars(args), "save": str(tmp_path / "local")}), 1, local, None, None)

    te_args = _te_args(args, load=str(tmp_path / "local"), finetune=True, save=str(tmp_path / "te"))
    te = _te_model(te_args)
    load_checkpoint(te_args, te, None, None, log=lambda *a, **k: None)
    norm = te[0].decoder.layers[0].self_attention.linear_kv_up_proj.layer_norm_weight
    assert torch.equal(norm, local[0].decoder.layers[0].self_attention.kv_layernorm.weight)
    assert torch.allclose(_logits(te[0], tokens), expected, rtol=0, atol=1e-5)

    save_checkpoint(te_args, 2, te, None, None)
    back_args = argparse.Namespace(**{**vars(args), "load": str(tmp_path / "te"), "finetune": True})
    back = build_model(back_args, wrap_ddp=False)
    init_layout_invariant_(back[0], seed=4)
    load_checkpoint(back_args, back, None, None, log=lambda *a, **k: None)
    before, after = _params(local[0]), _params(back[0])
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(_logits(back[0], tokens), expected)


def test_extra_state_the_checkpoint_lacks_is_left_out(args, tmp_path):
    """TE modules carry FP8 metadata (`_extra_state`) that a local checkpoint has not got; those requests are
    dropped, present ones and every tensor kept."""
    from megatron_ext.models.te_layout import drop_absent_extra_state
    from megatron_ext.training.checkpointing import checkpoint_dir

    model = build_model(args, wrap_ddp=False)
    save_checkpoint(argparse.Namespace(**{**vars(args), "save": str(tmp_path)}), 1, model, None, None)
    sharded = model[0].sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    kept_objects = [k for k, v in sharded.items() if isinstance(v, ShardedObject)]
    assert kept_objects  # the local linears write theirs
    fp8_meta = "decoder.layers.0.self_attention.core_attention._extra_state"
    sharded[fp8_meta] = ShardedObject(fp8_meta, None, (1,), (0,), replica_id=0)
    out = drop_absent_extra_state(sharded, checkpoint_dir(str(tmp_path), 1))
    assert fp8_meta not in out and set(out) == set(sharded) - {fp8_meta}
