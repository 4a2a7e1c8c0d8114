"""KV-cache generation on the Megatron GPTModel being trained.

The engine runs the model's own weights (embedding, norms, MLA projections, router, experts, output layer) in a
decoding loop of its own, because Megatron-Core 0.16.1's static-batch cache stores MLA's full per-head keys and
values. Here each MLA layer caches what DeepSeek-V3 caches: the normalised KV latent (kv_lora_rank) and the
rotated shared rope key (qk_pos_emb_head_dim) per token, about 1/40 of full K/V for K2.5. Prompts of different
lengths share a batch (right-padded, masked).

Attention over the cache takes one of two equivalent forms. Expanded: up-project every cached latent to per-head
keys and values, then attend (cost grows with the cache length times kv_lora_rank x heads x head dims; cheapest
when many new tokens share that up-projection, as in a long prefill). Absorbed: fold the key up-projection into
the query (q_nope . W_uk is a query in latent space) and the value up-projection after the attention, so the
scores are one matmul of [latent query | rope query] against the cached [latent | rope key] rows, like
multi-query attention with a single (kv_lora_rank + rope)-wide head; nothing per cached token is up-projected,
which is what makes a decode step cheap.

Tensor and expert parallelism: every rank of the tensor- and expert-parallel groups runs the same request on
its own shard. Column-parallel weights give this rank's heads / MLP columns / vocabulary slice, row-parallel
outputs and routed-expert partial sums are all-reduced, embeddings and logits are gathered over the vocabulary,
so all ranks hold identical hidden states and logits and draw identical tokens. The model's modules are not
called in the hot loop (their sequence-parallel and autograd wrappers would scatter a one-token step over the
ranks and cost more than the arithmetic); their weights are used directly.

Each generated token comes with two log-probabilities: `logprobs`, under the model's unmodified distribution
(log-softmax of the logits over the tokenizer's vocabulary, temperature 1: what a teacher-forced forward of the
trainer computes for the same ids), and `sampled_logprobs`, under the distribution it was actually drawn from
(temperature / top-k / top-p applied). Ids of the embedding's padding rows (>= `vocab_size`) are never drawn.

For RL sampling (ENGINE_API in the design notes): per-row sampling parameters and seeds in one batch; rows that
finish leave the decode batch; the n samples of a prompt share one prefill (`generate_groups`); the experts of
every token can be returned in the layout Megatron-Core's RouterReplay consumes; `update_weights` copies the
trainer's parameters in place and bumps `weights_version`, which tags every generated token.

Attention Residuals (models/attn_residuals.py) change only what each sublayer reads: the depth mixture of the
new tokens' own embedding and sublayer outputs, which a step builds and drops (the KV cache is unchanged).

Both of Megatron-Core's layer specs are served. Under the Transformer Engine spec the MLA q / kv latent norms and
a dense layer's pre-MLP norm are identity modules: their weights live in the following linear as
``layer_norm_weight`` (TE's fused norm + linear), and the engine applies them there (`_fused_norm`). Routed
experts are SequentialMLP's modules or TE's grouped GEMM (``--moe-grouped-gemm``: one ``weight{i}`` per local
expert in ``experts.linear_fc1`` / ``linear_fc2``); `_expert_weights` reads either.
"""

from __future__ import annotations

import collections
import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_ext import platform
from megatron_ext.models import attn_residuals
from megatron_ext.models.kda import KimiDeltaAttention
from megatron_ext.models.norm import RMSNorm

# Up to this many tokens per MoE call (decode, speculative verify), experts run token by token: regrouping tokens
# by expert costs a dozen extra small ops, more than it saves when experts are rarely shared.
_FEW_TOKENS = 4
# On the CPU, a step of T > 1 tokens (speculative verify, a batch of decoding rows) runs every local expert on every
# token when T x (bytes of the layer's local experts) is at most this: a few batched matmuls over cache-resident
# weights then cost less than the host work of picking experts (~10 small ops per expert touched), although they
# do E / top-k times the FLOPs. Tiny models only (8 experts of 64 x 32, 196 KB: up to 85 tokens, where a 64-row
# step measured 8 % faster than picking); a real model's experts never come close.
_ALL_EXPERTS_MAX_WORK = 16 << 20
# CPU steps of more than _FEW_TOKENS tokens over big stacked experts (prefill, decode batches): torch's grouped GEMM,
# whose loop over the experts runs in C++, one op per projection instead of ~6 Python-dispatched ops per expert
# touched ((a)'s batch-8 decode step: 1130 -> 617 ops; its time within noise, 0.96-1.07x). Off: the per-expert loop,
# also kept for experts that do not stack and for torch builds without `_grouped_mm`. A GPU keeps its own paths
# (`_grouped_kernel`: torch's grouped GEMM as one CUDA kernel, bf16 on Hopper).
_HOST_GROUPED_MM = True
# The expanded path (prefill, chunks longer than absorbed attention pays for) attends in pieces of at most this
# many bytes of scores (fp32, rows x heads x queries x keys): torch's CPU attention with a mask materialises them,
# so one call over 64 admitted prompts of 1,400 tokens and 4 heads took 5 GB (RL's rollouts at 32 tasks x 8
# episodes a step were killed for memory on a 24 GiB machine). Rows first, then queries of one row; each piece is
# the same arithmetic as the whole.
_ATTENTION_MAX_SCORE_BYTES = 256 << 20


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
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("max_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
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
    logprobs: list[float] = field(default_factory=list)  # log p under the raw distribution (temperature 1)
    sampled_logprobs: list[float] = field(default_factory=list)  # log q under the distribution sampled from
    versions: list[int] = field(default_factory=list)  # the engine's weights_version when each token was made
    finish_reason: str = "length"  # "stop" (stop id or string) or "length"
    text: Optional[str] = None
    # int16 [len(prompt_ids) + len(token_ids), MoE layers, topk]: the experts of every token (row t: position t),
    # each row in the order Megatron-Core's router ranks them (what RouterReplay records)
    routing: Optional[torch.Tensor] = None
    # MTP speculation of this completion (inference/speculative_batch.py): drafts proposed and accepted, verify
    # forwards; None when decoded without drafting
    speculation: Optional[dict] = None

    def routing_for_replay(self) -> list[torch.Tensor]:
        """One [tokens, topk] int64 tensor per MoE layer, as RouterReplay.set_replay_data takes for a single
        sequence in the trainer's token order."""
        if self.routing is None:
            raise ValueError("no routing recorded: generate with SamplingParams(return_routing=True)")
        return [self.routing[:, layer].long() for layer in range(self.routing.size(1))]


class _TopKRecorder:
    """Stands in for a router's RouterReplay while the engine calls the router: records the top-k indices that
    Megatron-Core's router computes, in the order RouterReplay's RECORD action records them."""

    indices: Optional[torch.Tensor] = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, self.indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        return probs, self.indices


class LatentCache:
    """Per-layer MLA cache for a batch: the latent and the rotated rope key of each token side by side,
    [batch, max_len, kv_lora_rank + rope_dim], so that absorbed attention scores both with one matmul. The rope key
    keeps its rotated pairs interleaved (`_rope`), not in Megatron-Core's halves: only dot products read it.

    Kimi Linear hybrids keep, side by side with those, each KDA layer's constant-size state in `states[i]`
    (convolution tail, recurrent state: `KimiDeltaAttention.new_state`); such a layer's `kv[i]` is empty."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device, recurrent: Optional[list] = None):
        recurrent = recurrent or [None] * num_layers  # per layer: a KDA module, or None for MLA
        self.kv = [torch.zeros(batch, max_len if r is None else 0, 0 if r is not None else kv_lora_rank + rope_dim,
                               dtype=dtype, device=device) for r in recurrent]
        self.states = [None if r is None else r.new_state(batch, device, dtype) for r in recurrent]
        self.kv_lora_rank, self.max_len = kv_lora_rank, max_len

    def fork(self, counts: torch.Tensor):
        """Row i becomes counts[i] identical rows (the samples of one prompt)."""
        self.kv = [t.repeat_interleave(counts, dim=0) for t in self.kv]
        self.states = [None if st is None else tuple(t.repeat_interleave(counts, dim=0) for t in st)
                       for st in self.states]

    def join(self, other: "LatentCache"):
        """Append `other`'s rows (a cache of the same layers) after this one's; both hold the longer max_len."""
        length = max(self.max_len, other.max_len)

        def grow(t: torch.Tensor) -> torch.Tensor:
            return t if t.size(1) in (0, length) else F.pad(t, (0, 0, 0, length - t.size(1)))

        self.kv = [torch.cat((grow(a), grow(b))) for a, b in zip(self.kv, other.kv)]
        self.states = [None if a is None else tuple(torch.cat(pair) for pair in zip(a, b))
                       for a, b in zip(self.states, other.states)]
        self.max_len = length

    def keep(self, rows: torch.Tensor, used: int):
        """Keep only `rows` (in that order), compacted in place; `used` cache positions are live."""
        for t in self.kv:
            t[: len(rows), :used] = t[rows, :used]
        self.kv = [t[: len(rows)] for t in self.kv]
        self.states = [None if st is None else tuple(t[rows] for t in st) for st in self.states]

    @property
    def latent(self) -> list[torch.Tensor]:
        return [t[..., : self.kv_lora_rank] for t in self.kv]

    @property
    def rope_key(self) -> list[torch.Tensor]:
        return [t[..., self.kv_lora_rank:] for t in self.kv]

    def bytes(self) -> int:
        tensors = self.kv + [t for st in self.states if st is not None for t in st]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixStore:
    """Latent caches of finished rows, kept so that a later prompt which continues one (the next turn of a
    multi-turn episode: the previous prompt, the tokens sampled, the tool's output) prefills only its new tokens
    instead of the whole conversation again. An entry holds the tokens its cache covers (the prompt and every
    sampled token but the last, which was never fed) and is used once, by the first prompt it is a proper prefix
    of; entries made with other weights are never used (and are dropped). At most `max_bytes` of cache are kept,
    the oldest entries dropped first. Only MLA layers and requests without routing replay use it (a KDA state or a
    routing table of the prefix is not kept)."""

    HEAD = 16  # entries are found by their first tokens

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.entries: collections.OrderedDict[int, tuple[list[int], list[torch.Tensor], int]] = \
            collections.OrderedDict()
        self.by_head: dict[tuple, list[int]] = collections.defaultdict(list)
        self.bytes, self._next, self.version = 0, 0, None
        self.hits = self.reused_tokens = 0  # prompts that continued an entry, and the tokens they did not prefill

    @staticmethod
    def _size(kv: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in kv)

    def _drop(self, key: int):
        tokens, kv, _ = self.entries.pop(key)
        self.bytes -= self._size(kv)
        head = self.by_head[tuple(tokens[:self.HEAD])]
        head.remove(key)
        if not head:
            del self.by_head[tuple(tokens[:self.HEAD])]

    def _forget_other_versions(self, version: int):
        # every entry has the version of the latest put/take, so a scan is needed only when it changes
        if version != self.version:
            for key in list(self.entries):
                self._drop(key)
            self.version = version

    def put(self, tokens: list[int], kv: list[torch.Tensor], version: int):
        """Keep `kv` (per layer [len(tokens), r + rope], owned by the store) as the cache of `tokens`."""
        size = self._size(kv)
        if len(tokens) < self.HEAD or size > self.max_bytes:
            return
        self._forget_other_versions(version)
        while self.entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self.entries)))
        key, self._next = self._next, self._next + 1
        self.entries[key] = (list(tokens), kv, version)
        self.by_head[tuple(tokens[:self.HEAD])].append(key)
        self.bytes += size

    def take(self, prompt: list[int], version: int) -> Optional[tuple[int, list[torch.Tensor]]]:
        """(tokens covered, cache per layer) of the longest entry that is a proper prefix of `prompt`, removed from
        the store; None when none is."""
        self._forget_other_versions(version)
        best = None
        for key in self.by_head.get(tuple(prompt[:self.HEAD]), ()):
            tokens = self.entries[key][0]
            if len(tokens) < len(prompt) and (best is None or len(tokens) > best[1]) \
                    and prompt[:len(tokens)] == tokens:
                best = (key, len(tokens))
        if best is None:
            return None
        kv = self.entries[best[0]][1]
        self._drop(best[0])
        self.hits, self.reused_tokens = self.hits + 1, self.reused_tokens + best[1]
        return best[1], kv


class _Groups:
    """The process groups one generation step communicates over (None where a group has a single rank)."""

    def __init__(self):
        def group(size_fn, group_fn):
            return group_fn() if parallel_state.model_parallel_is_initialized() and size_fn() > 1 else None

        ps = parallel_state
        self.tp = group(ps.get_tensor_model_parallel_world_size, ps.get_tensor_model_parallel_group)
        self.tp_size = dist.get_world_size(self.tp) if self.tp is not None else 1
        # routed experts are split over expert-tensor x expert-model parallel ranks; each computes a partial sum
        self.experts = group(ps.get_expert_tensor_and_model_parallel_world_size,
                             ps.get_expert_tensor_and_model_parallel_group)
        self.ep = group(ps.get_expert_model_parallel_world_size, ps.get_expert_model_parallel_group)
        ranks = [dist.get_process_group_ranks(g) if g is not None else None for g in (self.tp, self.experts)]
        # when routed experts are sharded over exactly the tensor-parallel ranks, one all-reduce serves both
        self.experts_are_tp = ranks[0] == ranks[1]


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def _gather_last_dim(x: torch.Tensor, group, size: int) -> torch.Tensor:
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, RMSNorm):  # the same arithmetic as RMSNorm.forward in one fused call
        return F.rms_norm(x, (x.size(-1),), module.weight, module.eps)
    return module(x)


def _fused_norm(linear, x: torch.Tensor) -> torch.Tensor:
    """`x` through the norm Transformer Engine fuses into `linear` (``layer_norm_weight``, RMSNorm with the
    linear's eps; checked by `_check_fused_norms`); `x` unchanged when the linear has none (local spec: the norm
    is a module of its own, applied by `_norm`)."""
    weight = getattr(linear, "layer_norm_weight", None)
    if weight is None:
        return x
    return F.rms_norm(x, (x.size(-1),), weight, linear.eps)


def _check_fused_norms(model: torch.nn.Module):
    """Refuse fused norms the engine would compute differently from the model: LayerNorm (a bias), TE's
    zero-centred gamma, or a linear that does not say its eps (TE's LayerNormLinear keeps it as ``eps``)."""
    for name, module in model.named_modules():
        if getattr(module, "layer_norm_weight", None) is None:
            continue
        normalization = getattr(module, "normalization", "RMSNorm")
        if (normalization != "RMSNorm" or getattr(module, "layer_norm_bias", None) is not None
                or getattr(module, "zero_centered_gamma", False)):
            raise ValueError(f"the inference engine applies fused norms as RMSNorm without zero-centred gamma: "
                             f"{name} is {normalization} (use --normalization RMSNorm and no "
                             "--apply-layernorm-1p)")
        if not isinstance(getattr(module, "eps", None), float):
            raise ValueError(f"{name} ({type(module).__name__}) fuses a norm but has no float `eps`: the "
                             "inference engine cannot apply its norm")


_linear = platform.linear  # F.linear; oneDNN for big fp32 weights on an x86 CPU


def _swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """SwiGLU on this rank's columns: fc1 holds [gate | up] of this rank's slice, the result is a partial sum
    over tensor-parallel ranks (exact when the MLP is not sharded)."""
    gate, up = _linear(x, fc1).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, fc2)


def _gated_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A dense or shared-expert MLP on `x` (its fused pre-MLP norm applied first, under TE's spec)."""
    return _swiglu(_fused_norm(mlp.linear_fc1, x), mlp.linear_fc1.weight, mlp.linear_fc2.weight)


def _expert_weights(experts) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1, fc2) weights of each local expert, in local-expert order: SequentialMLP's expert modules, or TE's
    grouped GEMM (TEGroupedMLP, ``--moe-grouped-gemm``), whose fc1 and fc2 hold ``weight{i}`` for local expert
    i. The parameters themselves: in-place updates (update_weights, checkpoint loads) show through."""
    local = getattr(experts, "local_experts", None)
    if local is not None:
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in local]
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    n = getattr(experts, "num_local_experts", None)
    if n is not None and all(hasattr(fc, f"weight{i}") for fc in (fc1, fc2) for i in range(n)):
        return [(getattr(fc1, f"weight{i}"), getattr(fc2, f"weight{i}")) for i in range(n)]
    raise ValueError(f"the inference engine cannot read the routed experts of {type(experts).__name__}: it "
                     "supports sequential experts and Transformer Engine's grouped GEMM (--moe-grouped-gemm), "
                     "not --moe-use-legacy-grouped-gemm")


_DENSE_DECODE_MAX_TOKENS = 512


def _dense_decode(flat: torch.Tensor, topk: int, num_experts: int, sync_free: Optional[bool] = None) -> bool:
    """On a GPU, decode batches whose tokens touch most experts anyway (tokens x top-k >= experts: ~63 % or more
    of them) run every local expert on every token, weighted by a zero-filled routing matrix: no host sync per
    MoE layer, shapes fixed for CUDA graphs, and about the same expert weights read. Prefills keep a grouped
    path (dense would multiply their FLOPs by experts / top-k). `sync_free`: the engine's choice (default: on
    CUDA)."""
    rows = flat.size(0)
    sync_free = flat.is_cuda if sync_free is None else sync_free
    return sync_free and rows <= _DENSE_DECODE_MAX_TOKENS and rows * topk >= num_experts


def _grouped_kernel(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs as one kernel reading the group offsets on the device (CUTLASS, bf16,
    Hopper): elsewhere `torch._grouped_mm` falls back to a loop that copies the offsets to the host."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _routing_matrix(chosen, weights, first: int, n: int, descending: bool = False,
                    total: Optional[int] = None) -> torch.Tensor:
    """[T, n] routing weights of this rank's n experts (column i: local expert i, or n - 1 - i when
    `descending`), zero where a token did not choose the expert; built on the device. `total`: the layer's
    number of experts; when this rank holds them all, every choice is local (2-3 ops instead of 9)."""
    if first == 0 and n == total:  # a token's top-k experts are distinct: scatter, no accumulation or masking
        slot = (n - 1 - chosen) if descending else chosen
        return torch.zeros(chosen.size(0), n, dtype=weights.dtype, device=weights.device).scatter_(1, slot, weights)
    local = chosen - first
    mine = (local >= 0) & (local < n)
    slot = (n - 1 - local) if descending else local
    gate = torch.zeros(chosen.size(0), n, dtype=weights.dtype, device=weights.device)
    return gate.scatter_add_(1, slot.clamp(0, n - 1), torch.where(mine, weights, torch.zeros_like(weights)))


def _moe_dense(flat, chosen, weights, experts, first: int, total: Optional[int] = None) -> torch.Tensor:
    """sum over this rank's experts e of (routing weight of e per token) * expert_e(x), without host syncs."""
    gate = _routing_matrix(chosen, weights, first, len(experts), total=total)
    out = torch.zeros_like(flat)
    for e, (fc1, fc2) in enumerate(experts):
        out.addcmul_(_swiglu(flat, fc1, fc2), gate[:, e: e + 1])
    return out


