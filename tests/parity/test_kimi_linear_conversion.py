"""Kimi Linear (KDA + position-free MLA hybrid) <-> transformers' KimiLinearForCausalLM: logits and round trip."""

import json
import os

import pytest
import torch

from megatron_ext.convert.hf import preset_from_config, read_config
from megatron_ext.convert.streaming import export_hf, import_hf
from megatron_ext.training.initialize import destroy
from tests.parity.hf_fixtures import all_tensors, randomize_
from tests.parity.test_hf_conversion import _megatron_logits

pytest.importorskip("transformers.models.kimi_linear")

VOCAB = 256


def make_kimi_linear(seed: int = 0):
    """A tiny random KimiLinearForCausalLM: KDA, KDA, MLA, KDA, MLA; a dense first layer, then MoE."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, num_local_experts=8,
        num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        q_lora_rank=None, first_k_dense_replace=1, rms_norm_eps=1e-5, routed_scaling_factor=2.5,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                            "full_attn_layers": [3, 5]},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return randomize_(KimiLinearForCausalLM(cfg).eval(), special=_kda_weights)


def _kda_weights(name, p):
    """KDA's gate parameters in ranges where decays and convolutions matter (default init: near identity)."""
    if name.endswith("A_log"):
        p.uniform_(0.0, 2.0)
    elif name.endswith("dt_bias"):
        p.normal_(0, 1.0)
    elif "conv1d" in name:
        p.normal_(0, 0.3)
    else:
        return False
    return True


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_linear")
    model = make_kimi_linear()
    hf_dir = str(root / "hf")
    model.save_pretrained(hf_dir)
    save = str(root / "mg")
    import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    return model, hf_dir, save


def test_config_maps_the_hybrid(converted):
    _, hf_dir, _ = converted
    arch = preset_from_config(read_config(hf_dir)[1])
    assert arch.hybrid_layer_pattern == "KKMKM" and arch.mla_nope
    assert (arch.kda_num_heads, arch.kda_head_dim, arch.kda_conv_kernel) == (4, 16, 4)
    assert arch.first_k_dense == 1 and arch.num_experts == 8 and arch.moe_shared_expert_intermediate_size == 32


def test_logits_match_transformers(converted):
    model, hf_dir, save = converted
    tokens = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(3))  # > 2 KDA chunks
    with torch.no_grad():
        ref = model(tokens).logits
    ours = _megatron_logits(hf_dir, save, tokens)[..., :VOCAB]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_export_round_trip_is_bit_exact(converted, tmp_path):
    model, hf_dir, save = converted
    out = str(tmp_path / "exported")
    export_hf(save, out, log=lambda *a, **k: None)
    destroy()
    original, exported = all_tensors_any(hf_dir), all_tensors(out)
    # transformers saves the dense first layer under block_sparse_moe.; the release layout (our export) says mlp.
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in original.items()}
    assert set(exported) == set(renamed)
    for name, tensor in renamed.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["linear_attn_config"]["kda_layers"] == [1, 2, 4]
    assert config["linear_attn_config"]["full_attn_layers"] == [3, 5]
    # the release layout loads back into transformers with the same logits, and re-imports
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, model(tokens).logits)
    import_hf(out, str(tmp_path / "mg2"), log=lambda *a, **k: None)
    destroy()


def all_tensors_any(path):
    from safetensors.torch import load_file

    single = os.path.join(path, "model.safetensors")
    return load_file(single) if os.path.exists(single) else all_tensors(path)
