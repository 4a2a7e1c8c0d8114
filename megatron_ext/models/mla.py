"""MLA self-attention with context parallelism through the KV latent (the local backend's attention module).

With CP = 1 (and in inference) this is Megatron-Core's `MLASelfAttention` unchanged. With CP > 1 each rank
computes queries for its own tokens and the normalised KV latent plus rotated rope key for them, all-gathers that
latent over the CP group (`context_parallel.gather_sequence`) and up-projects the whole sequence's keys and values
locally; `attention.CoreAttention` then attends its local queries to them with the load-balanced causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_ext.models import context_parallel


class ContextParallelMLA(MLASelfAttention):
    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        cfg = self.config
        if cfg.context_parallel_size == 1 or inference_context is not None or inference_params is not None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context,
                                                       inference_params=inference_params)
        if cfg.apply_rope_fusion or self.recompute_up_proj or self.cache_mla_latents:
            raise NotImplementedError("context parallelism through the MLA latent does not support RoPE fusion, "
                                      "up-projection recompute or cached latents")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, cfg, packed_seq_params)
        emb = self.rotary_pos_emb(rotary_seq_len, packed_seq=packed)
        rotary_pos_emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        cu_seqlens = None
        if packed:
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q
        heads = self.num_attention_heads_per_partition

        # Queries: this rank's tokens only (the column-parallel up projection gathers the TP sequence shards).
        if cfg.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_compressed))
        else:
            q_compressed = hidden_states
            q, _ = self.linear_q_proj(hidden_states)
        q = q.view(*q.shape[:-1], heads, self.q_head_dim)

        # The KV latent of this rank's tokens: whole sequence shard (gathered over TP when sequence parallel).
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if kv_combined.size(-1) != cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim:
            raise NotImplementedError("context parallelism needs the replicated MLA down projection")
        if cfg.sequence_parallel and self.tp_group.size() > 1:
            kv_combined = gather_from_sequence_parallel_region(kv_combined, group=self.tp_group)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv_compressed = self.kv_layernorm(kv_compressed)
        if packed:  # [t, 1, ...] -> [t, ...]: the THD layout rope and core attention expect
            q, kv_compressed, k_pos_emb = q.squeeze(1), kv_compressed.squeeze(1), k_pos_emb.squeeze(1)
        else:
            rotary_pos_emb = rotary_pos_emb[: q.size(0)]
        q_no_pe, q_pos_emb = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        rope = dict(config=cfg, mscale=mscale, cp_group=self.pg_collection.cp)
        q_pos_emb = apply_rotary_pos_emb(q_pos_emb, rotary_pos_emb, cu_seqlens=cu_seqlens, **rope)
        k_pos_emb = apply_rotary_pos_emb(k_pos_emb.unsqueeze(-2), rotary_pos_emb, cu_seqlens=cu_seqlens, **rope)

        # All-gather the latent over CP, then up-project every token's key and value here.
        bounds = context_parallel.document_bounds(q.size(0) * cfg.context_parallel_size, packed_seq_params)
        latent = context_parallel.gather_sequence(torch.cat([kv_compressed, k_pos_emb.squeeze(-2)], dim=-1),
                                                  bounds)
        latent_kv, latent_pe = torch.split(latent, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        up = self.linear_kv_up_proj
        kv = F.linear(latent_kv, up.weight, None if getattr(up, "skip_bias_add", False) else up.bias)
        kv = kv.view(*kv.shape[:-1], heads, cfg.qk_head_dim + cfg.v_head_dim)
        k_no_pe, value = torch.split(kv, [cfg.qk_head_dim, cfg.v_head_dim], dim=-1)
        key = torch.cat([k_no_pe, latent_pe.unsqueeze(-2).expand(*k_no_pe.shape[:-1], -1)], dim=-1)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous(), q_compressed, kv_compressed
