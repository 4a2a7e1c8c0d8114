"""Tiny random Hugging Face DeepSeek-V3 / Kimi checkpoints written to disk, as users download them."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

SHAPES = {
    # q LoRA, one dense layer, group-limited routing (4 groups, 2 used, top-4: HF's top-2-per-group rule)
    "qlora_groups": dict(q_lora_rank=32, first_k_dense_replace=1, n_group=4, topk_group=2, num_experts_per_tok=4),
    # no q LoRA, two dense layers, ungrouped top-2
    "no_qlora_dense2": dict(q_lora_rank=None, first_k_dense_replace=2, n_group=1, topk_group=1,
                            num_experts_per_tok=2),
}


def hf_config(shape: str, **overrides):
    from transformers import DeepseekV3Config

    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
                  qk_nope_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, num_mtp_layers=0,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
    kwargs.update(SHAPES[shape])
    kwargs.update(overrides)
    return DeepseekV3Config(**kwargs)


def make_hf_model(shape: str, seed: int = 0, **overrides):
    """A random model whose router is decisive (no near-tied top-k choices to flip on rounding)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return randomize_(DeepseekV3ForCausalLM(hf_config(shape, **overrides)).eval())


@torch.no_grad()
def randomize_(model, special=None):
    """Random weights with a decisive router (no near-tied top-k choices to flip on rounding) and norms near one;
    `special(name, p)` may fill a parameter itself (returning True)."""
    for name, p in model.named_parameters():
        if special is not None and special(name, p):
            continue
        if name.endswith("gate.weight"):
            p.normal_(0, 1.0)
        elif "norm" in name:
            p.normal_(1.0, 0.1)
        else:
            p.normal_(0, 0.05)
    for module in model.modules():
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias.normal_(0, 0.1)
    return model


def save_hf(model, path: str, shard_kb: int = 100):
    model.save_pretrained(path, max_shard_size=f"{shard_kb}KB")
    return path


def all_tensors(path: str) -> dict[str, torch.Tensor]:
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    out = {}
    for filename in sorted(set(index.values())):
        out.update(load_file(os.path.join(path, filename)))
    return out


def add_shard(path: str, tensors: dict[str, torch.Tensor], filename: str = "model-extra.safetensors"):
    """Append tensors as one more shard and list them in the index."""
    save_file(tensors, os.path.join(path, filename))
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"].update({k: filename for k in tensors})
    json.dump(index, open(index_path, "w"))


def edit_config(path: str, **changes):
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(changes)
    json.dump(cfg, open(cfg_path, "w"))
