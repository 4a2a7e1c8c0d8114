"""Kimi Delta Attention (KDA, arXiv 2510.26692): a gated delta rule with a per-channel forget gate.

Per head, with L2-normalised q_t, k_t (after short causal convolutions with SiLU), a per-channel decay
alpha_t = exp(g_t), g_t = -exp(A_log) * softplus(f(x_t) + dt_bias) (f low rank) and beta_t = sigmoid(b(x_t)):

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,     o_t = S_t^T q_t / sqrt(d_k)

followed by a sigmoid-gated RMSNorm per head and the output projection.

Two exact forms of the same recurrence (`chunk_kda` for training and prefill, `recurrent_kda` for decoding):
the chunked form handles C tokens at a time. Within a chunk, with G_t the cumulative log decay since the chunk
start and S_0 the incoming state, the state corrections delta_t = beta_t (v_t - k_t^T (decayed S_{t-1})) solve a
unit lower-triangular system (the UT transform of the WY representation):

    (I + A) delta = diag(beta) V - diag(beta) (e^G * K) S_0,   A_ti = beta_t sum_c k_tc k_ic e^(G_tc - G_ic), i < t

so delta = U - W S_0 with U, W shared by every chunk position; the output and the next state are then dense
matmuls: o = (e^G * Q) S_0 + P delta with P_ti = sum_c q_tc k_ic e^(G_tc - G_ic) (i <= t), and
S_C = e^(G_C) * S_0 + (e^(G_C - G) * K)^T delta. Every exponent is of a non-positive number (G only decreases),
so nothing overflows however fast a channel forgets. Only the state pass is sequential: one small matmul chain
per chunk instead of one per token.

On a GPU with flash-linear-attention (`fla-core`, extra ``[kda]``) installed the Triton kernels `chunk_kda` /
`fused_recurrent_kda` replace ours (tests/gpu checks them against these).

Tensor parallelism splits the heads: q/k/v, the forget gate's up projection, beta and the output gate's up
projection are column parallel, the output projection row parallel; the low-rank down projections are replicated
(as MLA's are). Packed sequences (THD): the convolution and the state restart at every document. Context
parallelism gathers the recurrence's inputs over the CP group and runs the whole sequence on every CP rank
(correct, not yet cheaper: passing the state from rank to rank would be).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core import parallel_state

from megatron_ext.models import context_parallel

L2_EPS = 1e-6  # as flash-linear-attention's l2norm: x / sqrt(sum x^2 + eps)


# ---------------------------------------------------------------------------------------------------------
# the gated delta rule, [batch, time, heads, dim] in, fp32 inside
# ---------------------------------------------------------------------------------------------------------


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def recurrent_kda(q, k, v, g, beta, initial_state=None, scale: Optional[float] = None):
    """Token by token: (o [b, t, n, dv], final state [b, n, dk, dv] fp32). q, k are already L2-normalised,
    g is the log decay per channel [b, t, n, dk], beta [b, t, n]."""
    dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    b, t, n, dk = k.shape
    scale = dk ** -0.5 if scale is None else scale
    state = (torch.zeros(b, n, dk, v.size(-1), dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float().clone())
    out = []
    for i in range(t):
        state = state * g[:, i].exp().unsqueeze(-1)
        delta = beta[:, i].unsqueeze(-1) * (v[:, i] - torch.einsum("bnk,bnkv->bnv", k[:, i], state))
        state = state + k[:, i].unsqueeze(-1) * delta.unsqueeze(-2)
        out.append(torch.einsum("bnk,bnkv->bnv", q[:, i] * scale, state))
    return torch.stack(out, dim=1).to(dtype), state


def chunk_kda(q, k, v, g, beta, initial_state=None, scale: Optional[float] = None, chunk_size: int = 64):
    """The chunked (UT-transform) form, equal to `recurrent_kda` up to rounding; see the module docstring."""
    dtype = q.dtype
    b, t, n, dk = k.shape
    dv = v.size(-1)
    scale = dk ** -0.5 if scale is None else scale
    C = chunk_size
    pad = (-t) % C
    # [b, t, n, d] -> [b, n, chunks, C, d]; padding has beta = 0 and g = 0: it leaves the state alone
    def chunks(x):
        x = x.float().transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(b, n, -1, C, *x.shape[3:])

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    G = g.cumsum(dim=-2)  # [b, n, m, C, dk]
    kk = decayed_products(k, k, G)
    qk = decayed_products(q, k, G)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = (beta.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
    rhs = torch.cat((beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * G.exp() * k), dim=-1)
    UW = unit_lower_inverse(A) @ rhs
    U, W = UW[..., :dv], UW[..., dv:]
    G_end = G[..., -1:, :]
    k_to_end = ((G_end - G).exp() * k).transpose(-1, -2)  # [b, n, m, dk, C]
    end_decay = G_end.transpose(-1, -2).exp()  # [b, n, m, dk, 1]
    reads = torch.cat((W, G.exp() * q), dim=-2)  # rows that read the incoming state: W then decayed q
    state = (torch.zeros(b, n, dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.float())
    out = []
    for c in range(G.size(2)):
        read = reads[:, :, c] @ state  # [b, n, 2C, dv]
        delta = U[:, :, c] - read[..., :C, :]
        out.append(read[..., C:, :] + qk[:, :, c] @ delta)
        state = end_decay[:, :, c] * state + k_to_end[:, :, c] @ delta
    o = torch.stack(out, dim=2).reshape(b, n, -1, dv)[:, :, :t].transpose(1, 2)
    return o.to(dtype), state


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [.., C, C]: A is nilpotent, so the inverse is the finite series
    sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)..., log2(C) squarings of batched matmuls (a batched triangular solve
    is an order of magnitude slower on a CPU)."""
    power = -A
    inverse = torch.eye(A.size(-1), dtype=A.dtype, device=A.device) + power
    for _ in range(max(0, math.ceil(math.log2(A.size(-1))) - 1)):
        power = power @ power
        inverse = inverse + inverse @ power
    return inverse


