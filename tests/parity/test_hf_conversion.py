"""HF <-> Megatron conversion against transformers' DeepseekV3 as the independent reference."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_ext.arguments import parse_args
from megatron_ext.convert.hf import ConversionError, preset_from_config, read_config
from megatron_ext.convert.streaming import export_hf, import_hf
from megatron_ext.training.checkpointing import TRACKER, load_checkpoint
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model
from tests.parity.hf_fixtures import add_shard, all_tensors, edit_config, make_hf_model, save_hf

RTOL = 1e-4


def _megatron_logits(hf_dir: str, save: str, tokens: torch.Tensor) -> torch.Tensor:
    arch = preset_from_config(read_config(hf_dir)[1])
    args = parse_args(["--model", "tiny", "--mock-data", "--load", save], world_size=1, base_arch=arch)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)
        load_checkpoint(args, model, None, None, log=lambda *a, **k: None)
        model[0].eval()
        with torch.no_grad():
            pos = torch.arange(tokens.size(1)).unsqueeze(0).expand(tokens.size(0), -1)
            return model[0](tokens, pos, None)[..., : arch.vocab_size]
    finally:
        destroy()


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=["qlora_groups", "no_qlora_dense2"])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = make_hf_model(request.param)
    hf_dir = save_hf(model, str(root / "hf"))
    save = str(root / "mg")
    summary = import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    return model, hf_dir, save, summary


def test_logits_match_transformers(converted):
    model, hf_dir, save, _ = converted
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(tokens).logits
    assert _rel(_megatron_logits(hf_dir, save, tokens), ref) < RTOL


def test_export_round_trip_is_bit_exact(converted, tmp_path):
    _, hf_dir, save, _ = converted
    out = str(tmp_path / "exported")
    export_hf(save, out, log=lambda *a, **k: None)
    destroy()
    original, exported = all_tensors(hf_dir), all_tensors(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    # transformers loads the export with the matching class and gives the same logits
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, converted[0](tokens).logits)


def test_mtp_layers_map_both_ways(tmp_path):
    model = make_hf_model("qlora_groups")
    hf_dir = save_hf(model, str(tmp_path / "hf"))
    tensors = all_tensors(hf_dir)
    L = 3
    g = torch.Generator().manual_seed(5)
    mtp = {f"model.layers.{L}.{k[len('model.layers.2.'):]}": torch.randn(v.shape, generator=g)
           for k, v in tensors.items() if k.startswith("model.layers.2.")}
    mtp.update({f"model.layers.{L}.enorm.weight": torch.randn(64, generator=g),
                f"model.layers.{L}.hnorm.weight": torch.randn(64, generator=g),
                f"model.layers.{L}.eh_proj.weight": torch.randn(64, 128, generator=g),
                f"model.layers.{L}.shared_head.norm.weight": torch.randn(64, generator=g),
                f"model.layers.{L}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
                f"model.layers.{L}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    add_shard(hf_dir, mtp)
    edit_config(hf_dir, num_nextn_predict_layers=1)
    save = str(tmp_path / "mg")
    import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    out = str(tmp_path / "exported")
    export_hf(save, out, mtp=True, log=lambda *a, **k: None)
    destroy()
    original, exported = all_tensors(hf_dir), all_tensors(out)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k], v) for k, v in original.items())
    assert json.load(open(os.path.join(out, "config.json")))["num_nextn_predict_layers"] == 1


def test_kimi_k25_layout_skips_the_vision_tower(tmp_path, capsys):
    model = make_hf_model("qlora_groups")
    plain = save_hf(model, str(tmp_path / "plain"))
    k25 = str(tmp_path / "k25")
    os.makedirs(k25)
    tensors = {("language_model." + k): v for k, v in all_tensors(plain).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    half = sorted(tensors)[: len(tensors) // 2]
    save_file({k: tensors[k] for k in half}, os.path.join(k25, "model-1.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in half}, os.path.join(k25, "model-2.safetensors"))
    json.dump({"weight_map": {k: "model-1.safetensors" if k in half else "model-2.safetensors" for k in tensors}},
              open(os.path.join(k25, "model.safetensors.index.json"), "w"))
    text = json.load(open(os.path.join(plain, "config.json")))
    text["model_type"] = "kimi_k2"
    json.dump({"model_type": "kimi_k25", "text_config": text, "vision_config": {"hidden_size": 8}},
              open(os.path.join(k25, "config.json"), "w"))
    save = str(tmp_path / "mg")
    import_hf(k25, save)
    destroy()
    assert "skipping 2 vision-tower / projector tensors" in capsys.readouterr().out
    tokens = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        ref = model(tokens).logits
    assert _rel(_megatron_logits(k25, save, tokens), ref) < RTOL


def _fp8_block_reference(w8, scale_inv, block=128):
    out = torch.empty(w8.shape)
    for i in range(0, w8.shape[0], block):
        for j in range(0, w8.shape[1], block):
            out[i:i + block, j:j + block] = w8[i:i + block, j:j + block].float() * scale_inv[i // block, j // block]
    return out


def test_fp8_block_dequantisation_matches_a_reference():
    from megatron_ext.convert.hf import dequantize_fp8_block

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    scale_inv = torch.rand(3, 2, generator=g) + 0.5
    w8 = (w / scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]).to(torch.float8_e4m3fn)
    torch.testing.assert_close(dequantize_fp8_block(w8, scale_inv), _fp8_block_reference(w8, scale_inv),
                               rtol=0, atol=0)
    with pytest.raises(ConversionError, match="does not fit"):
        dequantize_fp8_block(w8, scale_inv[:2])


def test_int4_group_dequantisation_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from megatron_ext.convert.hf import dequantize_int4_group

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (48, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(48, 96 // 32, generator=g).to(torch.bfloat16)
    packed = pack_to_int32(q, 4)
    reference = unpack_from_int32(packed, 4, torch.Size((48, 96))).float() * scale.float().repeat_interleave(32, 1)
    torch.testing.assert_close(dequantize_int4_group(packed, scale, (48, 96)), reference, rtol=0, atol=0)


def test_quantised_release_formats_import_dequantised(tmp_path):
    """FP8-block attention and INT4-group experts (the K2 / K2.5 release formats) import as their values."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    model = make_hf_model("qlora_groups")
    hf_dir = save_hf(model, str(tmp_path / "hf"))
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    index = json.load(open(index_path))
    expected = {}
    g = torch.Generator().manual_seed(1)
    for filename in sorted(set(index["weight_map"].values())):
        path = os.path.join(hf_dir, filename)
        shard = load_file(path)
        for name in list(shard):
            w = shard[name]
            base = name[: -len(".weight")]
            if ".experts." in name and name.endswith("proj.weight"):
                scale = (w.abs().reshape(w.shape[0], -1, 32).amax(-1) / 7).clamp(min=1e-4).to(torch.bfloat16)
                q = torch.clamp(torch.round(w / scale.float().repeat_interleave(32, 1)), -8, 7).to(torch.int8)
                del shard[name]
                shard[base + ".weight_packed"] = pack_to_int32(q, 4)
                shard[base + ".weight_scale"] = scale
                shard[base + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
                expected[name] = q.float() * scale.float().repeat_interleave(32, 1)
            elif name.endswith("self_attn.o_proj.weight"):
                scale_inv = torch.rand(1, 1, generator=g) * 0.01 + 0.001
                shard[name] = (w / scale_inv).to(torch.float8_e4m3fn)
                shard[base + ".weight_scale_inv"] = scale_inv
                expected[name] = shard[name].float() * scale_inv
        for name in list(shard):
            index["weight_map"][name] = filename
        for name in expected:
            if name in index["weight_map"] and name not in shard and index["weight_map"][name] == filename:
                del index["weight_map"][name]
        save_file(shard, path)
    json.dump(index, open(index_path, "w"))
    save = str(tmp_path / "mg")
    import_hf(hf_dir, save, dtype="fp32", log=lambda *a, **k: None)
    destroy()
    out = str(tmp_path / "exported")
    export_hf(save, out, log=lambda *a, **k: None)
    destroy()
    exported = all_tensors(out)
    assert expected
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name


@pytest.fixture()
def small_hf(tmp_path):
    return save_hf(make_hf_model("no_qlora_dense2"), str(tmp_path / "hf")), str(tmp_path / "mg")


def _assert_nothing_published(save):
    assert not os.path.exists(os.path.join(save, TRACKER))
    assert not os.path.exists(os.path.join(save, "release"))


def test_missing_shard_is_named(small_hf):
    hf_dir, save = small_hf
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    victim = sorted(set(index.values()))[2]
    os.remove(os.path.join(hf_dir, victim))
    with pytest.raises(ConversionError, match=f"{victim}.*missing"):
        import_hf(hf_dir, save, log=lambda *a, **k: None)
    _assert_nothing_published(save)


def test_unknown_tensor_is_named_with_its_file(small_hf):
    hf_dir, save = small_hf
    add_shard(hf_dir, {"model.layers.0.self_attn.surprise.weight": torch.zeros(2)}, "extra.safetensors")
    with pytest.raises(ConversionError, match=r"unknown tensor model.layers.0.self_attn.surprise.weight in .*extra"):
        import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    _assert_nothing_published(save)


def test_shape_mismatch_is_named(small_hf):
    hf_dir, save = small_hf
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    name = "model.layers.1.self_attn.o_proj.weight"
    path = os.path.join(hf_dir, index[name])
    shard = load_file(path)
    shard[name] = torch.zeros(64, 32)
    save_file(shard, path)
    with pytest.raises(ConversionError, match=rf"{name} in .*{index[name]} has shape \(64, 32\), expected \(64, 64\)"):
        import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    _assert_nothing_published(save)


def test_wrong_model_type_is_refused(small_hf):
    hf_dir, save = small_hf
    edit_config(hf_dir, model_type="llama")
    with pytest.raises(ConversionError, match="model_type 'llama' is not supported"):
        import_hf(hf_dir, save, log=lambda *a, **k: None)
    _assert_nothing_published(save)


def test_failure_mid_write_leaves_no_checkpoint(small_hf):
    hf_dir, save = small_hf
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))["weight_map"]
    last = sorted(set(index.values()))[-1]
    with open(os.path.join(hf_dir, last), "r+b") as f:  # a shard whose data region is cut short
        f.truncate(os.path.getsize(os.path.join(hf_dir, last)) - 64)
    with pytest.raises(ConversionError):
        import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    _assert_nothing_published(save)
    assert not os.path.exists(os.path.join(save, "release.tmp"))