def _moe_indexed(flat, chosen, weights, fc1: torch.Tensor, fc2: torch.Tensor, first: int,
                 grouped: bool, descending: bool = False) -> torch.Tensor:
    """The routed experts over (token, expert) pairs sorted by expert, with this rank's experts stacked [E, out,
    in] (`_ExpertStack`), without host syncs: `grouped`, one grouped GEMM per projection whose group offsets stay
    on the device; else each pair's expert weights gathered and applied by one batched matmul (copies top-k
    experts' weights per token: for a few decode tokens only). `descending`: the stacks hold the experts last
    first (stack[i] is local expert E - 1 - i: a distributed optimizer's buffer lays parameters out in reverse)."""
    n, k = fc1.size(0), chosen.size(1)
    local = chosen.flatten() - first
    inside = (local >= 0) & (local < n)
    slot = n - 1 - local if descending else local
    key, order = torch.sort(torch.where(inside, slot, n), stable=True)  # others' last
    rows, mine = order // k, (key < n).unsqueeze(-1)
    x = flat.index_select(0, rows)
    if grouped:
        offsets = torch.bincount(key, minlength=n + 1)[:n].cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x, fc1.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, fc2.transpose(1, 2), offs=offsets)  # rows past the end: junk
    else:
        e = key.clamp(max=n - 1)
        gate, up = torch.bmm(fc1.index_select(0, e), x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(fc2.index_select(0, e), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    y = torch.where(mine, y * weights.flatten()[order].unsqueeze(-1), torch.zeros_like(y))
    return torch.zeros_like(flat).index_put_((rows,), y, accumulate=True)


def _moe_all(flat: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
             first: int, descending: bool = False, total: Optional[int] = None) -> torch.Tensor:
    """sum_e p_e * expert_e(x) for every token of `flat` [T, h] with every local expert computed (weight 0 where
    it was not chosen): batched matmuls over the experts stacked [E, 2 ffn, h] and [E, h, ffn] (`_ExpertStack`;
    `descending`: stack[i] is local expert E - 1 - i), no per-expert host work. `total`: the layer's experts."""
    gate = _routing_matrix(chosen, weights, first, fc1.size(0), descending, total)  # in the stack's order
    h = torch.matmul(flat, fc1.transpose(1, 2))  # [E, T, 2 ffn]
    g, u = h.chunk(2, dim=-1)
    a = F.silu(g).mul_(u).mul_(gate.t().unsqueeze(-1))  # [E, T, ffn], weighted
    return torch.bmm(a, fc2.transpose(1, 2)).sum(0)


def _moe_token(x: torch.Tensor, token_experts: list[int], token_weights: list[float], experts, first: int,
               shared: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """sum_e w_e * expert_e(x) over one token's routed experts on this rank (plus `shared`'s (fc1, fc2) with
    weight 1) for one token x [hidden], in as few ops as one token allows: the gate/up products stacked for one
    SwiGLU, the down products accumulated by addmv with the routing weight as alpha; experts big enough for
    oneDNN (`platform.onednn_linear`, x86 CPUs) scale the activations by the weights and sum the products."""
    picked = [(experts[e - first], w) for e, w in zip(token_experts, token_weights)
              if first <= e < first + len(experts)]
    if shared is not None:
        picked.insert(0, (shared, 1.0))
    if not picked:
        return torch.zeros_like(x)
    if platform.onednn_linear(picked[0][0][0]):  # big experts on an x86 CPU: oneDNN's products (no alpha)
        h = torch.stack([_linear(x, fc1) for (fc1, _), _ in picked])
        gate, up = h.chunk(2, dim=-1)
        scale = torch.tensor([w for _, w in picked], dtype=h.dtype).unsqueeze(-1)
        rows = F.silu(gate).mul_(up).mul_(scale).unbind(0)
        return torch.stack([_linear(a, fc2) for ((_, fc2), _), a in zip(picked, rows)]).sum(0)
    h = torch.stack([torch.mv(fc1, x) for (fc1, _), _ in picked]) if len(picked) > 1 else \
        torch.mv(picked[0][0][0], x).unsqueeze(0)
    gate, up = h.chunk(2, dim=-1)
    rows = F.silu(gate).mul_(up).unbind(0)
    y = None
    for ((_, fc2), w), a in zip(picked, rows):
        if y is None:
            y = torch.mv(fc2, a)
            if w != 1.0:
                y.mul_(w)
        else:
            y = torch.addmv(y, fc2, a, alpha=w)
    return y


def _stack_view(tensors: list[torch.Tensor]) -> Optional[tuple[torch.Tensor, bool]]:
    """([n, *shape] view, descending) of same-shaped contiguous tensors laid out at equal spacing in one storage
    (as stacked experts, or a buffer holding them in order or in reverse order); the view is in memory order, so
    `descending` says view[i] is tensors[n - 1 - i]. None when they are not so laid out."""
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    if not all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype and t.device == first.device
               and t.untyped_storage().data_ptr() == base for t in tensors):
        return None
    descending = len(tensors) > 1 and tensors[1].storage_offset() < first.storage_offset()
    ordered = tensors[::-1] if descending else tensors
    low = ordered[0]
    step = ordered[1].storage_offset() - low.storage_offset() if len(tensors) > 1 else low.numel()
    if step < low.numel() or any(t.storage_offset() != low.storage_offset() + i * step for i, t in enumerate(ordered)):
        return None
    return low.as_strided((len(tensors), *low.shape), (step, *low.stride()), low.storage_offset()), descending


class _ExpertStack:
    """One MoE layer's local experts as two stacked tensors [E, 2 ffn, hidden] and [E, hidden, ffn] that the
    device indexes by the routed experts (no host-side choice of weights). Views of the parameters' own memory,
    never a second copy: when the experts already lie at equal spacing in one buffer (stacked, or in order in a
    flat buffer) that buffer is viewed; when each owns its memory, the parameters are moved once into one
    stacked tensor (`param.data` becomes a slice of it, so in-place updates and checkpoint loads show through).
    Experts lying last first (a distributed optimizer's buffer) are viewed as they lie, `descending`. None when
    neither holds (e.g. experts out of order in a shared buffer): the host-synced path is taken."""

    def __init__(self, experts: list[tuple[torch.Tensor, torch.Tensor]]):
        self.experts = experts
        (self.fc1, down1), (self.fc2, down2) = (self._stack([e[i] for e in experts]) for i in (0, 1))
        if down1 != down2:  # one grouped order must serve both projections
            self.fc1 = self.fc2 = None
        self.descending = down1

    @staticmethod
    def _stack(params: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], bool]:
        view = _stack_view(params)
        owned = all(isinstance(p, torch.nn.Parameter) and p.is_contiguous()
                    and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in params)
        if view is not None or not owned or len({(p.shape, p.dtype, p.device) for p in params}) != 1:
            return view if view is not None else (None, False)
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: training may update them in place
            stacked = torch.empty((len(params), *params[0].shape), dtype=params[0].dtype, device=params[0].device)
            for i, p in enumerate(params):
                stacked[i].copy_(p)
                p.data = stacked[i]
        return _stack_view(params)

    def valid(self) -> bool:
        """Still views of the experts' memory (a model moved or reloaded into new tensors breaks them)."""
        if self.fc1 is None or self.fc2 is None:
            return False
        n = len(self.experts)
        ends = ((0, n - 1), (n - 1, 0)) if self.descending else ((0, 0), (n - 1, n - 1))
        # stack[i]'s address from the stack's own (indexing it would be an op per check, every forward)
        return all(stack.data_ptr() + i * stack.stride(0) * stack.element_size() == self.experts[e][j].data_ptr()
                   for stack, j in ((self.fc1, 0), (self.fc2, 1)) for i, e in ends)


def _rope(x: torch.Tensor, rotation) -> torch.Tensor:
    """Megatron-Core's MLA rope on `x` [..., rope_dim], each interleaved pair (x[2i], x[2i+1]) rotated by the
    i-th angle. The result keeps the pairs interleaved, where Megatron-Core regroups them into halves: scores only
    ever take dot products of a query's and a key's rope parts, which both come from here, and a permutation of
    both leaves those unchanged. `rotation`: the complex unit numbers [..., rope_dim / 2] (fp32/fp64: one complex
    product), or (cos, sin) for other dtypes."""
    if torch.is_tensor(rotation):
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rotation).flatten(-2)
    cos, sin = rotation
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