def decayed_products(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, block: int = 16) -> torch.Tensor:
    """P_ti = sum_c a_tc b_ic e^(G_tc - G_ic) for i <= t, zero above: [.., C, d] -> [.., C, C].

    Computed in blocks of `block` positions so that every exponent is of a non-positive number without a
    [C, C, d] tensor of pairwise decays: inside a diagonal block pairwise ([block, block, d]); for t in block x
    after i in block y, with r the last position of block y, e^(G_t - G_i) = e^(G_t - G_r) e^(G_r - G_i), both
    factors <= 1, and the block is one matmul."""
    C, d = G.shape[-2:]
    if C % block:
        block = C
    nb = C // block
    shape = G.shape[:-2]
    a, b, G = (x.reshape(*shape, nb, block, d) for x in (a, b, G))
    within = torch.ones(block, block, dtype=torch.bool, device=G.device).tril()
    pair = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~within[..., None], -math.inf).exp()
    diag = torch.einsum("...tc,...ic,...tic->...ti", a, b, pair)  # [.., nb, block, block]
    ref = G[..., -1, :]  # [.., nb(y), d]: the last position of each block
    # e^(G_t - G_r(y)) = e^(G_t - G_r(x-1)) e^(G_r(x-1) - G_r(y)): a per-token factor and a per-block-pair one,
    # both <= 1 for y < x (pairs x <= y are discarded; their exponents are clamped to stay finite)
    prev = torch.cat((torch.zeros_like(ref[..., :1, :]), ref[..., :-1, :]), dim=-2)  # G_r(x-1); 0 before block 0
    a_local = a * (G - prev.unsqueeze(-2)).clamp(max=0).exp()  # [.., nb(x), block, d]
    pair_decay = (prev.unsqueeze(-2) - ref.unsqueeze(-3)).clamp(max=0).exp()  # [.., nb(x), nb(y), d]
    a_scaled = a_local.unsqueeze(-3) * pair_decay.unsqueeze(-2)  # [.., nb(x), nb(y), block, d]
    b_scaled = b * (ref.unsqueeze(-2) - G).exp()  # [.., nb(y), block, d]
    off = a_scaled @ b_scaled.unsqueeze(-4).transpose(-1, -2)  # [.., x, y, block, block]
    lower = torch.ones(nb, nb, dtype=torch.bool, device=G.device).tril(-1)
    off = off * lower[..., None, None]
    idx = torch.arange(nb, device=G.device)
    off[..., idx, idx, :, :] = diag
    return off.transpose(-3, -2).reshape(*shape, C, C)


