"""Hugging Face side of checkpoint conversion: configs, sharded safetensors, quantised weight formats.

Layouts understood: ``deepseek_v3`` and ``kimi_k2`` (the same architecture under two model types) and
``kimi_k25`` (the text backbone as ``text_config``, weights under a language-model prefix, next to a vision
tower that conversion skips), and ``kimi_linear`` (convert/kimi_linear.py). Weight formats: bf16/fp16/fp32; FP8 e4m3 with 128x128 block scales
(``weight_scale_inv``, the DeepSeek-V3 / Kimi K2 release format); INT4 symmetric group quantisation packed into
int32 (compressed-tensors "pack-quantized", ``weight_packed`` / ``weight_scale`` / ``weight_shape``, the K2.5
release format for routed experts). Quantised weights are dequantised on the fly, one tensor at a time.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from megatron_ext.convert import kimi_linear
from megatron_ext.convert.common import ConversionError, backbone_fields
from megatron_ext.models.presets import ModelPreset

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
MODEL_TYPES = TEXT_MODEL_TYPES + ("kimi_k25", "kimi_linear")
FP8_BLOCK = 128


def read_json(path: str):
    """A JSON file's content; invalid JSON is reported with the file's name and the position."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None


def read_config(hf_dir: str) -> tuple[dict, dict]:
    """(full config.json, text-backbone config) with the model type checked."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise ConversionError(f"{path} not found: --hf-dir must hold a Hugging Face checkpoint")
    full = read_json(path)
    if not isinstance(full, dict):
        raise ConversionError(f"{path}: expected a JSON object, found {type(full).__name__}")
    model_type = full.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConversionError(f"{path}: model_type {model_type!r} is not supported; expected one of {MODEL_TYPES}")
    text = full.get("text_config", full) if model_type == "kimi_k25" else full
    if model_type == "kimi_k25" and text.get("model_type", "kimi_k2") not in TEXT_MODEL_TYPES:
        raise ConversionError(f"{path}: text_config.model_type {text.get('model_type')!r} is not supported")
    return full, text


def _rope(text: dict) -> dict:
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope.setdefault("rope_theta", text.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def preset_from_config(text: dict, source: str = "config.json") -> ModelPreset:
    """The Megatron architecture for a DeepSeek-V3-family text config; refuses what Megatron cannot express."""
    if text.get("model_type") == kimi_linear.MODEL_TYPE:
        return kimi_linear.preset_from_config(text, source)
    def need(cond, msg):
        if not cond:
            raise ConversionError(f"{source}: {msg}")

    need(text.get("hidden_act", "silu") == "silu", f"hidden_act {text.get('hidden_act')!r}: only silu (SwiGLU)")
    need(not text.get("attention_bias", False), "attention_bias=true is not supported")
    need(text.get("moe_layer_freq", 1) == 1, "moe_layer_freq != 1 is not supported")
    need(text.get("rope_interleave", True), "rope_interleave=false: Megatron's MLA expects interleaved rope dims")
    need(text.get("scoring_func", "sigmoid") == "sigmoid", "only sigmoid router scores are supported")
    experts = text.get("n_routed_experts")
    topk = text.get("num_experts_per_tok", 1)
    if experts and topk > 1:
        need(text.get("norm_topk_prob", True), "norm_topk_prob=false: Megatron renormalises sigmoid top-k weights")
    groups, group_topk = text.get("n_group") or 1, text.get("topk_group") or 1
    if experts and groups > 1:
        # HF ranks groups by the sum of their top-2 scores; Megatron-Core by the top (topk / topk_group).
        need(topk // group_topk == 2, f"group-limited routing with num_experts_per_tok {topk} / topk_group "
                                      f"{group_topk} != 2 ranks groups differently in Megatron-Core")
    rope = _rope(text)
    yarn = rope["rope_type"] == "yarn"
    shared = (text.get("n_shared_experts") or 0) * (text.get("moe_intermediate_size") or 0)
    return ModelPreset(
        **backbone_fields(text),
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=text.get("moe_intermediate_size") or text["intermediate_size"],
        moe_shared_expert_intermediate_size=shared or None,
        first_k_dense=text.get("first_k_dense_replace", 0) if experts else text["num_hidden_layers"],
        moe_router_topk_scaling_factor=text.get("routed_scaling_factor", 1.0),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_enable_expert_bias=bool(experts),
        rotary_base=float(rope["rope_theta"]),
        rope_type="yarn" if yarn else "rope",
        rotary_scaling_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings",
                                                      text.get("max_position_embeddings", 4096))),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        mscale=float(rope.get("mscale", 1.0)),
        mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        max_position_embeddings=text.get("max_position_embeddings", 4096),
        norm_epsilon=text.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not text.get("tie_word_embeddings", False),
        mtp_num_layers=text.get("num_nextn_predict_layers", 0) or 0,
        seq_length=min(4096, text.get("max_position_embeddings", 4096)),
    )


def config_from_preset(p: ModelPreset, dtype: torch.dtype, mtp: bool) -> dict:
    """config.json for `transformers`' DeepseekV3ForCausalLM (the class every supported layout loads as), or
    KimiLinearForCausalLM for a Kimi Linear hybrid."""
    if kimi_linear.is_kimi_linear(p):
        return kimi_linear.config_from_preset(p, dtype)
    rope = {"rope_type": "default", "rope_theta": p.rotary_base}
    if p.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": p.rotary_base, "factor": p.rotary_scaling_factor,
                "original_max_position_embeddings": p.original_max_position_embeddings, "beta_fast": p.beta_fast,
                "beta_slow": p.beta_slow, "mscale": p.mscale, "mscale_all_dim": p.mscale_all_dim}
    shared = p.moe_shared_expert_intermediate_size or 0
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": p.vocab_size, "hidden_size": p.hidden_size, "intermediate_size": p.ffn_hidden_size,
        "moe_intermediate_size": p.moe_ffn_hidden_size, "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_attention_heads, "num_key_value_heads": p.num_attention_heads,
        "n_shared_experts": shared // p.moe_ffn_hidden_size if p.num_experts else 0,
        "n_routed_experts": p.num_experts or 0, "num_experts_per_tok": p.moe_router_topk,
        "routed_scaling_factor": p.moe_router_topk_scaling_factor, "kv_lora_rank": p.kv_lora_rank,
        "q_lora_rank": p.q_lora_rank, "qk_rope_head_dim": p.qk_pos_emb_head_dim, "v_head_dim": p.v_head_dim,
        "qk_nope_head_dim": p.qk_head_dim, "n_group": p.moe_router_num_groups or 1,
        "topk_group": p.moe_router_group_topk or 1,
        "first_k_dense_replace": p.first_k_dense if p.num_experts else p.num_layers, "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": p.max_position_embeddings, "rms_norm_eps": p.norm_epsilon,
        "rope_parameters": rope, "rope_scaling": rope if p.rope_type == "yarn" else None,
        "rope_theta": p.rotary_base, "rope_interleave": True, "attention_bias": False,
        "tie_word_embeddings": not p.untie_embeddings_and_output_weights,
        "num_nextn_predict_layers": p.mtp_num_layers if mtp else 0,
        "torch_dtype": str(dtype).replace("torch.", ""), "dtype": str(dtype).replace("torch.", ""),
    }


@dataclass
class ShardedCheckpoint:
    """A directory of safetensors shards, indexed by tensor name; opens one shard at a time."""

    hf_dir: str
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> file name
    _open_name: str | None = None
    _open = None

    @classmethod
    def open(cls, hf_dir: str) -> "ShardedCheckpoint":
        ckpt = cls(hf_dir)
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            content = read_json(index)
            weight_map = content.get("weight_map") if isinstance(content, dict) else None
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no 'weight_map' object (tensor name -> shard file)")
            missing = sorted({fn for fn in weight_map.values() if not os.path.exists(os.path.join(hf_dir, fn))})
            if missing:
                example = next(k for k, v in weight_map.items() if v == missing[0])
                raise ConversionError(f"{index} lists shard {missing[0]} (holding e.g. {example}), which is "
                                      f"missing from {hf_dir}" + (f" ({len(missing)} shards missing)"
                                                                  if len(missing) > 1 else ""))
            ckpt.files = dict(weight_map)
        else:
            single = os.path.join(hf_dir, "model.safetensors")
            if not os.path.exists(single):
                raise ConversionError(f"{hf_dir} has neither model.safetensors.index.json nor model.safetensors")
            with safe_open(single, "pt") as f:
                ckpt.files = {k: "model.safetensors" for k in f.keys()}
        return ckpt

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self.files.values()))

    def _handle(self, filename: str):
        if self._open_name != filename:
            self._open = None  # release the previous shard's mapping before opening the next
            path = os.path.join(self.hf_dir, filename)
            try:
                self._open = safe_open(path, "pt")
            except Exception as e:
                raise ConversionError(f"cannot read shard {path}: {e}") from e
            self._open_name = filename
        return self._open

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConversionError(f"tensor {name} is not in {self.hf_dir}")
        filename = self.files[name]
        try:
            return self._handle(filename).get_tensor(name)
        except ConversionError:
            raise
        except Exception as e:
            raise ConversionError(f"cannot read tensor {name} from {os.path.join(self.hf_dir, filename)}: "
                                  f"{e}") from e

    def has(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of weight `name` as stored or, when INT4-packed, as unpacked (read from the header only)."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if self.has(base + ".weight_packed"):
            return tuple(int(x) for x in self.get(base + ".weight_shape").tolist())
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def file_of(self, name: str) -> str | None:
        """The shard holding weight `name`, in plain or INT4-packed form (None: absent)."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        return self.files.get(name) or self.files.get(base + ".weight_packed")

    def close(self):
        self._open, self._open_name = None, None

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """`name` (a '.weight') in plain form: dequantised if stored as FP8-block or INT4-group."""
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if self.has(base + ".weight_packed"):
            packed = self.get(base + ".weight_packed")
            scale = self.get(base + ".weight_scale")
            shape = tuple(int(x) for x in self.get(base + ".weight_shape").tolist())
            return dequantize_int4_group(packed, scale, shape).to(dtype)
        w = self.get(name)
        if w.dtype == torch.float8_e4m3fn:
            if not self.has(base + ".weight_scale_inv"):
                raise ConversionError(f"{name} is FP8 but {base}.weight_scale_inv is missing "
                                      f"({os.path.join(self.hf_dir, self.files[name])})")
            return dequantize_fp8_block(w, self.get(base + ".weight_scale_inv")).to(dtype)
        return w.to(dtype)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """w = fp8 value x the inverse scale of its 128x128 block (edge blocks may be partial)."""
    rows, cols = weight.shape
    expected = (-(-rows // block), -(-cols // block))
    if tuple(scale_inv.shape) != expected:
        raise ConversionError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} "
                              f"weight in {block}x{block} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return weight.float() * scale


def dequantize_int4_group(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Symmetric INT4 weights, 8 per int32 along the input dim (lowest nibble first, stored +8), one scale per
    group of consecutive inputs: w = (nibble - 8) x scale[group]."""
    rows, cols = shape
    if packed.dtype != torch.int32 or packed.shape[0] != rows or packed.shape[1] * 8 < cols:
        raise ConversionError(f"weight_packed of shape {tuple(packed.shape)} / {packed.dtype} cannot hold an INT4 "
                              f"{rows}x{cols} weight")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]
    values = nibbles.reshape(rows, -1)[:, :cols].float() - 8.0
    group = -(-cols // scale.shape[1])
    if scale.shape[0] != rows or scale.shape[1] * group < cols:
        raise ConversionError(f"weight_scale of shape {tuple(scale.shape)} does not fit an INT4 {rows}x{cols} weight")
    return values * scale.float().repeat_interleave(group, 1)[:, :cols]