@dataclass
class _Step:
    """What every layer of one forward shares: where the new tokens go and what they may attend to."""
    positions: torch.Tensor  # [b, s]
    lengths: torch.Tensor  # [b] cached tokens before this step
    total: int  # cache rows attended to
    start: Optional[int]  # batch of one: the new rows are [start, start + s)
    mask: Optional[torch.Tensor]  # [b, 1, s, total] visible keys; None when all are
    absorbed: bool
    hide: Optional[torch.Tensor] = None  # ~mask, made once per step for the layers' masked_fill_
    valid: Optional[torch.Tensor] = None  # [b, s] real (not right-padding) tokens, for KDA states; None: all
    rope: dict = field(default_factory=dict)
    causal: bool = False  # every row starts at position 0 (a prefill): the mask is plain causal
    additive: dict = field(default_factory=dict)  # dtype -> the mask as 0 / -inf, made once for every layer


class InferenceEngine:
    """Generation with a latent KV cache on a single-stage GPTModel; with TP/EP > 1, every rank of the tensor-
    and expert-parallel groups calls the same methods with the same arguments."""

    def __init__(self, model: torch.nn.Module, detokenize: Optional[Callable[[list[int]], str]] = None,
                 vocab_size: Optional[int] = None, weights_version: int = 0):
        model = getattr(model, "module", model)
        cfg = model.config
        if not (model.pre_process and model.post_process):
            raise ValueError(f"the inference engine needs every layer on each rank: --pipeline-model-parallel-size "
                             f"{cfg.pipeline_model_parallel_size} is not supported for generation (use 1; tensor "
                             "and expert parallelism are)")
        if cfg.context_parallel_size > 1:
            raise ValueError("the inference engine does not support --context-parallel-size > 1")
        if cfg.add_bias_linear:
            raise ValueError("the inference engine supports MLA/MoE models without linear biases")
        if cfg.rotary_interleaved:
            raise ValueError("the inference engine supports MLA with non-interleaved rotary embeddings")
        if cfg.moe_expert_capacity_factor is not None:
            raise ValueError("the inference engine routes every token to its experts: it does not support "
                             "moe_expert_capacity_factor (token dropping)")
        self.model, self.config, self.detokenize = model, cfg, detokenize
        self.vocab_size = model.vocab_size  # ids the engine may emit; set_vocab_size narrows it to a tokenizer's
        if vocab_size is not None:
            self.set_vocab_size(vocab_size)
        self.weights_version = weights_version
        # finished rows' caches for prompts that continue them (multi-turn episodes); None: off (enable_prefix_store)
        self.prefix_store: Optional[PrefixStore] = None
        # In-flight weight updates (RL rollout workers): called between decode steps of a batch; returns True when
        # it changed the weights (update_weights). The batch then re-encodes its unfinished rows' tokens under the
        # new weights (their cache is rebuilt, so later tokens' logprobs are exactly the new policy's) and tags
        # the following tokens with the new weights_version.
        self.between_steps: Optional[Callable[[], bool]] = None
        self.prefill_tokens = 0  # prompt tokens run through prefill forwards (a group's prompt counts once)
        self.layers = list(model.decoder.layers)
        for layer in self.layers:
            if not isinstance(layer.self_attention, (MLASelfAttention, KimiDeltaAttention)):
                raise ValueError("the inference engine supports MLA and Kimi Delta Attention layers")
        # Kimi Linear: KDA layers keep a constant-size state in the cache instead of per-token latents
        self.recurrent = [layer.self_attention if isinstance(layer.self_attention, KimiDeltaAttention) else None
                          for layer in self.layers]
        if not (cfg.gated_linear_unit and cfg.activation_func is F.silu):
            raise ValueError("the inference engine supports SwiGLU MLPs (gated_linear_unit with silu)")
        _check_fused_norms(model)
        self.groups = _Groups()
        mla = next((layer.self_attention for layer in self.layers
                    if isinstance(layer.self_attention, MLASelfAttention)), None)
        self.heads = mla.num_attention_heads_per_partition if mla is not None else 0
        self.mtp_layers = list(model.mtp.layers) if getattr(model, "mtp", None) is not None else []
        self._experts = {}  # id(MoE layer) -> [(fc1, fc2)] of its local experts
        for layer in self.layers + [m.transformer_layer for m in self.mtp_layers]:
            mlp = layer.mlp
            if getattr(mlp, "router", None) is not None:
                self._experts[id(mlp)] = _expert_weights(mlp.experts)
            elif not (hasattr(mlp, "linear_fc1") and hasattr(mlp, "linear_fc2")):
                raise ValueError(f"the inference engine reads a dense MLP's linear_fc1 / linear_fc2; "
                                 f"{type(mlp).__name__} has none (TE's op fuser, --use-te-op-fuser, is not "
                                 "supported for generation)")
        r, dn, dv = cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim
        # Absorbed attention costs ~(2r + rope) per head, new token and cached token; expanded costs r(dn + dv)
        # per head and cached token for the up-projection plus (dn + rope + dv) per new and cached token. For
        # s new tokens absorbed wins while s (2r - dn - dv) < r (dn + dv).
        self.absorb_max_tokens = (r * (dn + dv)) // (2 * r - dn - dv) if 2 * r > dn + dv else 1 << 30
        self._rope_tables, self._fast_router, self._kv_up_views, self._sizes = {}, {}, {}, {}
        # GPU: no host reads of device values inside a forward (MoE routing, cache lengths), so that the host
        # queues a whole step ahead of the device; None: on when the model is on CUDA
        self.host_sync_free: Optional[bool] = None
        self._stacks: dict[int, _ExpertStack] = {}  # id(MoE layer) -> its experts stacked (sync-free MoE)
        # speculative decoding's step-aside decision (inference/speculative.py, plan_speculation): measured costs
        # and the latest decision per (draft depth, batch bucket, path: "single" or "batched")
        self.draft_costs: dict[tuple, object] = {}
        self.speculation_decisions: dict[tuple, bool] = {}
        # CPU: which kernel takes products by big weights, measured once per process on this engine's weights
        # (ranks of a tensor/expert-parallel group agree on one, so that replicated products match bit for bit)
        groups = tuple(g for g in (self.groups.tp, self.groups.experts, self.groups.tp) if g is not None)
        self.cpu_linear_note = platform.choose_cpu_linear(self.decode_weights(), groups=groups) \
            if self.device.type == "cpu" else None
        if self.cpu_linear_note:  # once per process: only the first engine measures
            print(f"megatron_ext: {self.cpu_linear_note}", file=sys.stderr, flush=True)

    def decode_weights(self, rotation: int = 0) -> list[torch.Tensor]:
        """The matrices one decode step (batch 1) multiplies a row by: the attention projections, the router,
        the shared expert and top-k routed experts of each MoE layer, a dense MLP, the output layer. Norm
        vectors are left out (a few KB). The routed experts are local experts (rotation * k + i) mod E, i < k:
        successive rotations read other experts, as successive decode steps routed elsewhere do (so that they
        come from memory, not from a cache that re-reading the same k would keep them in)."""
        def matrices(module):
            return [m.weight for m in module.modules() if torch.is_tensor(getattr(m, "weight", None))
                    and m.weight.dim() == 2]

        out = []
        for layer in self.layers:
            out += matrices(layer.self_attention)
            mlp = layer.mlp
            router = getattr(mlp, "router", None)
            if router is None:
                out += matrices(mlp)
                continue
            out.append(router.weight)
            if getattr(mlp, "shared_experts", None) is not None:
                out += matrices(mlp.shared_experts)
            experts = self._experts[id(mlp)]
            for i in range(min(router.topk, len(experts))):
                out += list(experts[(rotation * router.topk + i) % len(experts)])
        model = self.model
        out.append(model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                   else model.output_layer.weight)
        return out

    def enable_prefix_store(self, max_mb: float) -> Optional[PrefixStore]:
        """Keep finished rows' caches (at most `max_mb` MB) for prompts that continue them (PrefixStore); 0 turns
        it off. Not for Kimi Linear hybrids (a KDA layer's state is not kept): None there."""
        self.prefix_store = None
        if max_mb > 0 and all(r is None for r in self.recurrent):
            self.prefix_store = PrefixStore(int(max_mb * 2 ** 20))
        return self.prefix_store

    def set_vocab_size(self, vocab_size: int):
        """Limit generation to the tokenizer's ids: the embedding's padding rows are never sampled."""
        if not 1 <= vocab_size <= self.model.vocab_size:
            raise ValueError(f"vocabulary size {vocab_size} must be between 1 and the model's (padded) "
                             f"{self.model.vocab_size}: the tokenizer does not fit this model")
        self.vocab_size = vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.embedding.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embedding.word_embeddings.weight.dtype

    def new_cache(self, num_layers: int, batch: int, max_len: int) -> LatentCache:
        """A cache for the decoder's layers (num_layers == their count: KDA layers get states) or for that many
        MTP layers (MLA)."""
        cfg = self.config
        recurrent = self.recurrent if num_layers == len(self.layers) else None
        return LatentCache(num_layers, batch, max_len, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, self.dtype,
                           self.device, recurrent)

    # ---------------------------------------------------------------------------------------------------
    # one forward step over new tokens, with the cache
    # ---------------------------------------------------------------------------------------------------

    def _step(self, positions: torch.Tensor, lengths: torch.Tensor, cache: LatentCache,
              valid: Optional[torch.Tensor] = None, host_lengths: Optional[list[int]] = None) -> _Step:
        b, s = positions.shape
        if host_lengths is None:  # read from the device (a sync on a GPU)
            host_lengths = [int(lengths[0])] if b == 1 else [int(lengths.max())]
        start = host_lengths[0] if b == 1 else None
        total = max(host_lengths) + s
        if total > cache.max_len:
            raise ValueError(f"the cache holds {cache.max_len} tokens, this step needs {total}")
        mask = None
        if b > 1 or s > 1:  # a batch of one decoding one token sees every cached row
            mask = (torch.arange(total, device=positions.device).view(1, 1, total) <= positions.unsqueeze(-1))
            mask = mask.unsqueeze(1)
        absorbed = s <= self.absorb_max_tokens
        return _Step(positions, lengths, total, start, mask, absorbed=absorbed, valid=valid,
                     hide=~mask if absorbed and mask is not None else None, causal=max(host_lengths) == 0)

    def _rope_for(self, attn: MLASelfAttention, step: _Step, length: int):
        """The rotation `_rope` applies at the step's positions, [s, b, 1, rope_dim / 2]: complex numbers, or
        (cos, sin) in half precision; mscale folded in as Megatron-Core does. Layers whose rotary tables are equal
        share one gather per step."""
        table = self._rope_tables.get(id(attn.rotary_pos_emb))
        if table is None or table[0].size(0) < length:
            table = self._rope_table(attn, max(length, 2 * (table[0].size(0) if table else 0)))
            table = next((t for t in self._rope_tables.values() if t[0].shape == table[0].shape
                          and torch.equal(t[0], table[0]) and torch.equal(t[1], table[1])), table)
            self._rope_tables[id(attn.rotary_pos_emb)] = table
        key = id(table[0])
        if key not in step.rope:
            index = step.positions.t()
            if table[2] is not None:
                step.rope[key] = table[2][index].unsqueeze(2)
            else:
                step.rope[key] = (table[0][index].unsqueeze(2), table[1][index].unsqueeze(2))
        return step.rope[key]

    def _rope_table(self, attn: MLASelfAttention, length: int):
        out = attn.rotary_pos_emb(length)
        emb, mscale = out if isinstance(out, tuple) else (out, 1.0)
        emb = emb.reshape(length, -1)
        half = emb.size(-1) // 2
        if not torch.equal(emb[:, :half], emb[:, half:]):
            raise ValueError("the inference engine expects rotary frequencies repeated over both halves")
        cos = (torch.cos(emb[:, :half]) * mscale).to(self.dtype)
        sin = (torch.sin(emb[:, :half]) * mscale).to(self.dtype)
        rotation = torch.complex(cos, sin) if self.dtype in (torch.float32, torch.float64) else None
        return cos, sin, rotation

    def _attention(self, attn: MLASelfAttention, h: torch.Tensor, step: _Step, cache_kv: torch.Tensor):
        """MLA over new tokens h [s, b, hidden]: appends their latents and rope keys to `cache_kv`
        [b, max_len, r + rope] and returns this rank's partial output projection [s, b, hidden]."""
        cfg = self.config
        s, b, _ = h.shape
        n, dn, dr, r = self.heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is not None:
            q_latent = _norm(attn.q_layernorm, _linear(h, attn.linear_q_down_proj.weight))
            q = _linear(_fused_norm(attn.linear_q_up_proj, q_latent), attn.linear_q_up_proj.weight)
        else:
            q = _linear(h, attn.linear_q_proj.weight)
        q_nope, q_rope = q.view(s, b, n, dn + dr).split((dn, dr), dim=-1)  # split, narrow: one op for two views
        kv_latent, kv_rope = _linear(h, attn.linear_kv_down_proj.weight).split((r, dr), dim=-1)
        latent = _fused_norm(attn.linear_kv_up_proj, _norm(attn.kv_layernorm, kv_latent))  # what is cached
        rotation = self._rope_for(attn, step, cache_kv.size(1))
        pe = _rope(torch.cat((q_rope, kv_rope.unsqueeze(2)), dim=2), rotation)  # [s, b, n + 1, dr]
        new = torch.cat((latent, pe[:, :, n]), dim=-1).transpose(0, 1)  # [b, s, r + dr]
        if step.start is not None:  # one row
            cache_kv.narrow(1, step.start, s).copy_(new)
        else:
            slots = step.lengths.unsqueeze(1) + torch.arange(s, device=h.device).unsqueeze(0)
            cache_kv[torch.arange(b, device=h.device).unsqueeze(1), slots] = new
        cached = cache_kv.narrow(1, 0, step.total)  # [b, t, r + dr]
        if step.absorbed:
            out = self._absorbed(q_nope, pe[:, :, :n], cached, self._kv_up(attn), step, attn.softmax_scale)
        else:
            w_kv_up = attn.linear_kv_up_proj.weight
            out = self._expanded(q_nope, pe[:, :, :n], cached, w_kv_up, step, attn.softmax_scale)
        return _linear(out, attn.linear_proj.weight)

    def _kv_up(self, attn: MLASelfAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [n, dn, r], W_uv^T [n, r, dv]): views of the key/value up-projection, made once per weight
        tensor (in-place updates show through; a parameter given new memory gets new views)."""
        w = attn.linear_kv_up_proj.weight
        views = self._kv_up_views.get(id(attn))
        if views is None or views[0] is not w or views[1].data_ptr() != w.data_ptr():
            cfg = self.config
            dn = cfg.qk_head_dim
            heads = w.view(self.heads, dn + cfg.v_head_dim, cfg.kv_lora_rank)
            views = self._kv_up_views[id(attn)] = (w, heads[:, :dn], heads[:, dn:].transpose(1, 2))
        return views[1], views[2]

    def _absorbed(self, q_nope, q_pe, cached, kv_up, step: _Step, scale: float):
        """Attention in latent space: scores = [q_nope W_uk | q_pe] . [latent | rope key], output = (softmax .
        latent) W_uv; [s, b, n * dv]. `kv_up`: (W_uk, W_uv^T) from `_kv_up`. In pieces of at most
        _ATTENTION_MAX_SCORE_BYTES of scores (rows, then a row's queries), as `_expanded`: a model whose kv-lora
        rank makes absorbing always pay (the plain `tiny` preset) prefills here: one call over 64 prompts of 1,400
        tokens peaked at 5.4 GB, in pieces 1.65 GB (`benchmarks/prefill_memory.py --attention absorbed`)."""
        s, b, n, _ = q_nope.shape
        t, hide = cached.size(1), step.hide
        per_row = n * s * t * 4
        if b * per_row <= _ATTENTION_MAX_SCORE_BYTES:
            return self._absorbed_piece(q_nope, q_pe, cached, kv_up, hide, scale)
        rows = max(1, _ATTENTION_MAX_SCORE_BYTES // per_row)
        queries = s if rows > 1 else max(1, _ATTENTION_MAX_SCORE_BYTES // (n * t * 4))
        return torch.cat([torch.cat([self._absorbed_piece(
            q_nope[j:j + queries, i:i + rows], q_pe[j:j + queries, i:i + rows], cached[i:i + rows], kv_up,
            None if hide is None else hide[i:i + rows, :, j:j + queries], scale) for j in range(0, s, queries)])
            for i in range(0, b, rows)], dim=1)

    def _absorbed_piece(self, q_nope, q_pe, cached, kv_up, hide: Optional[torch.Tensor], scale: float):
        """`_absorbed` in one call; `hide`: the step's ~mask (or its piece), None when nothing is hidden."""
        w_uk, w_uv_t = kv_up
        s, b, n, dn = q_nope.shape
        r, t = self.config.kv_lora_rank, cached.size(1)
        if s == 1:  # decode: [b, n, .] throughout, heads first only for the up-projections
            q_latent = torch.bmm(q_nope[0].transpose(0, 1), w_uk)  # [n, b, r]
            query = torch.cat((q_latent, q_pe[0].transpose(0, 1)), dim=-1).transpose(0, 1)  # [b, n, r + dr]
            # one fused pass over the cache (the heads as one row's queries, the cached rows as keys and, sliced
            # after, values): scores, mask and softmax unmaterialised; 1.2-1.45x the attention of 64 rows of 1,300
            # cached tokens on the CPU (flash kernel) against baddbmm + masked_fill + softmax + bmm
            mask = None if hide is None else torch.zeros((b, 1, 1, t), dtype=query.dtype, device=query.device) \
                .masked_fill_(hide.view(b, 1, 1, t), -math.inf)
            keys = cached.unsqueeze(1)  # [b, 1, t, r + dr]
            out_latent = F.scaled_dot_product_attention(query.unsqueeze(1), keys, keys, attn_mask=mask,
                                                        scale=scale)[:, 0, :, :r]  # [b, n, r]
            out = torch.bmm(out_latent.transpose(0, 1), w_uv_t)  # [n, b, dv]
            return out.transpose(0, 1).reshape(1, b, -1)
        if b == 1:  # a speculative verify or a chunk of one row: the s new tokens of every head in one batch
            q_latent = torch.bmm(q_nope[:, 0].transpose(0, 1), w_uk)  # [n, s, r]
            query = torch.cat((q_latent, q_pe[:, 0].transpose(0, 1)), dim=-1).view(1, n * s, -1)
            scores = torch.baddbmm(cached.new_empty(()), query, cached.transpose(1, 2), beta=0, alpha=scale)
            if hide is not None:  # [1, 1, s, t] -> over the heads
                scores.view(n, s, t).masked_fill_(hide.view(1, s, t), -math.inf)
            out_latent = torch.bmm(torch.softmax(scores, dim=-1), cached[..., :r])  # [1, n * s, r]
            out = torch.bmm(out_latent.view(n, s, r), w_uv_t)  # [n, s, dv]
            return out.transpose(0, 1).reshape(s, 1, -1)
        heads_first = (2, 1, 0, 3)  # [s, b, n, d] -> [n, b, s, d]: one matmul per head over every new token
        q_latent = torch.bmm(q_nope.permute(heads_first).reshape(n, b * s, dn), w_uk)  # [n, b*s, r]
        query = torch.cat((q_latent, q_pe.permute(heads_first).reshape(n, b * s, -1)), dim=-1)
        query = query.view(n, b, s, -1).transpose(0, 1).reshape(b, n * s, -1)
        scores = torch.baddbmm(cached.new_empty(()), query, cached.transpose(1, 2), beta=0, alpha=scale)
        if hide is not None:
            scores = scores.view(b, n, s, t).masked_fill_(hide, -math.inf).view(b, n * s, t)
        out_latent = torch.bmm(torch.softmax(scores, dim=-1), cached[..., :r])  # [b, n*s, r]
        out_latent = out_latent.view(b, n, s, r).transpose(0, 1).reshape(n, b * s, r)
        out = torch.bmm(out_latent, w_uv_t)  # [n, b*s, dv]
        return out.view(n, b, s, -1).permute(heads_first).reshape(s, b, -1)

    def _expanded(self, q_nope, q_pe, cached, w_kv_up, step: _Step, scale: float):
        """Per-head keys and values up-projected from every cached latent, then SDPA; [s, b, n * dv]. Values are
        zero-padded to the query width when MLA's head dims differ, and a prefill (every row from position 0) is
        `is_causal`: SDPA's fused kernels (flash on the CPU and on CUDA) need equal widths and no boolean mask,
        else it falls back to a score-materialising path (`_scaled_dot_product_attention_math`): a whole prefill
        of 64 prompts of 1,400 tokens took 24 s on the CPU, 5 s fused (benchmarks/prefill_memory.py, 2026-12-07).
        Other steps (a prompt's continuation after cached tokens) pass the mask as 0 / -inf, made once per step for
        every layer."""
        s, b, n, dn = q_nope.shape
        r, t = self.config.kv_lora_rank, cached.size(1)
        kv_up = torch.matmul(cached[..., :r], w_kv_up.t()).view(b, t, n, -1)
        k_nope, v = kv_up[..., :dn], kv_up[..., dn:]
        k = torch.cat((k_nope, cached[..., r:].unsqueeze(2).expand(-1, -1, n, -1)), dim=-1)
        dv = v.size(-1)
        if dv != k.size(-1):
            v = F.pad(v, (0, k.size(-1) - dv))
        q = torch.cat((q_nope, q_pe), dim=-1).permute(1, 2, 0, 3)  # [b, n, s, d]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        causal = step.causal and s == t

        def mask(rows: slice, queries: slice):
            if step.mask is None or causal and queries.start == 0 and queries.stop >= s:
                return None
            additive = step.additive.get(q.dtype)
            if additive is None:
                additive = step.additive[q.dtype] = torch.zeros(step.mask.shape, dtype=q.dtype, device=q.device) \
                    .masked_fill_(~step.mask, -math.inf)
            return additive[rows, :, queries]

        def attend(rows: slice, queries: slice):
            m = mask(rows, queries)
            return F.scaled_dot_product_attention(q[rows, :, queries], k[rows], v[rows], attn_mask=m, scale=scale,
                                                  is_causal=m is None and step.mask is not None)

        per_row = n * s * t * 4
        if b * per_row <= _ATTENTION_MAX_SCORE_BYTES:
            out = attend(slice(0, b), slice(0, s))  # [b, n, s, d]
        else:
            rows = max(1, _ATTENTION_MAX_SCORE_BYTES // per_row)
            queries = s if rows > 1 else max(1, _ATTENTION_MAX_SCORE_BYTES // (n * t * 4))
            out = torch.cat([torch.cat([attend(slice(i, i + rows), slice(j, j + queries))
                                        for j in range(0, s, queries)], dim=2) for i in range(0, b, rows)])
        return out[..., :dv].permute(2, 0, 1, 3).reshape(s, b, -1)

    def _mlp(self, mlp, h: torch.Tensor, routing: Optional[list]) -> torch.Tensor:
        router = getattr(mlp, "router", None)
        if router is None:
            return _all_reduce(_gated_mlp(mlp, h), self.groups.tp)
        return self._moe(mlp, h, routing)

    def _route(self, router, flat: torch.Tensor, routing: Optional[list]):
        """(experts [T, k], weights [T, k]) as Megatron-Core's top-k router chooses them for `flat` [T, h]. The
        common case (sigmoid scores, optional expert bias, no groups, replay, capacity or jitter) is computed here
        in a few ops; anything else goes through the router module itself."""
        cfg = self.config
        fast = self._fast_router.get(id(router))
        if fast is None:
            fast = (router.score_function == "sigmoid" and router.routing_type != "sinkhorn"
                    and router.bias is None
                    and cfg.moe_input_jitter_eps is None
                    and not cfg.moe_router_force_load_balancing and not cfg.moe_router_fusion
                    and not (cfg.moe_router_group_topk and (cfg.moe_router_num_groups or 1) > 1))
            self._fast_router[id(router)] = fast
        if fast:
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(cfg.moe_router_dtype, flat.dtype)
            if dtype == torch.float32:  # sigmoid in fp32 as the router computes it, with no casts to make
                weight = router.weight
                scores = torch.sigmoid(_linear(flat if flat.dtype == dtype else flat.to(dtype),
                                                weight if weight.dtype == dtype else weight.to(dtype)))
            else:  # sigmoid in fp32 whatever the logits' precision, as the router computes it
                scores = torch.sigmoid(F.linear(flat.to(dtype), router.weight.to(dtype)).float()).to(dtype)
            bias = router.expert_bias
            chosen = torch.topk(scores + bias if bias is not None else scores, router.topk, dim=1).indices
            weights = scores.gather(1, chosen)
            if router.topk > 1:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            if cfg.moe_router_topk_scaling_factor:
                weights = weights * cfg.moe_router_topk_scaling_factor
        else:  # without capacity dropping (refused) every token has exactly top-k experts
            recorder, replay = _TopKRecorder(), router.router_replay
            router.router_replay = recorder  # records Megatron's top-k; a trainer's replay action never applies
            try:
                probs, routing_map = router(flat.unsqueeze(1))
            finally:
                router.router_replay = replay
            chosen = recorder.indices
            if chosen is None:  # sinkhorn / fused routing: the experts, in ascending order (no nonzero: a sync)
                chosen = torch.topk(routing_map.to(torch.int8), router.topk, dim=1).indices.sort(dim=1).values
            weights = probs.gather(1, chosen)
        if routing is not None:
            routing.append(chosen)
        return chosen, (weights if weights.dtype == flat.dtype else weights.to(flat.dtype))

    @property
    def sync_free(self) -> bool:
        """Whether forwards avoid reading device values on the host (`host_sync_free`, default: on a GPU)."""
        return self.device.type == "cuda" if self.host_sync_free is None else self.host_sync_free

    def _expert_stack(self, mlp) -> Optional[_ExpertStack]:
        stack = self._stacks.get(id(mlp))
        if stack is None or (stack.fc1 is not None and stack.fc2 is not None and not stack.valid()):
            stack = self._stacks[id(mlp)] = _ExpertStack(self._experts[id(mlp)])
        return stack if stack.fc1 is not None and stack.fc2 is not None else None

    def _expert_bytes(self, mlp) -> int:
        """Bytes of this layer's local experts' weights."""
        size = self._sizes.get(id(mlp))
        if size is None:
            size = self._sizes[id(mlp)] = sum(w.numel() * w.element_size() for pair in self._experts[id(mlp)]
                                              for w in pair)
        return size

    def _foldable_shared(self, mlp, flat: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The shared expert's (fc1, fc2) when one token's shared and routed experts can be summed together:
        one token, one rank (no all-reduce tells them apart), routed-expert shapes, no fused norm or gate."""
        shared = getattr(mlp, "shared_experts", None)
        if (shared is None or flat.size(0) != 1 or self.groups.tp is not None or self.groups.experts is not None
                or getattr(shared, "use_shared_expert_gate", False)
                or getattr(shared.linear_fc1, "layer_norm_weight", None) is not None):
            return None
        fc1, fc2 = shared.linear_fc1.weight, shared.linear_fc2.weight
        e1, e2 = self._experts[id(mlp)][0]
        return (fc1, fc2) if fc1.shape == e1.shape and fc2.shape == e2.shape else None

    def _moe(self, mlp, h: torch.Tensor, routing: Optional[list]) -> torch.Tensor:
        """y = sum_e p_e * expert_e(x) + shared(x), computed directly on the tokens each of this rank's experts
        received (no dispatcher, no idle experts); other ranks' experts arrive in the all-reduce."""
        flat = h.reshape(-1, h.size(-1))
        chosen, weights = self._route(mlp.router, flat, routing)
        experts = self._experts[id(mlp)]
        first = mlp.local_expert_indices[0]
        sync_free = self.sync_free
        stack = self._expert_stack(mlp) if sync_free else None
        if stack is not None and _grouped_kernel(flat):
            out = _moe_indexed(flat, chosen, weights, stack.fc1, stack.fc2, first, True, stack.descending)
        elif _dense_decode(flat, chosen.size(1), self.config.num_moe_experts, sync_free):
            out = _moe_dense(flat, chosen, weights, experts, first, self.config.num_moe_experts)
        elif stack is not None and flat.size(0) * chosen.size(1) < len(experts):
            out = _moe_indexed(flat, chosen, weights, stack.fc1, stack.fc2, first, False, stack.descending)
        elif (1 < flat.size(0) and flat.size(0) * self._expert_bytes(mlp) <= _ALL_EXPERTS_MAX_WORK
              and (stack := self._expert_stack(mlp)) is not None):
            out = _moe_all(flat, chosen, weights, stack.fc1, stack.fc2, first, stack.descending,
                           self.config.num_moe_experts)
        elif flat.size(0) <= _FEW_TOKENS:  # decode and verify steps: token by token, no regrouping
            shared = self._foldable_shared(mlp, flat)
            per_token = [_moe_token(x, e, w, experts, first, shared)
                         for x, e, w in zip(flat, chosen.tolist(), weights.tolist())]
            if shared is not None:  # one token: its shared expert is in the sum
                return per_token[0].view_as(h)
            out = per_token[0].unsqueeze(0) if len(per_token) == 1 else torch.stack(per_token)
        elif (_HOST_GROUPED_MM and flat.device.type == "cpu" and hasattr(torch, "_grouped_mm")
              and not platform.onednn_linear(experts[0][0])  # oneDNN per expert beats torch's BLAS loop
              and (stack := self._expert_stack(mlp)) is not None
              and stack.fc1.dtype in (torch.float32, torch.bfloat16)):
            out = _moe_indexed(flat, chosen, weights, stack.fc1, stack.fc2, first, True, stack.descending)
        else:  # prefill: each expert once over all its tokens
            expert_ids, order = torch.sort(chosen.flatten(), stable=True)
            rows, w = order // chosen.size(1), weights.flatten()[order].unsqueeze(-1)
            counts = torch.bincount(expert_ids, minlength=first + len(experts)).tolist()
            mine = [e for e, count in enumerate(counts) if count and first <= e < first + len(experts)]
            xs, ws = flat.index_select(0, rows).split(counts), w.split(counts)  # each expert's tokens, one op each
            ys = []
            for e in mine:  # the routing weight scales the hidden activations (the down projection is linear)
                fc1, fc2 = experts[e - first]
                gate, up = _linear(xs[e], fc1).chunk(2, dim=-1)
                ys.append(_linear(F.silu(gate).mul_(up).mul_(ws[e]), fc2))
            out = torch.zeros_like(flat)
            if ys:  # a serial accumulation: index_add_ opens a parallel region, costly on a busy CPU
                if len(mine) != sum(1 for count in counts if count):  # others' experts too (EP): keep mine
                    parts = rows.split(counts)
                    rows = torch.cat([parts[e] for e in mine])
                out.index_put_((rows,), torch.cat(ys), accumulate=True)
        shared = getattr(mlp, "shared_experts", None)
        if shared is None:
            return _all_reduce(out, self.groups.experts).view_as(h)
        y = _gated_mlp(shared, flat)
        if getattr(shared, "use_shared_expert_gate", False):
            y = y * torch.sigmoid(F.linear(flat, shared.gate_weight))
        if self.groups.experts_are_tp:
            return _all_reduce(out + y, self.groups.tp).view_as(h)
        return (_all_reduce(out, self.groups.experts) + _all_reduce(y, self.groups.tp)).view_as(h)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s] ids -> [s, b, hidden]; with TP each rank looks up its vocabulary slice and the rest is summed."""
        emb = self.model.embedding.word_embeddings
        ids = tokens.t()
        if self.groups.tp is None:
            return F.embedding(ids, emb.weight)
        local = ids - emb.vocab_start_index
        outside = (local < 0) | (local >= emb.weight.size(0))
        x = F.embedding(local.masked_fill(outside, 0), emb.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return _all_reduce(x, self.groups.tp)

    def _sublayers(self, layer, step: _Step, cache_kv: torch.Tensor, routing, state=None):
        """A layer's attention and MLP (each with its pre-norm) as functions of their input; `state`: a Kimi Delta
        Attention layer's recurrent state, advanced over the new tokens."""
        def attention(x):
            h = _norm(layer.input_layernorm, x)
            if state is not None:
                out = layer.self_attention.step(h, state, step.valid)
            else:
                out = self._attention(layer.self_attention, h, step, cache_kv)
            return _all_reduce(out, self.groups.tp)

        return attention, lambda x: self._mlp(layer.mlp, _norm(layer.pre_mlp_layernorm, x), routing)

    def _layer(self, layer, x: torch.Tensor, step: _Step, cache_kv: torch.Tensor, routing,
               state=None) -> torch.Tensor:
        attention, mlp = self._sublayers(layer, step, cache_kv, routing, state)
        x = x + attention(x)
        return x + mlp(x)

    @torch.inference_mode()
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LatentCache, lengths: torch.Tensor,
               routing: Optional[list] = None, valid: Optional[torch.Tensor] = None,
               host_lengths: Optional[list[int]] = None) -> torch.Tensor:
        """Final-normed hidden states [s, b, h] of `tokens` [b, s] at `positions` [b, s], placed after each
        sample's `lengths` [b] cached tokens (their latents are appended). `routing`, when a list, receives each
        MoE layer's chosen experts [s * b, topk] (rows in [s, b] order, experts as the router ranks them).
        `valid` [b, s] marks the real tokens of right-padded rows (KDA states must not absorb padding).
        `host_lengths`: `lengths` as the caller knows them on the host (spares reading them from the device)."""
        with platform.without_device_mapping():
            step = self._step(positions, lengths, cache, valid, host_lengths)
            x = self._embed(tokens)
            if attn_residuals.is_installed(self.model.decoder):  # depth mixtures of these tokens' own outputs
                x = attn_residuals.run_layers(self.model.decoder, x, [
                    self._sublayers(layer, step, cache.kv[i], routing, cache.states[i])
                    for i, layer in enumerate(self.layers)])
            else:
                for i, layer in enumerate(self.layers):
                    x = self._layer(layer, x, step, cache.kv[i], routing, cache.states[i])
            return _norm(self.model.decoder.final_layernorm, x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [b, s, padded vocab] in fp32, gathered over the tensor-parallel vocabulary slices."""
        model = self.model
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else model.output_layer.weight)
        with platform.without_device_mapping():
            logits = _gather_last_dim(_linear(hidden, weight), self.groups.tp, self.groups.tp_size)
            return logits.transpose(0, 1).float()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LatentCache, lengths: torch.Tensor,
                routing: Optional[list] = None) -> torch.Tensor:
        """Logits [b, s, vocab] for `tokens` [b, s] placed after each sample's `lengths` cached tokens."""
        return self.logits(self.hidden(tokens, positions, cache, lengths, routing))

    def forward_with_hidden(self, tokens, positions, cache: LatentCache, lengths, routing=None):
        """(logits [b, s, vocab], final-normed hidden states [s, b, h]): the hidden states feed the MTP layers."""
        hidden = self.hidden(tokens, positions, cache, lengths, routing)
        return self.logits(hidden), hidden

    @torch.inference_mode()
    def mtp_hidden(self, depth: int, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                   cache: LatentCache, lengths: torch.Tensor, cache_layer: Optional[int] = None) -> torch.Tensor:
        """MTP layer `depth` as Megatron-Core computes it: at position t it combines the previous depth's hidden
        state (the main model's for depth 0) with the embedding of token t + depth + 1 and predicts token
        t + depth + 2. Its attention has a latent cache of its own (`cache` layer `cache_layer`, default
        `depth`). Returns its final-normed output [s, b, h], the next depth's input."""
        mtp = self.mtp_layers[depth]
        with platform.without_device_mapping():
            step = self._step(positions, lengths, cache)
            e = _norm(mtp.enorm, self._embed(next_tokens))
            x = _linear(torch.cat((e, _norm(mtp.hnorm, hidden)), -1), mtp.eh_proj.weight)
            x = _gather_last_dim(x, self.groups.tp, self.groups.tp_size)
            x = self._layer(mtp.transformer_layer, x, step, cache.kv[depth if cache_layer is None else cache_layer],
                            None)
            return _norm(mtp.final_layernorm, x)

    def mtp_forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                    cache: LatentCache, lengths: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Logits [b, s, vocab] of MTP layer `depth` (see mtp_hidden)."""
        return self.logits(self.mtp_hidden(depth, hidden, next_tokens, positions, cache, lengths))

    # ---------------------------------------------------------------------------------------------------
    # generation
    # ---------------------------------------------------------------------------------------------------

    def collective_device(self, group=None) -> torch.device:
        """Where tensors of a collective over `group` live: NCCL takes only CUDA tensors, gloo host tensors."""
        return self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def agreed_seeds(self, seeds: list[Optional[int]]) -> list[int]:
        """Requests without a seed draw one; ranks that cooperate on a request must draw the same tokens, so
        they agree on the drawn ones (the largest, over the tensor- then the expert-parallel group), all in one
        all-reduce per group."""
        missing = [i for i, s in enumerate(seeds) if s is None]
        if not missing:
            return list(seeds)
        groups = [g for g in (self.groups.tp, self.groups.ep) if g is not None]
        device = self.collective_device(groups[0]) if groups else torch.device("cpu")
        drawn = torch.randint(0, 2 ** 62, (len(missing),), dtype=torch.long, device=device)
        for group in groups:
            dist.all_reduce(drawn, op=dist.ReduceOp.MAX, group=group)
        out = list(seeds)
        for i, value in zip(missing, drawn.tolist()):
            out[i] = value
        return out

    def agreed_seed(self, seed: Optional[int]) -> int:
        return self.agreed_seeds([seed])[0]

    def generator(self, seed: int) -> torch.Generator:
        """A generator on the device tokens are drawn on (the model's)."""
        return torch.Generator(device=self.device).manual_seed(seed)

    def check_request(self, prompts: list[list[int]], params: list[SamplingParams]):
        """Raise ValueError naming the problem if prompt i with params[i] cannot be generated for."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        for p in params:
            p.validate(self.vocab_size)
        bad = [t for p in prompts for t in p if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        longest = max(len(p) + r.max_tokens for p, r in zip(prompts, params))
        if longest > self.model.max_sequence_length:
            raise ValueError(f"prompt + max_tokens = {longest} exceeds the model's {self.model.max_sequence_length}")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_token: Optional[Callable[[int, int, float], None]] = None) -> list[Completion]:
        """One completion per prompt. `params` is shared by every row (row i then draws with seed + i) or given
        per row (each row uses its own seed). `on_token(row, token_id, logprob)` is called as each token is drawn."""
        if isinstance(params, SamplingParams):
            rows = [params] * len(prompts)
            seeds = [params.seed + i if params.seed is not None else None for i in range(len(prompts))]
        else:
            rows = list(params)
            if len(rows) != len(prompts):
                raise ValueError(f"{len(rows)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
            seeds = [p.seed for p in rows]
        return self._generate_rows(prompts, rows, seeds, [1] * len(prompts), on_token)

    @torch.inference_mode()
    def generate_groups(self, prompts: list[list[int]], n: int | list[int],
                        params: SamplingParams | list[SamplingParams],
                        on_token: Optional[Callable[[int, int, float], None]] = None) -> list[list[Completion]]:
        """`n` samples of each prompt (or n[i] of prompt i); the samples of a prompt share one prefill (its cache
        is forked n ways). Sample j of a prompt whose params have seed s draws with seed s + j; result[i][j].
        `on_token(row, token_id, logprob)` numbers the rows prompt by prompt, sample by sample."""
        counts, rows, seeds = group_rows(prompts, n, params)
        return split_groups(self._generate_rows(prompts, rows, seeds, counts, on_token), counts)

    def _generate_rows(self, prompts, rows, seeds, counts: list[int], on_token=None) -> list[Completion]:
        self.check_request([prompts[i] for i in _prompt_of(counts)], rows)
        with self.generating():
            return _Batch(self, on_token).run(prompts, rows, self.agreed_seeds(seeds), counts)

    def continuous(self) -> "ContinuousBatch":
        """A decode batch that requests join between steps and leave as they finish (continuous batching)."""
        return ContinuousBatch(self)

    @contextlib.contextmanager
    def generating(self):
        """The model in eval mode (restored after) and the platform's device mapping off, for one generation."""
        was_training = self.model.training
        self.model.eval()
        try:
            with platform.without_device_mapping():
                yield
        finally:
            self.model.train(was_training)

    def num_moe_layers(self) -> int:
        return sum(1 for layer in self.layers if getattr(layer.mlp, "router", None) is not None)

    # ---------------------------------------------------------------------------------------------------
    # weights
    # ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, source, version: Optional[int] = None, strict: bool = True) -> int:
        """Copy new weights in place, without a checkpoint round trip: `source` is the trainer's model (a module,
        possibly wrapped in DDP / Float16Module, or a list of model chunks) holding the same Megatron parameter
        names and shards, or an iterable of (name, tensor) pairs. Every name and shape is checked before anything
        is copied (a mismatch changes nothing); with `strict`, every weight of the engine's model must be given.
        Returns the new weights_version (`version`, or the old one + 1)."""
        target = model_weights(self.model)
        incoming = _source_weights(source)
        unknown = sorted(set(incoming) - set(target))
        if unknown:
            raise ValueError(f"update_weights: {len(unknown)} weight(s) the serving model does not have, e.g. "
                             f"{unknown[:3]} (same architecture and parallel layout needed)")
        missing = sorted(set(target) - set(incoming))
        if strict and missing:
            raise ValueError(f"update_weights: {len(missing)} weight(s) of the serving model not given, e.g. "
                             f"{missing[:3]} (pass strict=False for a partial update)")
        wrong = [f"{k}: {tuple(incoming[k].shape)} for {tuple(target[k].shape)}" for k in sorted(incoming)
                 if tuple(incoming[k].shape) != tuple(target[k].shape)]
        if wrong:
            raise ValueError(f"update_weights: shape mismatch (given for serving) in {len(wrong)} weight(s): "
                             + "; ".join(wrong[:3]))
        for name, tensor in incoming.items():
            if not (tensor.is_floating_point() or not target[name].is_floating_point()):
                raise ValueError(f"update_weights: {name} is {tensor.dtype}, the serving model needs floating point")
        for name, tensor in incoming.items():
            dst = target[name]
            if dst.data_ptr() != tensor.data_ptr() or dst.device != tensor.device:  # not the very same storage
                dst.copy_(tensor)
        self.weights_version = self.weights_version + 1 if version is None else int(version)
        return self.weights_version


def group_counts(prompts: list, n, params) -> tuple[list[int], list[SamplingParams]]:
    """(samples per prompt, SamplingParams per prompt) of a grouped request: `n` one count or one per prompt,
    `params` one SamplingParams or one per prompt."""
    counts = [n] * len(prompts) if not isinstance(n, (list, tuple)) else list(n)
    if len(counts) != len(prompts) or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"n must be an integer >= 1 (or one per prompt), got {n!r}")
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if len(per_prompt) != len(prompts):
        raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
    return counts, per_prompt


def group_rows(prompts: list, n, params) -> tuple[list[int], list[SamplingParams], list[Optional[int]]]:
    """(samples per prompt, SamplingParams per row, seed per row) of a grouped request: sample j of a prompt whose
    params have seed s draws with seed s + j."""
    counts, per_prompt = group_counts(prompts, n, params)
    rows = [p for p, c in zip(per_prompt, counts) for _ in range(c)]
    seeds = [p.seed + j if p.seed is not None else None for p, c in zip(per_prompt, counts) for j in range(c)]
    return counts, rows, seeds


def split_groups(flat: list, counts: list[int]) -> list[list]:
    """Rows numbered prompt by prompt, sample by sample, as result[prompt][sample]."""
    starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return [flat[starts[i]: starts[i + 1]] for i in range(len(counts))]


def _prompt_of(counts: list[int]) -> list[int]:
    """The prompt index of each row when prompt i has counts[i] rows."""
    return [i for i, c in enumerate(counts) for _ in range(c)]


def model_weights(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (e.g. the routers' expert bias) by their Megatron names, with the
    DDP / Float16Module wrappers' `module.` prefixes removed."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    out = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def _source_weights(source) -> dict[str, torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        return model_weights(source)
    if isinstance(source, (list, tuple)) and source and all(isinstance(m, torch.nn.Module) for m in source):
        if len(source) != 1:
            raise ValueError(f"update_weights: {len(source)} model chunks given; the engine serves one stage "
                             "(virtual pipeline stages are not supported for generation)")
        return model_weights(source[0])
    out = {}
    for item in source.items() if isinstance(source, dict) else source:
        name, tensor = item
        while name.startswith("module."):
            name = name[len("module."):]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: {name} is a {type(tensor).__name__}, not a tensor")
        if name in out:
            raise ValueError(f"update_weights: {name} given twice")
        out[name] = tensor
    return out


class _Batch:
    """Batched generation whose rows may join between decode steps (continuous batching) and leave as they
    finish. `admit` prefills its prompts once each (prompt i has counts[i] rows, the samples: its cache is forked)
    and appends the rows to the running batch; `step` draws one token for every decoding row and runs one forward.
    A finished row leaves the batch (its cache row is dropped); one that returns routing takes part in one more
    forward of its last token, for that token's experts. Row ids number the rows admitted since the batch was
    last empty."""

    def __init__(self, engine: InferenceEngine, on_token=None):
        self.engine, self.on_token = engine, on_token
        self._reset()

    def _reset(self):
        dev = self.engine.device
        # per row, until `take` releases it (a batch that never empties does not grow with the rows it served)
        self.rows: dict[int, SamplingParams] = {}
        self.out: dict[int, Completion] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.want_routing: dict[int, bool] = {}
        self.next_row = 0
        # the decoding rows' sampling parameters, in `active` order
        self.temperature = torch.empty(0, dtype=torch.float64, device=dev)
        self.top_k = torch.empty(0, dtype=torch.long, device=dev)
        self.top_p = torch.empty(0, dtype=torch.float64, device=dev)
        self.greedy = torch.empty(0, dtype=torch.bool, device=dev)
        self.version = self.engine.weights_version
        # routing: per row the experts of its prefix (prompt, or all but the newest token after a re-encode) and
        # the first forward after it; per forward ([rows, moe layers, topk], row -> index)
        self.prefix_routing: dict[int, torch.Tensor] = {}
        self.first_step: dict[int, int] = {}
        self.routing_steps: dict[int, tuple[torch.Tensor, dict[int, int], bool]] = {}  # (.., on the host)
        self.steps = 0  # decode forwards so far
        self.cache: Optional[LatentCache] = None
        self.in_cache: list[int] = []  # the rows the cache holds, in its batch order
        self.active: list[int] = []  # rows still generating; `last` holds their next-token logits
        self.last: Optional[torch.Tensor] = None
        self.lengths: Optional[torch.Tensor] = None  # tokens in the cache of each cached row
        self.host_lengths: list[int] = []  # the same, known on the host (no device read)

    @property
    def decoding(self) -> int:
        """Rows generating now."""
        return len(self.active)

    def admit(self, prompts, rows: list[SamplingParams], seeds: list[int], counts: list[int]) -> list[int]:
        """Prefill `prompts` with the current weights and add their rows to the batch; returns the rows' ids."""
        eng, dev = self.engine, self.engine.device
        if not self.active and not self.in_cache:  # an empty batch starts over: row ids, weights version
            self._reset()
        elif eng.weights_version != self.version:
            raise RuntimeError(f"the weights changed (version {self.version} -> {eng.weights_version}) while rows "
                               "were decoding, outside the engine's between_steps hook: their cache is stale")
        prompt_of = _prompt_of(counts)
        record = any(p.return_routing for p in rows)
        # a prompt that continues a finished row's tokens starts from that row's cache (eng.prefix_store): only its
        # new tokens are prefilled, after `starts[i]` cached ones
        store = eng.prefix_store if not record else None
        reused = [store.take(p, eng.weights_version) if store is not None else None for p in prompts]
        starts = [0 if hit is None else hit[0] for hit in reused]
        # prefill each prompt once: right-padded; pad positions write latents that decoding overwrites. Nothing of
        # the batch changes before it succeeded (a prefill that raises, e.g. out of memory, leaves the batch whole)
        lens = [len(p) - start for p, start in zip(prompts, starts)]  # the tokens prefilled now
        width, P = max(lens), len(prompts)
        max_len = max(max(starts) + width, max(starts[i] + lens[i] + r.max_tokens for i, r in zip(prompt_of, rows)))
        cache = eng.new_cache(len(eng.layers), P, max_len)
        for i, hit in enumerate(reused):
            if hit is not None:
                for layer, kv in zip(cache.kv, hit[1]):
                    layer[i, : starts[i]] = kv
        tokens = torch.tensor([p[start:] + [0] * (width - n) for p, start, n in zip(prompts, starts, lens)],
                              dtype=torch.long, device=dev)
        starts_t = torch.tensor(starts, dtype=torch.long, device=dev)
        positions = (starts_t.unsqueeze(1) + torch.arange(width, device=dev).unsqueeze(0)).contiguous()
        routing = [] if record else None
        valid = None
        if min(lens) != width:  # right-padding must not reach a KDA layer's state
            valid = torch.arange(width, device=dev).unsqueeze(0) < torch.tensor(lens, device=dev).unsqueeze(1)
        hidden = eng.hidden(tokens, positions, cache, starts_t, routing, valid, host_lengths=starts)
        eng.prefill_tokens += sum(lens)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        last = eng.logits(hidden[lens_t - 1, torch.arange(P, device=dev)].unsqueeze(0))[:, 0]  # [P, vocab]
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        if any(c != 1 for c in counts):  # fork each prompt's cache to its samples
            cache.fork(counts_t)
            last = last.repeat_interleave(counts_t, dim=0)

        new = list(range(self.next_row, self.next_row + len(rows)))
        self.next_row += len(rows)
        for r, i, params, seed in zip(new, prompt_of, rows, seeds):
            self.rows[r], self.out[r] = params, Completion(prompt_ids=list(prompts[i]))
            self.generators[r], self.want_routing[r] = eng.generator(seed), params.return_routing
        greedy = [p.temperature == 0 for p in rows]

        def grow(t: torch.Tensor, values) -> torch.Tensor:
            return torch.cat((t, torch.tensor(values, dtype=t.dtype, device=dev)))

        self.temperature = grow(self.temperature, [p.temperature if p.temperature > 0 else 1.0 for p in rows])
        self.top_k = grow(self.top_k, [p.top_k for p in rows])
        self.top_p = grow(self.top_p, [p.top_p for p in rows])
        self.greedy = grow(self.greedy, greedy)
        if record:
            table = torch.stack(routing, dim=1).view(width, P, len(routing), -1).to(torch.int16)
            for r, i in zip(new, prompt_of):
                if self.want_routing[r]:
                    self.prefix_routing[r], self.first_step[r] = table[: lens[i], i], self.steps
        lengths = (starts_t + lens_t).repeat_interleave(counts_t)
        if self.cache is None:
            self.cache, self.lengths = cache, lengths
        else:
            self.cache.join(cache)
            self.lengths = torch.cat((self.lengths, lengths))
        self.host_lengths += [starts[i] + lens[i] for i in prompt_of]
        self.in_cache = self.in_cache + new
        self.last = last if self.last is None else torch.cat((self.last, last))
        self.active = self.active + new
        return new

    def step(self) -> list[int]:
        """One token for every decoding row, then one forward; returns the rows that finished (complete now)."""
        eng, dev = self.engine, self.engine.device
        if not self.active:
            return []
        ids = self._sample(self.last, self.active)
        going, forward, done = [], [], []
        for r, token in zip(self.active, ids):
            if not self._emit(r, token):
                going.append(r)
                forward.append(r)
            else:
                done.append(r)
                if self.want_routing[r]:
                    forward.append(r)  # once more, for the routing of its last token
        if done and eng.prefix_store is not None:
            self._store(done)
        hidden = None
        if forward:
            if forward != self.in_cache:  # finished rows leave the batch: the others move up, in place
                where = {r: i for i, r in enumerate(self.in_cache)}
                keep = torch.tensor([where[r] for r in forward], dtype=torch.long, device=dev)
                used = max(len(self.out[r].prompt_ids) + len(self.out[r].token_ids) for r in forward)
                self.cache.keep(keep, used)
                self.lengths = self.lengths.index_select(0, keep)
                self.host_lengths = [self.host_lengths[where[r]] for r in forward]
                self.in_cache = forward
            record = any(self.want_routing[r] for r in forward)
            if eng.between_steps is not None and eng.between_steps():
                self.cache = self._reencode(forward, self.cache.max_len, record)
                self.version = eng.weights_version
            new = torch.tensor([[self.out[r].token_ids[-1]] for r in forward], dtype=torch.long, device=dev)
            routing = [] if record else None
            hidden = eng.hidden(new, self.lengths.unsqueeze(1), self.cache, self.lengths, routing,
                                host_lengths=self.host_lengths)
            self.lengths = self.lengths + 1
            self.host_lengths = [n + 1 for n in self.host_lengths]
            if record:
                self.routing_steps[self.steps] = (torch.stack(routing, dim=1).to(torch.int16),
                                                  {r: i for i, r in enumerate(forward)}, False)
            self.steps += 1
        if going:
            if len(going) != len(forward):
                where = {r: i for i, r in enumerate(forward)}
                hidden = hidden[:, torch.tensor([where[r] for r in going], dtype=torch.long, device=dev)]
            self.last = eng.logits(hidden)[:, 0]
        else:  # nothing decodes: rows kept for a last routing forward are done with the cache too
            self.last = None
            self.cache, self.in_cache, self.lengths, self.host_lengths = None, [], None, []
        if len(going) != len(self.active):  # the sampling parameters follow the rows still decoding
            left = set(going)
            keep = torch.tensor([i for i, r in enumerate(self.active) if r in left], dtype=torch.long, device=dev)
            self.temperature, self.top_k, self.top_p, self.greedy = (
                t.index_select(0, keep) for t in (self.temperature, self.top_k, self.top_p, self.greedy))
        self.active = going
        self._finish(done)
        return done

    def _store(self, rows: list[int]):
        """Hand finished rows' caches to the engine's prefix store (those without routing, which fed all but their
        newest token)."""
        where = {r: i for i, r in enumerate(self.in_cache)}
        for r in rows:
            c, i = self.out[r], where.get(r)
            if i is None or self.want_routing[r] or self.host_lengths[i] != len(c.prompt_ids) + len(c.token_ids) - 1:
                continue
            n = self.host_lengths[i]
            self.engine.prefix_store.put(c.prompt_ids + c.token_ids[:-1], [kv[i, :n].clone() for kv in self.cache.kv],
                                         self.version)

    def take(self, rows: list[int]) -> list[Completion]:
        """The finished rows' completions, released by the batch."""
        for r in rows:
            del self.rows[r], self.generators[r], self.want_routing[r]
        return [self.out.pop(r) for r in rows]

    def run(self, prompts, rows: list[SamplingParams], seeds: list[int], counts: list[int]) -> list[Completion]:
        """A static batch: these rows only, until every one has finished."""
        ids = self.admit(prompts, rows, seeds, counts)
        while self.active:
            self.step()
        return self.take(ids)

    def _reencode(self, rows: list[int], max_len: int, record: bool) -> LatentCache:
        """A cache of `rows` (prompt and generated tokens but the newest, which the next step feeds) computed
        with the current weights: after an in-flight update no latent or recurrent state of the old weights stays
        in use. Right-padding is marked `valid` (a KDA state must not absorb it), and with routing recorded the
        rows' experts so far are replaced by the ones the current weights chose here, so that the routing of every
        position matches the cache the later tokens attend to."""
        eng = self.engine
        seqs = [self.out[r].prompt_ids + self.out[r].token_ids[:-1] for r in rows]
        lens = [len(s) for s in seqs]
        width = max(lens)
        cache = eng.new_cache(len(eng.layers), len(rows), max_len)
        tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long, device=eng.device)
        positions = torch.arange(width, device=eng.device).unsqueeze(0).expand(len(rows), -1).contiguous()
        valid = None
        if min(lens) != width:
            valid = positions < torch.tensor(lens, device=eng.device).unsqueeze(1)
        routing = [] if record else None
        eng.hidden(tokens, positions, cache, torch.zeros(len(rows), dtype=torch.long, device=eng.device), routing,
                   valid, host_lengths=[0] * len(rows))
        eng.prefill_tokens += sum(lens)
        if record:
            table = torch.stack(routing, dim=1).view(width, len(rows), len(routing), -1).to(torch.int16)
            for i, r in enumerate(rows):
                if self.want_routing[r]:  # from the next decode step on, routing_steps continue this prefix
                    self.prefix_routing[r], self.first_step[r] = table[: lens[i], i], self.steps
        return cache

    def _sample(self, logits: torch.Tensor, active: list[int]) -> list[tuple[int, float, float]]:
        """(token, raw logprob, sampled logprob) for each active row: drawn from the row's sampling
        distribution with its own generator; padded-vocabulary ids are never drawn."""
        logits = logits[:, : self.engine.vocab_size]
        params = [self.rows[r] for r in active]  # self.temperature etc. are in this order
        raw = torch.log_softmax(logits.double(), dim=-1)
        if any(p.temperature != 0 for p in params):
            q = row_sampling_probs(logits, self.temperature, self.top_k, self.top_p, self.greedy,
                                   truncated=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
                                   any_greedy=any(p.temperature == 0 for p in params))
            draws = [torch.argmax(raw[i]) if self.rows[r].temperature == 0 else
                     torch.multinomial(q[i], 1, generator=self.generators[r])[0] for i, r in enumerate(active)]
            ids = torch.stack(draws)
            sampled = torch.log(q.gather(-1, ids.unsqueeze(-1)).squeeze(-1))
        else:
            ids = logits.argmax(-1)
            sampled = torch.zeros(len(active), dtype=torch.float64, device=logits.device)
        chosen = raw.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        values = torch.stack((ids.double(), chosen, sampled)).tolist()  # one device-to-host transfer
        return [(int(t), lp, slp) for t, lp, slp in zip(*values)]

    def _emit(self, r: int, token) -> bool:
        """Append a sampled token to row r; True when the row is finished."""
        token, logprob, sampled = token
        c, params = self.out[r], self.rows[r]
        c.token_ids.append(token)
        c.logprobs.append(logprob)
        c.sampled_logprobs.append(sampled)
        c.versions.append(self.version)
        if self.on_token is not None:
            self.on_token(r, token, logprob)
        return _finished(c, params, self.engine.detokenize)

    def _finish(self, rows: list[int]):
        """Routing (prefix, then each forward's row) and text of rows that just finished."""
        eng = self.engine
        for r in rows:
            c = self.out[r]
            if self.want_routing[r]:
                parts = [self.prefix_routing.pop(r).cpu()]
                for s in range(self.first_step.pop(r), self.steps):
                    t, where, on_host = self.routing_steps[s]
                    if r in where:
                        if not on_host:  # one transfer per forward, shared by its rows
                            t = t.cpu()
                            self.routing_steps[s] = (t, where, True)
                        parts.append(t[where[r]].unsqueeze(0))
                c.routing = torch.cat(parts)
            if c.text is None and eng.detokenize is not None:
                c.text = eng.detokenize(c.token_ids)
        if rows and self.routing_steps:  # forget the forwards no unfinished row needs
            oldest = min(self.first_step.values(), default=self.steps)
            for s in [s for s in self.routing_steps if s < oldest]:
                del self.routing_steps[s]


def _finished(c: Completion, params: SamplingParams, detokenize) -> bool:
    """Whether the completion's newest token ends it (stop id, stop string, max_tokens); sets finish_reason
    and, at a stop string, the text cut before it."""
    if c.token_ids[-1] in params.stop_token_ids:
        c.finish_reason = "stop"
        return True
    if params.stop and detokenize is not None:
        text = detokenize(c.token_ids)
        hit = [text.index(s) for s in params.stop if s in text]
        if hit:
            c.text, c.finish_reason = text[: min(hit)], "stop"
            return True
    return len(c.token_ids) >= params.max_tokens


def row_sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       greedy: torch.Tensor, truncated: Optional[bool] = None,
                       any_greedy: Optional[bool] = None) -> torch.Tensor:
    """The distributions tokens are drawn from, one row per request [b, vocab] (float64): temperature, then
    top-k (ties with the k-th kept), then top-p (the smallest set of most likely tokens reaching p); one-hot on
    the argmax for greedy rows. temperature / top_k / top_p / greedy are per-row tensors [b]; `truncated` (any
    row with top-k or top-p) and `any_greedy`, when the caller knows them on the host, spare reading them from
    the device."""
    scores = logits.double() / temperature.unsqueeze(-1)
    vocab = scores.size(-1)
    if truncated is None:
        truncated = bool(((top_k > 0) | (top_p < 1.0)).any())
    if truncated:  # else no sort over the vocabulary
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = sorted_scores.gather(-1, (k - 1).unsqueeze(-1))
        sorted_scores = sorted_scores.masked_fill(sorted_scores < kth, -math.inf)
        p = torch.softmax(sorted_scores, -1)
        beyond = (p.cumsum(-1) - p >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
        scores = torch.full_like(scores, -math.inf).scatter(-1, order, sorted_scores.masked_fill(beyond, -math.inf))
    probs = torch.softmax(scores, dim=-1)
    if bool(greedy.any()) if any_greedy is None else any_greedy:
        probs = torch.where(greedy.unsqueeze(-1), F.one_hot(logits.argmax(-1), vocab).double(), probs)
    return probs


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from under `params`, over the last dim of `logits` [..., vocab]."""
    flat = logits.reshape(-1, logits.size(-1))
    b, dev = flat.size(0), logits.device

    def full(value, dtype):
        return torch.full((b,), value, dtype=dtype, device=dev)

    probs = row_sampling_probs(flat, full(params.temperature if params.temperature > 0 else 1.0, torch.float64),
                               full(params.top_k, torch.long), full(params.top_p, torch.float64),
                               full(params.temperature == 0, torch.bool))
    return probs.view(*logits.shape)


class ContinuousBatch:
    """Continuous batching on one engine: requests (each what one `generate_groups` call takes) join the running
    decode batch between steps, rows leave it as they finish, and a request is returned as soon as its own rows
    have all finished, without waiting for the others. Each request keeps its own seeds, so its samples are the
    ones it would draw alone. One thread at a time drives it (`add`, `step`); with TP/EP > 1 every rank makes the
    same calls in the same order.

    Weights: an update between steps goes through the engine's `between_steps` hook, which re-encodes every row
    in flight; an update while no row is in flight needs nothing. Any other change while rows decode is refused
    at the next `add`."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self._batch = _Batch(engine)
        self._requests: dict[int, tuple[list[int], list[int]]] = {}  # id -> (counts, its rows)
        self._left: dict[int, int] = {}  # id -> rows not finished
        self._owner: dict[int, int] = {}  # row -> request id
        self._next = 0

    @property
    def decoding(self) -> int:
        """Rows generating now."""
        return self._batch.decoding

    @property
    def requests(self) -> int:
        """Requests in flight."""
        return len(self._requests)

    @torch.inference_mode()
    def add(self, prompts: list[list[int]], n: int | list[int], params: SamplingParams | list[SamplingParams]) -> int:
        """Prefill a request and add its rows to the batch; returns its id. A bad request raises ValueError and
        leaves the batch as it was."""
        eng = self.engine
        counts, rows, seeds = group_rows(prompts, n, params)
        eng.check_request([prompts[i] for i in _prompt_of(counts)], rows)
        with eng.generating():
            ids = self._batch.admit(prompts, rows, eng.agreed_seeds(seeds), counts)
        rid, self._next = self._next, self._next + 1
        self._requests[rid] = (counts, ids)
        self._left[rid] = len(ids)
        self._owner.update((r, rid) for r in ids)
        return rid

    @torch.inference_mode()
    def step(self) -> dict[int, list[list[Completion]]]:
        """One decode step of every row in flight; returns the requests it completed: id -> result[prompt][sample]."""
        with self.engine.generating():
            done = self._batch.step()
        finished = []
        for r in done:
            rid = self._owner.pop(r)
            self._left[rid] -= 1
            if not self._left[rid]:
                finished.append(rid)
        out = {}
        for rid in finished:
            counts, ids = self._requests.pop(rid)
            del self._left[rid]
            out[rid] = split_groups(self._batch.take(ids), counts)
        return out