def _fla():
    """flash-linear-attention's KDA kernels when usable (CUDA + fla-core installed), else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.kda import chunk_kda as fla_chunk, fused_recurrent_kda as fla_recurrent
    except ImportError:
        return None
    return fla_chunk, fla_recurrent


def delta_rule(q, k, v, g, beta, initial_state=None, cu_seqlens: Optional[torch.Tensor] = None,
               recurrent: bool = False, use_fla: bool = True):
    """The gated delta rule over [b, t, n, d] inputs, documents given by `cu_seqlens` (b = 1) each starting
    from a zero state; (output, final state of the last row/document)."""
    kernels = _fla() if (use_fla and q.is_cuda) else None
    if kernels is not None:
        fn = kernels[1] if recurrent else kernels[0]
        return fn(q, k, v, g, beta, scale=k.size(-1) ** -0.5, initial_state=initial_state,
                  output_final_state=True, cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
    fn = recurrent_kda if recurrent else chunk_kda
    if cu_seqlens is None:
        return fn(q, k, v, g, beta, initial_state)
    bounds = cu_seqlens.tolist()
    outs, state = [], None
    for a, z in zip(bounds[:-1], bounds[1:]):
        if z > a:
            o, state = fn(q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], beta[:, a:z], None)
            outs.append(o)
    if bounds[-1] < q.size(1):  # padding after the last document
        outs.append(torch.zeros_like(v[:, bounds[-1]:]))
    return torch.cat(outs, dim=1), state


def short_conv(x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None,
               doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal depthwise convolution + SiLU over x [b, t, c] with weight [c, 1, K]; `tail` [b, K - 1, c] are
    the inputs before x (decoding), `doc_ids` [t] stop the window at document starts (packed sequences)."""
    K = weight.size(-1)
    t = x.size(1)
    if tail is None:
        tail = x.new_zeros(x.size(0), K - 1, x.size(2))
    full = torch.cat((tail.to(x.dtype), x), dim=1)
    y = 0
    for j in range(K):  # tap j looks j tokens back
        shifted = full[:, K - 1 - j: K - 1 - j + t]
        if doc_ids is not None and j:
            same = torch.zeros_like(doc_ids, dtype=torch.bool)
            same[j:] = doc_ids[j:] == doc_ids[:-j]
            shifted = shifted * same.view(1, t, 1).to(x.dtype)
        y = y + shifted * weight[:, 0, K - 1 - j].to(x.dtype)
    return F.silu(y)


# ---------------------------------------------------------------------------------------------------------
# the Megatron module
# ---------------------------------------------------------------------------------------------------------


@dataclass
class KDASubmodules:
    column_parallel_linear: type = None  # q/k/v, f_b, g_b, b
    replicated_linear: type = None  # the low-rank down projections f_a, g_a
    row_parallel_linear: type = None  # output projection


@dataclass(frozen=True)
class KDAShape:
    num_heads: int
    head_dim: int
    conv_kernel: int = 4


