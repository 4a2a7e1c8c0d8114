"""KV-cache generation on the Megatron GPTModel being trained.

The engine runs the model's own modules (embedding, norms, MLA projections, MoE layers, output layer) in a
decoding loop of its own, because Megatron-Core 0.16.1's static-batch cache stores MLA's full per-head keys and
values. Here each MLA layer caches what DeepSeek-V3 caches: the normalised KV latent (kv_lora_rank) and the
rotated shared rope key (qk_pos_emb_head_dim) per token, about 1/40 of full K/V for K2.5; keys and values are
up-projected from the latents at each step. Prompts of different lengths share a batch (right-padded, masked).

Log-probabilities are those of the model's unmodified distribution (temperature 1, no top-k/top-p), which is what
a teacher-forced forward of the trainer computes for the same ids; sampling itself uses the requested
temperature / top-k / top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_ext import platform


@dataclass
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (needs a detokenizer)
    return_routing: bool = False

    def validate(self, vocab_size: int):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (stop id or string) or "length"
    text: Optional[str] = None
    routing: Optional[list[list[list[int]]]] = None  # [token][moe layer] -> chosen experts


class LatentCache:
    """Per-layer MLA latents and rope keys for a batch: [batch, max_len, kv_lora_rank] and [..., rope_dim]."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device):
        self.latent = [torch.zeros(batch, max_len, kv_lora_rank, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rope_key = [torch.zeros(batch, max_len, rope_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent + self.rope_key)


def _linear(module, x: torch.Tensor) -> torch.Tensor:
    """A (one-rank) Megatron linear layer as a plain matmul: the same weights without the autograd and
    communication wrappers, which dominate a decode step's cost at small sizes."""
    y = F.linear(x, module.weight)
    bias = getattr(module, "bias", None)
    return y if bias is None or getattr(module, "skip_bias_add", False) else y + bias


def _gated_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    gate, up = _linear(mlp.linear_fc1, x).chunk(2, dim=-1)
    return _linear(mlp.linear_fc2, F.silu(gate) * up)


class InferenceEngine:
    """Generation with a latent KV cache for a single-stage GPTModel (one rank holding the whole model)."""

    def __init__(self, model: torch.nn.Module, detokenize: Optional[Callable[[list[int]], str]] = None):
        model = getattr(model, "module", model)
        if not (model.pre_process and model.post_process):
            raise ValueError("the inference engine needs the whole model on one rank (pipeline parallel size 1)")
        cfg = model.config
        if cfg.tensor_model_parallel_size > 1 or cfg.expert_model_parallel_size > 1:
            raise ValueError("the inference engine runs the model on one rank (TP = EP = 1 for now)")
        self.model, self.config, self.detokenize = model, cfg, detokenize
        self.vocab_size = model.vocab_size
        self.layers = list(model.decoder.layers)
        for layer in self.layers:
            if not isinstance(layer.self_attention, MLASelfAttention):
                raise ValueError("the inference engine supports MLA layers")
        if not (cfg.gated_linear_unit and cfg.activation_func is F.silu):
            raise ValueError("the inference engine supports SwiGLU MLPs (gated_linear_unit with silu)")
        self._rope = {}

    # ---------------------------------------------------------------------------------------------------
    # forward with the cache
    # ---------------------------------------------------------------------------------------------------

    def _rope_table(self, attn: MLASelfAttention, length: int):
        key = (id(attn.rotary_pos_emb), length)
        if key not in self._rope:
            out = attn.rotary_pos_emb(length)
            self._rope[key] = out if isinstance(out, tuple) else (out, 1.0)
        return self._rope[key]

    def _attention(self, attn: MLASelfAttention, h, positions, cache: LatentCache, layer: int, lengths):
        """MLA over [s, b, hidden] new tokens at `positions` [b, s]; appends their latents at `lengths` [b]."""
        cfg = self.config
        s, b, _ = h.shape
        n, dn, dr, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is not None:
            q = _linear(attn.linear_q_up_proj, attn.q_layernorm(_linear(attn.linear_q_down_proj, h)))
        else:
            q = _linear(attn.linear_q_proj, h)
        q = q.view(s, b, n, dn + dr)
        q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
        kv = _linear(attn.linear_kv_down_proj, h)
        latent, k_pe = torch.split(kv, [cfg.kv_lora_rank, dr], dim=-1)
        latent = attn.kv_layernorm(latent)
        table, mscale = self._rope_table(attn, cache.max_len)
        freqs = table[positions.t()].squeeze(2)  # [s, b, 1, dr]: each sample at its own positions
        q_pe = apply_rotary_pos_emb(q_pe, freqs, config=cfg, mscale=mscale)
        k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(2), freqs, config=cfg, mscale=mscale).squeeze(2)
        rows = torch.arange(b).unsqueeze(1)
        slots = lengths.unsqueeze(1) + torch.arange(s).unsqueeze(0)  # [b, s]
        cache.latent[layer][rows, slots] = latent.transpose(0, 1)
        cache.rope_key[layer][rows, slots] = k_pe.transpose(0, 1)
        total = int((lengths + s).max())
        kv_up = _linear(attn.linear_kv_up_proj, cache.latent[layer][:, :total].transpose(0, 1))  # [t, b, n*(dn+dv)]
        kv_up = kv_up.view(total, b, n, dn + dv)
        k_nope, v = torch.split(kv_up, [dn, dv], dim=-1)
        k_rope = cache.rope_key[layer][:, :total].transpose(0, 1).unsqueeze(2).expand(-1, -1, n, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        key_pos = torch.arange(total).view(1, 1, total)
        mask = key_pos <= positions.unsqueeze(-1)  # [b, s, t]: causal at each sample's own positions
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                             attn_mask=mask.unsqueeze(1), scale=attn.softmax_scale)
        return _linear(attn.linear_proj, out.permute(2, 0, 1, 3).reshape(s, b, n * dv))

    @staticmethod
    def _mlp(mlp, h: torch.Tensor) -> torch.Tensor:
        """Dense MLP as is; MoE computed directly on the tokens each expert received (no dispatcher, no
        idle experts), with Megatron-Core's router and expert modules: y = sum_e p_e * expert_e(x) + shared(x)."""
        router = getattr(mlp, "router", None)
        if router is None:
            return _gated_mlp(mlp, h)
        flat = h.reshape(-1, h.size(-1))
        probs, routing_map = router(h)
        out = torch.zeros_like(flat)
        for e in routing_map.any(0).nonzero().flatten().tolist():
            rows = routing_map[:, e].nonzero().flatten()
            y = _gated_mlp(mlp.experts.local_experts[e], flat[rows])
            out.index_add_(0, rows, y * probs[rows, e].unsqueeze(-1).to(y.dtype))
        if mlp.shared_experts is not None:
            if getattr(mlp.shared_experts, "use_shared_expert_gate", False):
                out = out + mlp.shared_experts(flat)
            else:
                out = out + _gated_mlp(mlp.shared_experts, flat)
        return out.view_as(h)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LatentCache, lengths: torch.Tensor,
                routing: Optional[list] = None) -> torch.Tensor:
        """Logits [b, s, vocab] for `tokens` [b, s] placed after each sample's `lengths` cached tokens."""
        return self.forward_with_hidden(tokens, positions, cache, lengths, routing)[0]

    @torch.no_grad()
    def forward_with_hidden(self, tokens, positions, cache: LatentCache, lengths, routing=None):
        """(logits [b, s, vocab], final-normed hidden states [s, b, h]): the hidden states feed the MTP layers."""
        model = self.model
        x = model.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        hooks = []
        if routing is not None:
            for layer in self.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    hooks.append(router.register_forward_hook(
                        lambda mod, inp, out: routing.append(out[1].nonzero())))
        try:
            with platform.without_device_mapping():
                for i, layer in enumerate(self.layers):
                    x = x + self._attention(layer.self_attention, layer.input_layernorm(x), positions, cache, i,
                                            lengths)
                    x = x + self._mlp(layer.mlp, layer.pre_mlp_layernorm(x))
        finally:
            for hook in hooks:
                hook.remove()
        x = model.decoder.final_layernorm(x)
        return self._logits(x), x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        logits, _ = model.output_layer(x, weight=model.shared_embedding_or_output_weight()
                                       if model.share_embeddings_and_output_weights else None)
        return logits.transpose(0, 1).float()

    @torch.no_grad()
    def mtp_forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                    cache: LatentCache, lengths: torch.Tensor) -> torch.Tensor:
        """MTP layer 1 as Megatron-Core computes it: at position t it combines the main model's hidden state
        h_t with the embedding of token t+1 and predicts token t+2. Its attention has a latent cache of its own.
        Returns logits [b, s, vocab]."""
        model = self.model
        mtp = model.mtp.layers[0]
        e = model.embedding(input_ids=next_tokens, position_ids=positions)
        x = _linear(mtp.eh_proj, torch.cat((mtp.enorm(e), mtp.hnorm(hidden)), -1))
        layer = mtp.transformer_layer
        with platform.without_device_mapping():
            x = x + self._attention(layer.self_attention, layer.input_layernorm(x), positions, cache, 0, lengths)
            x = x + self._mlp(layer.mlp, layer.pre_mlp_layernorm(x))
        return self._logits(mtp.final_layernorm(x))

    # ---------------------------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        params.validate(self.vocab_size)
        bad = [t for p in prompts for t in p if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(prompts, params)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        b = len(prompts)
        lens = torch.tensor([len(p) for p in prompts])
        max_len = int(lens.max()) + params.max_tokens
        if max_len > self.model.max_sequence_length:
            raise ValueError(f"prompt + max_tokens = {max_len} exceeds the model's {self.model.max_sequence_length}")
        dtype = self.model.embedding.word_embeddings.weight.dtype
        cache = LatentCache(len(self.layers), b, max_len, self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim,
                            dtype, torch.device("cpu"))
        generators = [torch.Generator().manual_seed(params.seed + i) if params.seed is not None else None
                      for i in range(b)]
        out = [Completion(prompt_ids=list(p), routing=[] if params.return_routing else None) for p in prompts]

        # prefill: right-padded prompts; pad positions write latents past each prompt that decoding overwrites
        width = int(lens.max())
        tokens = torch.zeros(b, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p)
        positions = torch.arange(width).unsqueeze(0).expand(b, -1).contiguous()
        routing = [] if params.return_routing else None
        logits = self.forward(tokens, positions, cache, torch.zeros(b, dtype=torch.long), routing)
        last = logits[torch.arange(b), lens - 1]  # [b, vocab]
        lengths = lens.clone()
        done = torch.zeros(b, dtype=torch.bool)
        for step in range(params.max_tokens):
            next_ids, logprobs = self._sample(last, params, generators)
            for i in range(b):
                if done[i]:
                    continue
                c = out[i]
                c.token_ids.append(int(next_ids[i]))
                c.logprobs.append(float(logprobs[i]))
                if int(next_ids[i]) in params.stop_token_ids:
                    c.finish_reason, done[i] = "stop", True
                elif params.stop and self.detokenize is not None:
                    text = self.detokenize(c.token_ids)
                    hit = [text.index(s) for s in params.stop if s in text]
                    if hit:
                        c.text, c.finish_reason, done[i] = text[: min(hit)], "stop", True
            if done.all() or step == params.max_tokens - 1:
                break
            routing = [] if params.return_routing else None
            logits = self.forward(next_ids.unsqueeze(1), lengths.unsqueeze(1), cache, lengths, routing)
            if routing is not None:
                for i, c in enumerate(out):
                    if not done[i]:
                        c.routing.append([r[r[:, 0] == i, 1].tolist() for r in routing])
            lengths = lengths + 1
            last = logits[:, 0]
        for c in out:
            if c.text is None and self.detokenize is not None:
                c.text = self.detokenize(c.token_ids)
        return out

    def _sample(self, logits: torch.Tensor, params: SamplingParams, generators) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits[:, : self.vocab_size]
        logprobs_all = torch.log_softmax(logits.double(), dim=-1)
        if params.temperature == 0:
            ids = logits.argmax(-1)
        else:
            probs = sampling_probs(logits, params)
            ids = torch.stack([torch.multinomial(probs[i], 1, generator=generators[i])[0]
                               for i in range(probs.size(0))])
        return ids, logprobs_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from, over the last dim: temperature, then top-k, then top-p (the
    smallest set of most likely tokens reaching p); one-hot on the argmax when greedy."""
    if params.temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.size(-1)).double()
    scores = logits.double() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.size(-1)), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        p = torch.softmax(sorted_scores, -1)
        sorted_scores = sorted_scores.masked_fill(p.cumsum(-1) - p >= params.top_p, -math.inf)
        scores = torch.full_like(scores, -math.inf).scatter(-1, order, sorted_scores)
    return torch.softmax(scores, dim=-1)
