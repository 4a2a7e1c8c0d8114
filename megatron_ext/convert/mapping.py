"""Which Hugging Face tensor fills which piece of which Megatron checkpoint tensor.

The Megatron side is not hand-written: a one-rank model of the target architecture is built on the meta device
(no memory) and its `sharded_state_dict` lists every checkpoint tensor with its global shape and the chunk each
parameter occupies (gated MLPs are two chunks, gate then up; routed experts are chunks of one tensor per layer
along a leading expert axis). Only the parameter-name correspondence below is ours.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megatron_ext.convert import kimi_linear
from megatron_ext.convert.hf import ConversionError

# Megatron name inside a transformer layer -> HF name inside a decoder layer (a list: one per chunk).
_LAYER = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_q_down_proj.weight": ["self_attn.q_a_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_a_layernorm.weight"],
    "self_attention.linear_q_up_proj.weight": ["self_attn.q_b_proj.weight"],
    "self_attention.linear_q_proj.weight": ["self_attn.q_proj.weight"],
    "self_attention.linear_kv_down_proj.weight": ["self_attn.kv_a_proj_with_mqa.weight"],
    "self_attention.kv_layernorm.weight": ["self_attn.kv_a_layernorm.weight"],
    "self_attention.linear_kv_up_proj.weight": ["self_attn.kv_b_proj.weight"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.router.expert_bias": ["mlp.gate.e_score_correction_bias"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_experts.down_proj.weight"],
}
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
# MTP layer k (DeepSeek-V3 convention: HF decoder layer index num_layers + k)
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "final_layernorm.weight": "shared_head.norm.weight"}
# HF tensors of an MTP layer that duplicate the model's embedding and head
MTP_DUPLICATES = ("embed_tokens.weight", "shared_head.head.weight")


@dataclass(frozen=True)
class HFLayout:
    """Where the text backbone lives in a HF checkpoint."""

    root: str  # prefix of embed_tokens / layers / norm, e.g. "model." or "language_model.model."
    lm_head: str  # full name of the output projection
    num_layers: int
    kimi_linear: bool = False  # Kimi Linear's names (KDA attention, block_sparse_moe); convert/kimi_linear.py
    dense_mlp: str = "mlp."  # where a Kimi Linear checkpoint keeps dense MLPs ("block_sparse_moe." if transformers saved it)

    @classmethod
    def detect(cls, names, num_layers: int, model_type: str) -> "HFLayout":
        for root, head in (("model.", "lm_head.weight"), ("language_model.model.", "language_model.lm_head.weight"),
                           ("model.language_model.", "lm_head.weight")):
            if f"{root}embed_tokens.weight" in names:
                kimi = model_type == kimi_linear.MODEL_TYPE
                dense = "block_sparse_moe." if kimi and any(kimi_linear.DENSE_IN_MOE_NAMES.search(n)
                                                            for n in names) else "mlp."
                return cls(root, head, num_layers, kimi, dense)
        raise ConversionError(f"cannot find the token embedding ('model.embed_tokens.weight' or a language-model "
                              f"variant) among the checkpoint's tensors; is this a {model_type} checkpoint?")


def hf_names(name: str, layout: HFLayout) -> list[str]:
    """HF tensor name(s) for Megatron state-dict entry `name` (one per chunk)."""
    r = layout.root
    if name == "embedding.word_embeddings.weight":
        return [f"{r}embed_tokens.weight"]
    if name == "decoder.final_layernorm.weight":
        return [f"{r}norm.weight"]
    if name == "output_layer.weight":
        return [layout.lm_head]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m:
        return _layer_names(f"{r}layers.{m.group(1)}.", m.group(2), name, layout)
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", name)
    if m:
        prefix = f"{r}layers.{layout.num_layers + int(m.group(1))}."
        rest = m.group(2)
        if rest in _MTP_OWN:
            return [prefix + _MTP_OWN[rest]]
        if rest.startswith("transformer_layer."):
            return _layer_names(prefix, rest[len("transformer_layer."):], name, layout)
    raise ConversionError(f"no Hugging Face counterpart known for Megatron tensor {name}")


def _layer_names(prefix: str, rest: str, full: str, layout: HFLayout) -> list[str]:
    if layout.kimi_linear:
        names = kimi_linear.layer_names(prefix, rest, layout.dense_mlp)
        if names is not None:
            return names
    if rest in _LAYER:
        return [prefix + n for n in _LAYER[rest]]
    m = _EXPERT.fullmatch(rest)
    if m:
        e = f"{prefix}mlp.experts.{m.group(1)}."
        return [e + "gate_proj.weight", e + "up_proj.weight"] if m.group(2) == "1" else [e + "down_proj.weight"]
    raise ConversionError(f"no Hugging Face counterpart known for Megatron tensor {full}")


@dataclass(frozen=True)
class Piece:
    """One chunk of a Megatron checkpoint tensor and the HF tensor that holds its values."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]  # in the global tensor, prepended (expert) axes included
    shape: tuple[int, ...]  # chunk shape, prepended axes as 1
    prepend: int  # leading axes that only index the chunk (the expert axis)
    dtype: torch.dtype
    hf_name: str

    @property
    def data_shape(self) -> tuple[int, ...]:
        """The parameter's own shape (what the HF tensor has, up to vocabulary padding)."""
        return self.shape[self.prepend:]

    def sharded_tensor(self, data: torch.Tensor) -> ShardedTensor:
        """A ShardedTensor request for exactly this chunk (used to read it back from a checkpoint).

        The expert axis is kept as a real axis of size 1 (no prepended axes): Megatron-Core then reads any
        subset of a tensor's chunks, where prepended axes would require all of them in one request.
        """
        assert tuple(data.shape) == self.shape
        frags = tuple(g // s for g, s in zip(self.global_shape, self.shape))
        return ShardedTensor(key=self.key, data=data, dtype=data.dtype, local_shape=self.shape,
                             global_shape=self.global_shape, global_offset=self.offset, axis_fragmentations=frags,
                             replica_id=0, prepend_axis_num=0)


def enumerate_pieces(model: torch.nn.Module, layout: HFLayout) -> tuple[list[Piece], list[ShardedObject]]:
    """All chunks of a one-rank (meta) model's checkpoint, plus its non-tensor entries (`_extra_state`)."""
    pieces, objects = [], []
    sharded = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    for name, value in sharded.items():
        if isinstance(value, ShardedObject):
            objects.append(value)
            continue
        tensors = value.build() if isinstance(value, ShardedTensorFactory) else [value]
        tensors = [t for t in (tensors.values() if isinstance(tensors, dict) else tensors)]
        names = hf_names(name, layout)
        if len(names) != len(tensors):
            raise ConversionError(f"{name}: {len(tensors)} checkpoint chunks but {len(names)} HF tensors")
        for sh, hf in zip(tensors, names):
            assert isinstance(sh, ShardedTensor), name
            shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            pieces.append(Piece(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), shape, sh.prepend_axis_num,
                                sh.dtype, hf))
    return pieces, objects
