"""Core attention for the local (non-Transformer-Engine) backend.

Megatron-Core's local `DotProductAttention` assumes one head dim for queries, keys and values and rejects packed
sequences; MLA needs keys of ``qk_head_dim + qk_pos_emb_head_dim`` and values of ``v_head_dim``. This module is
the drop-in replacement built on `torch.nn.functional.scaled_dot_product_attention`.

SDPA accepts a value head dim other than the key's, but then runs its math path, which materialises the scores
and backpropagates through them: an MLA layer of the agentic-learning model (4 heads, keys 32 wide, values 16,
1,536 tokens, 4 sequences) took 0.9-1.1 s forward and backward on a CPU core, most of an SFT step; the fused
flash kernel, for values zero-padded to the key width, 0.11 s (the same output to 1e-6; the padding's columns
are sliced off and get no gradient). CUDA's flash kernel needs equal widths too.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.models import context_parallel


class CoreAttention(MegatronModule):
    """softmax(q k^T * scale + mask) v over [s, b, heads, dim] (or packed [t, heads, dim]) inputs.

    Masks: causal (the default for GPT), an explicit boolean mask where True means "do not attend" (Megatron's
    convention), and packed sequences whose documents are given by ``cu_seqlens``; a token never attends across
    a document boundary.

    Context parallelism: the keys and values cover the whole sequence (`mla.ContextParallelMLA` gathers them)
    while the queries are this rank's load-balanced chunks (`context_parallel`); each chunk attends to the keys
    up to its own end with a causal mask aligned to the bottom right.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else k_channels ** -0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by the local core attention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if self.config.context_parallel_size > 1 and key.size(0) != query.size(0):
            return self._context_parallel(query, key, value, attention_mask, mask_type, packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            causal = mask_type != AttnMaskType.no_mask
            bounds = context_parallel.document_bounds(query.size(0), packed_seq_params)
            if query.size(0) == key.size(0) and bounds[-1] == query.size(0):
                # One attention per document: no [t, t] mask (14x faster at 2K tokens on a CPU, O(sum L^2) memory).
                outs = [self._attend(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1),
                                     None, is_causal=causal) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
                return torch.cat(outs, dim=0).squeeze(1)
            # [t, heads, dim] -> [1, t, heads, dim]: one sequence of all packed documents, block-diagonal mask.
            out = self._attend(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                               _packed_mask(packed_seq_params, query.size(0), key.size(0), query.device,
                                            causal=causal),
                               is_causal=False)
            return out.squeeze(1)
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        mask = None
        if attention_mask is not None and mask_type != AttnMaskType.causal:
            mask = ~attention_mask  # Megatron: True masks out; SDPA: True attends
        if causal and query.size(0) != key.size(0):
            # Queries are the last sq positions of sk (decoding with a cache): causal from the bottom right.
            sq, sk = query.size(0), key.size(0)
            bottom_right = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
            mask = bottom_right if mask is None else mask & bottom_right
            causal = False
        elif causal and mask is not None:
            mask = mask & torch.ones_like(mask, dtype=torch.bool).tril()
            causal = False
        return self._attend(query, key, value, mask, is_causal=causal)

    def _context_parallel(self, query, key, value, attention_mask, mask_type, packed_seq_params):
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal) or (
                attention_mask is not None and mask_type != AttnMaskType.causal):
            raise NotImplementedError("context parallelism supports causal attention without padding masks")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # [t, heads, dim]: every document is split into chunks on its own; attend document by document.
            bounds = context_parallel.document_bounds(key.size(0), packed_seq_params)
            outs, offset = [], 0
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                local = (end - start) // self.config.context_parallel_size
                q = query[offset:offset + local].unsqueeze(1)
                outs.append(self._chunks(q, key[start:end].unsqueeze(1), value[start:end].unsqueeze(1)).squeeze(1))
                offset += local
            return torch.cat(outs, dim=0)
        return self._chunks(query, key, value)

    def _chunks(self, query, key, value):
        """This rank's front and back chunk of one sequence, each attending to the keys up to its own end."""
        cp = self.config.context_parallel_size
        c = key.size(0) // (2 * cp)
        rank = context_parallel.cp_rank()
        outs = []
        for half, chunk in ((0, rank), (1, 2 * cp - 1 - rank)):
            q = query[half * c:(half + 1) * c]
            end = (chunk + 1) * c
            outs.append(self._attend(q, key[:end], value[:end], _bottom_right_causal(c, end, query.device),
                                     is_causal=False))
        return torch.cat(outs, dim=0)

    def _attend(self, query, key, value, mask, is_causal: bool) -> torch.Tensor:
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dv = v.size(-1)
        if dv != k.size(-1):  # values zero-padded to the key width, the output sliced back (see the module doc)
            v = F.pad(v, (0, k.size(-1) - dv))
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0 and not self.config.sequence_parallel:
            # Heads are split across tensor-parallel ranks, so each rank needs its own dropout stream.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=is_causal, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=is_causal, scale=self.softmax_scale)
        # [b, n, s, dv] -> [s, b, n * dv]
        out = out[..., :dv]
        b, n, s, _ = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * dv)


def _bottom_right_causal(sq: int, sk: int, device):
    """Causal mask for queries that are the last sq of sk positions (True attends)."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(sq, sk)
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def _packed_mask(params: PackedSeqParams, tq: int, tk: int, device, causal: bool) -> torch.Tensor:
    """Boolean [tq, tk] mask (True attends) for packed documents given by cu_seqlens."""
    cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    doc_q = _document_ids(cu_q.to(device), tq)
    doc_k = _document_ids(cu_k.to(device), tk)
    mask = doc_q[:, None] == doc_k[None, :]
    if causal:
        pos_q = torch.arange(tq, device=device) - cu_q.to(device)[doc_q.clamp(max=len(cu_q) - 2)]
        pos_k = torch.arange(tk, device=device) - cu_k.to(device)[doc_k.clamp(max=len(cu_k) - 2)]
        mask = mask & (pos_k[None, :] <= pos_q[:, None])
    return mask


def _document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of each of `total` tokens; tokens past the last boundary get their own id (padding)."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)