class KimiDeltaAttention(MegatronModule):
    """A `self_attention` module for Megatron-Core's TransformerLayer: takes [s, b, h] (sequence-parallel
    shards under SP, [t, 1, h] for packed sequences) and returns (output, bias=None) like SelfAttention.

    Parameter names and shapes follow the Hugging Face `kimi_linear` checkpoint (conv weights [c, 1, K],
    A_log [1, 1, heads, 1]) so conversion only renames; heads are split over tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig, submodules: KDASubmodules, layer_number: int,
                 shape: KDAShape, attn_mask_type=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.shape = shape
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        tp = config.tensor_model_parallel_size
        if shape.num_heads % tp:
            raise ValueError(f"--kda-num-heads {shape.num_heads} is not divisible by --tensor-model-parallel-size "
                             f"{tp}")
        self.heads = shape.num_heads // tp
        d, h = shape.head_dim, config.hidden_size
        width = shape.num_heads * d

        def column(name, inp, out):
            return build_module(submodules.column_parallel_linear, inp, out, config=config,
                                init_method=config.init_method, gather_output=False, bias=False,
                                skip_bias_add=True, is_expert=False, tp_comm_buffer_name=name)

        self.q_proj, self.k_proj, self.v_proj = (column(n, h, width) for n in ("q_proj", "k_proj", "v_proj"))
        # replicated on every TP rank; the TP group makes rank 0's copy the checkpoint's main replica
        self.f_a_proj = build_module(submodules.replicated_linear, h, d, config=config,
                                     init_method=config.init_method, bias=False, skip_bias_add=True,
                                     tp_group=self.tp_group)
        self.f_b_proj = column("f_b_proj", d, width)
        self.g_a_proj = build_module(submodules.replicated_linear, h, d, config=config,
                                     init_method=config.init_method, bias=False, skip_bias_add=True,
                                     tp_group=self.tp_group)
        self.g_b_proj = column("g_b_proj", d, width)
        self.b_proj = column("b_proj", h, shape.num_heads)
        self.o_proj = build_module(submodules.row_parallel_linear, width, h, config=config,
                                   init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                   skip_bias_add=True, is_expert=False, tp_comm_buffer_name="o_proj")

        # Per-head parameters: initialised at full size from the default generator, then this rank's heads
        # kept, so any TP layout starts from the same model.
        rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
        local = slice(rank * self.heads * d, (rank + 1) * self.heads * d)
        dtype = config.params_dtype
        # on the GPU unless Megatron is told to initialise on the CPU; else wherever tensors are made (meta too)
        device = torch.cuda.current_device() if (torch.cuda.is_available() and not config.use_cpu_initialization) \
            else None
        bound = 1 / math.sqrt(shape.conv_kernel)  # nn.Conv1d's default for a depthwise kernel
        self.q_conv1d = self._param(torch.empty(width, 1, shape.conv_kernel).uniform_(-bound, bound)[local], 0)
        self.k_conv1d = self._param(torch.empty(width, 1, shape.conv_kernel).uniform_(-bound, bound)[local], 0)
        self.v_conv1d = self._param(torch.empty(width, 1, shape.conv_kernel).uniform_(-bound, bound)[local], 0)
        a_log = torch.empty(shape.num_heads).uniform_(1.0, 16.0).log()
        self.A_log = self._param(a_log[rank * self.heads:(rank + 1) * self.heads].view(1, 1, -1, 1), 2)
        dt = torch.exp(torch.empty(width).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias = self._param((dt + torch.log(-torch.expm1(-dt)))[local], 0)  # softplus^-1(dt)
        self.o_norm_weight = torch.nn.Parameter(torch.ones(d, dtype=dtype))
        # each TP rank normalises its own heads: the weight's gradient is summed over TP with the SP norms
        setattr(self.o_norm_weight, "sequence_parallel", config.sequence_parallel)
        for p in (self.q_conv1d, self.k_conv1d, self.v_conv1d, self.A_log, self.dt_bias, self.o_norm_weight):
            p.data = p.data.to(dtype=dtype) if device is None else p.data.to(device=device, dtype=dtype)
        self.eps = config.layernorm_epsilon
        self.use_fla = True

    _TP_AXES = {"q_conv1d": 0, "k_conv1d": 0, "v_conv1d": 0, "A_log": 2, "dt_bias": 0}

    def _param(self, value: torch.Tensor, axis: int) -> torch.nn.Parameter:
        p = torch.nn.Parameter(value.contiguous())
        set_tensor_model_parallel_attributes(p, True, axis, 1)
        return p

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's default (submodules; own parameters replicated), with the per-head parameters sharded
        over TP along their head axis."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {name: p for name, p in self._parameters.items() if name in self._TP_AXES}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, self._TP_AXES, sharded_offsets,
                                                       tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        return out

    # ---- pieces shared by training and decoding --------------------------------------------------------

    def gates(self, f_low: torch.Tensor, b_logits: torch.Tensor):
        """(g, beta) from the forget gate's low-rank features [.., d] -> up-projected [.., heads * d]."""
        d = self.shape.head_dim
        f = f_low.float() + self.dt_bias.float()
        f = f.view(*f.shape[:-1], self.heads, d)
        g = -self.A_log.float().view(self.heads, 1).exp() * F.softplus(f)
        return g, torch.sigmoid(b_logits.float())

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm per head in fp32, times sigmoid(gate), flattened back to [.., heads * d]."""
        o32 = o.float()
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm_weight.float()
        o32 = o32 * torch.sigmoid(gate.view_as(o).float())
        return o32.to(o.dtype).flatten(-2)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, inference_context=None,
                packed_seq_params=None, **unused):
        if inference_context is not None:
            raise NotImplementedError("Megatron-Core's inference context is not supported by KDA layers; "
                                      "generate with megatron_ext.inference (its cache holds the KDA state)")
        d, n = self.shape.head_dim, self.heads
        q, _ = self.q_proj(hidden_states)  # [s, b, n * d] (full sequence under SP)
        k, _ = self.k_proj(hidden_states)
        v, _ = self.v_proj(hidden_states)
        f, _ = self.f_b_proj(self.f_a_proj(hidden_states)[0])
        gate, _ = self.g_b_proj(self.g_a_proj(hidden_states)[0])
        b_logits, _ = self.b_proj(hidden_states)
        s_local, b = q.shape[:2]
        cp = self.config.context_parallel_size
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        bounds = context_parallel.document_bounds(s_local * cp, packed_seq_params)
        if cp > 1:
            # Context parallelism: the recurrence needs every earlier token. This rank's chunks of the inputs of
            # the convolution and gates are all-gathered (backward: reduce-scatter), the whole sequence is run
            # here (as on every CP rank) and this rank's positions kept.
            width = [q.size(-1), k.size(-1), v.size(-1), f.size(-1), b_logits.size(-1)]
            full = context_parallel.gather_sequence(torch.cat((q, k, v, f, b_logits), dim=-1), bounds)
            q, k, v, f, b_logits = full.split(width, dim=-1)
        s = q.size(0)
        cu, doc_ids = None, None
        if packed:
            cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            doc_ids = torch.searchsorted(cu[1:].contiguous(), torch.arange(s, device=q.device), right=True)
        bt = lambda x: x.transpose(0, 1)  # noqa: E731  [s, b, ...] -> [b, s, ...]
        q = short_conv(bt(q), self.q_conv1d, doc_ids=doc_ids)
        k = short_conv(bt(k), self.k_conv1d, doc_ids=doc_ids)
        v = short_conv(bt(v), self.v_conv1d, doc_ids=doc_ids)
        heads = lambda x: x.reshape(b, s, n, d)  # noqa: E731
        g, beta = self.gates(bt(f), bt(b_logits))
        q, k = l2norm(heads(q).float()), l2norm(heads(k).float())
        o, _ = delta_rule(q, k, heads(v).float(), g, beta, cu_seqlens=cu, use_fla=self.use_fla)
        if cp > 1:
            o = o.index_select(1, context_parallel.local_index(bounds).to(o.device))
        o = self.gated_norm(o.to(hidden_states.dtype), bt(gate).reshape(b, s_local, n, d))
        out, bias = self.o_proj(o.transpose(0, 1).contiguous())
        return out, bias

    # ---- decoding with a constant-size state ------------------------------------------------------------

    def new_state(self, batch: int, device, dtype):
        """(convolution tails [batch, K - 1, 3 * heads * d] in `dtype`, recurrent state [batch, heads, d, d]
        fp32) of this rank's heads, zero (an empty prefix)."""
        d, K = self.shape.head_dim, self.shape.conv_kernel
        return (torch.zeros(batch, K - 1, 3 * self.heads * d, dtype=dtype, device=device),
                torch.zeros(batch, self.heads, d, d, dtype=torch.float32, device=device))

    @torch.no_grad()
    def step(self, h: torch.Tensor, state, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """New tokens h [s, b, hidden] (already normed) after the prefix summarised by `state` (updated in
        place); returns this rank's partial output projection [s, b, hidden] (to be summed over TP).
        `valid` [b, s] marks real tokens of right-padded rows: padding leaves the state and tail untouched.
        Uses the weights directly (no sequence-parallel wrappers)."""
        tails, S = state
        d, n, K = self.shape.head_dim, self.heads, self.shape.conv_kernel
        s, b, _ = h.shape
        x = h.transpose(0, 1)  # [b, s, hidden]
        lin = lambda m, y: F.linear(y, m.weight)  # noqa: E731
        qkv = torch.cat((lin(self.q_proj, x), lin(self.k_proj, x), lin(self.v_proj, x)), dim=-1)
        weight = torch.cat((self.q_conv1d, self.k_conv1d, self.v_conv1d), dim=0)
        conv = short_conv(qkv, weight, tail=tails)
        q, k, v = (t.reshape(b, s, n, d) for t in conv.split(n * d, dim=-1))
        g, beta = self.gates(lin(self.f_b_proj, lin(self.f_a_proj, x)), lin(self.b_proj, x))
        if valid is not None:
            g = g * valid[..., None, None]
            beta = beta * valid[..., None]
        q, k = l2norm(q.float()), l2norm(k.float())
        o, S_new = delta_rule(q, k, v.float(), g, beta, initial_state=S, recurrent=s == 1, use_fla=self.use_fla)
        S.copy_(S_new)
        history = torch.cat((tails, qkv.to(tails.dtype)), dim=1)  # [b, K - 1 + s, c]
        if valid is None:
            tails.copy_(history[:, -(K - 1):])
        else:
            ends = (K - 1) + valid.sum(1).long()  # one past each row's last real token in `history`
            index = ends.view(b, 1) - torch.arange(K - 1, 0, -1, device=h.device).view(1, -1)
            tails.copy_(history.gather(1, index.unsqueeze(-1).expand(-1, -1, history.size(-1))))
        gate = lin(self.g_b_proj, lin(self.g_a_proj, x)).reshape(b, s, n, d)
        o = self.gated_norm(o.to(h.dtype), gate)
        return F.linear(o, self.o_proj.weight).transpose(0, 1)


def kda_spec(backend, shape: KDAShape) -> ModuleSpec:
    """The self-attention spec of a KDA layer for a backend (Megatron-Core's LocalSpecProvider interface)."""
    return ModuleSpec(module=KimiDeltaAttention, params={"shape": shape},
                      submodules=KDASubmodules(column_parallel_linear=backend.column_parallel_linear(),
                                               replicated_linear=backend.duplicated_linear(),
                                               row_parallel_linear=backend.row_parallel_linear()))


# ---------------------------------------------------------------------------------------------------------
# the hybrid stack: which layers are KDA, MLA without positions
# ---------------------------------------------------------------------------------------------------------


class NoPositionMLA:
    """Mixin for an MLA class: no positional encoding, as Kimi Linear's MLA layers (the KDA layers carry
    position). The rotary frequencies are zero, so the "rope" dims pass through unrotated; Megatron-Core's MLA
    de-interleaves those dims of q and k alike, which leaves every score q.k unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.rope_type != "rope":
            raise ValueError("--mla-nope needs --position-embedding-type rope (its frequencies are switched off)")
        rotary = self.rotary_pos_emb
        rotary.inv_freq = torch.zeros_like(rotary.inv_freq)


_NOPE_CLASSES: dict[type, type] = {}


def no_position(cls: type) -> type:
    """`cls` (an MLA self-attention class) without positional encoding; one subclass per class."""
    if cls not in _NOPE_CLASSES:
        _NOPE_CLASSES[cls] = type(f"NoPosition{cls.__name__}", (NoPositionMLA, cls), {})
    return _NOPE_CLASSES[cls]


@dataclass(frozen=True)
class HybridSpec:
    """Which decoder layers are KDA ('K') and which MLA ('M'), the KDA head shape, and whether MLA drops
    positional encoding."""

    pattern: str
    shape: KDAShape
    mla_nope: bool = False

    @classmethod
    def from_arch(cls, arch) -> Optional["HybridSpec"]:
        if not arch.hybrid_layer_pattern and not arch.mla_nope:
            return None
        pattern = arch.hybrid_layer_pattern or "M" * arch.num_layers
        return cls(pattern, KDAShape(arch.kda_num_heads, arch.kda_head_dim, arch.kda_conv_kernel), arch.mla_nope)


def hybrid_layer_spec(spec: ModuleSpec, kind: str, hybrid: HybridSpec, backend) -> ModuleSpec:
    """A copy of MLA layer `spec` with its attention made KDA (kind 'K') or position-free MLA."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp

    sub = spec.submodules
    if kind == "K":
        norm = sub.input_layernorm
        if norm is IdentityOp:  # a backend that fuses the input norm into the attention's first linear
            norm = backend.layer_norm(rms_norm=True)
        sub = dataclasses.replace(sub, input_layernorm=norm, self_attention=kda_spec(backend, hybrid.shape))
    elif hybrid.mla_nope:
        attn = sub.self_attention
        sub = dataclasses.replace(sub, self_attention=dataclasses.replace(attn, module=no_position(attn.module)))
    return dataclasses.replace(spec, submodules=sub)
