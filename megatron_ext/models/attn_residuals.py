"""Attention Residuals (arXiv 2603.15031): each sublayer reads a softmax mixture of earlier outputs over depth.

A pre-norm transformer feeds sublayer l (attention and MLP count as separate sublayers) the running sum
``h_l = v_0 + v_1 + ... + v_{l-1}`` of the embedding v_0 and the earlier sublayer outputs. Attention Residuals
replace the sum by ``h_l = sum_i alpha_{i->l} v_i`` with ``alpha_{.->l} = softmax_i(w_l . RMSNorm(v_i))``: one
learned pseudo-query ``w_l`` per sublayer (and one for the final norm), initialised to zero. The key norm has no
gain of its own (a gain g would only rescale the query, g * k . w = k . (g * w)).

``block`` mode (Block AttnRes) keeps plain residual sums inside blocks of ``block_size`` consecutive sublayers and
attends over the embedding, the sums of the completed blocks and the current block's partial sum (when the block
has begun): O(blocks) sources instead of O(layers).

With zero queries every weight is 1/n over the n sources present, so in both modes ``h_l`` is the standard residual
stream divided by its number of sources: ``h_l = (v_0 + ... + v_{l-1}) / n_l``. Every consumer of h_l is an
RMSNorm (the sublayers' pre-norms and the final norm), which is scale-invariant up to its epsilon, so a model
with zero queries computes exactly what the same weights compute as a standard pre-norm transformer when the norm
epsilon is 0 (with epsilon e, the norm sees an effective epsilon n_l^2 e). tests/unit/test_attn_residuals.py
checks both statements.

How it sits on Megatron-Core (docs/design-notes.md): nothing of GPTModel, TransformerBlock or TransformerLayer is
overridden. The layer spec swaps each layer's two bias-dropout-add functions for bias-dropout without the add, so
a layer's attention and MLP return their own outputs v; forward pre-hooks on the modules that consume h_l (each
layer's ``input_layernorm`` and ``pre_mlp_layernorm``, and the block's ``final_layernorm``; identity modules
under Transformer Engine's fused norms, which are hooked just the same) record the incoming output as a source and
replace it by the mixture. The per-forward sources live on the decoder only during its forward. Pseudo-queries are
1-D parameters (``decoder.layers.N.attn_res.{attention,mlp}_query``, ``decoder.final_attn_res.query``): no weight
decay, replicated over tensor-parallel ranks and marked ``sequence_parallel`` so that `finalize_model_grads`
sums their per-sequence-shard gradients over TP, as it does for norm weights. Everything is per token, so
sequence and context parallelism need no communication. Pipeline parallelism is refused (the sources would have to
cross stage boundaries), as are recomputation modes that re-run the hooked norms.

Serving: the inference engine keeps the KV cache as usual; the sources of a decode step are the new tokens' own
sublayer outputs (depth, not time), built fresh each step by `DepthSources` and dropped after it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

MODES = ("full", "block")
DEFAULT_BLOCKS = 8  # the paper: about 8 blocks recover most of full AttnRes's gain


def resolve_block_size(mode: Optional[str], block_size: int, num_layers: int) -> Optional[int]:
    """Sublayers per block: None in full mode; in block mode the flag's value, or (0) about 8 blocks."""
    if mode != "block":
        return None
    return block_size or max(1, math.ceil(2 * num_layers / DEFAULT_BLOCKS))


def validate_args(args, fail: Callable[[str], None]):
    """Flag combinations (`arguments.validate_args`); `fail(msg)` raises."""
    arch = args.arch
    mode, size = arch.attention_residuals, arch.attn_res_block_size
    if mode is None:
        if size:
            fail(f"--attn-res-block-size {size} needs --attention-residuals block")
        return
    if mode not in MODES:
        fail(f"--attention-residuals {mode!r}: choose full, block or none")
    if size < 0:
        fail(f"--attn-res-block-size must be >= 0 (0: about {DEFAULT_BLOCKS} blocks), got {size}")
    if size and mode != "block":
        fail(f"--attn-res-block-size {size} applies to --attention-residuals block, not {mode}")
    if args.pipeline_model_parallel_size > 1:
        fail(f"--attention-residuals {mode} does not support --pipeline-model-parallel-size "
             f"{args.pipeline_model_parallel_size}: every layer reads the outputs of all earlier layers, which would "
             "have to cross pipeline stages; use --pipeline-model-parallel-size 1 (tensor, sequence, context, "
             "expert and data parallelism are supported)")
    if getattr(args, "recompute_granularity", None) == "full":
        fail(f"--attention-residuals {mode} does not support --recompute-granularity full (recomputed layers would "
             "record their outputs twice); use --recompute-granularity selective")
    if "layernorm" in (getattr(args, "recompute_modules", None) or ()):
        fail(f"--attention-residuals {mode} does not support --recompute-modules layernorm (the norms read the "
             "depth mixture); drop layernorm from --recompute-modules")


# --------------------------------------------------------------------------------------------------------
# the mixture
# --------------------------------------------------------------------------------------------------------


def _inv_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS(v) over the hidden dim, in fp32 at least (vector_norm reads v without keeping an fp32 copy)."""
    norm = torch.linalg.vector_norm(v, dim=-1, dtype=torch.promote_types(v.dtype, torch.float32))
    return torch.rsqrt(norm.square() / v.size(-1) + eps)


class DepthSources:
    """The sources of one forward pass (or one decode step): the embedding, then sublayer outputs via `add`.

    Full mode keeps every output; block mode (``block_size`` sublayers per block) keeps the embedding, each
    completed block's sum and the current block's partial sum. `mix(query)` is the softmax-weighted sum over them.
    """

    def __init__(self, embedding: torch.Tensor, block_size: Optional[int], eps: float):
        self.block_size, self.eps = block_size, eps
        self.done = [(embedding, _inv_rms(embedding, eps))]  # (source, 1/RMS(source))
        self.partial, self.in_block = None, 0

    def add(self, output: torch.Tensor):
        if self.block_size is None:
            self.done.append((output, _inv_rms(output, self.eps)))
            return
        self.partial = output if self.partial is None else self.partial + output
        self.in_block += 1
        if self.in_block == self.block_size:
            self.done.append((self.partial, _inv_rms(self.partial, self.eps)))
            self.partial, self.in_block = None, 0

    def sources(self) -> list[torch.Tensor]:
        return [v for v, _ in self.done] + ([self.partial] if self.partial is not None else [])

    def mix(self, query: torch.Tensor) -> torch.Tensor:
        """sum_i softmax_i(query . RMSNorm(v_i)) v_i, in the sources' dtype (scores and softmax in fp32). A single
        source (the first layer's attention) comes back unchanged, its query with an exactly zero gradient (kept
        so that every parameter gets a gradient, as Megatron-Core's overlapped gradient reduction expects)."""
        pairs = list(self.done)
        if self.partial is not None:
            pairs.append((self.partial, _inv_rms(self.partial, self.eps)))
        q = query.to(pairs[0][0].dtype)
        scores = torch.stack([(v @ q).to(inv.dtype) * inv for v, inv in pairs])  # [n, s, b]
        weights = torch.softmax(scores, dim=0).to(pairs[0][0].dtype).unsqueeze(-1)
        out = weights[0] * pairs[0][0]
        for w, (v, _) in zip(weights[1:], pairs[1:]):
            out = torch.addcmul(out, w, v)
        return out


# --------------------------------------------------------------------------------------------------------
# parameters, spec and hooks
# --------------------------------------------------------------------------------------------------------


class PseudoQueries(torch.nn.Module):
    """Zero-initialised pseudo-queries, one 1-D parameter per name. Read them by calling the module
    (``queries("mlp_query")``): Megatron-Core's DDP waits for a parameter's all-gather (--overlap-param-gather) in
    a forward pre-hook of the module that owns it."""

    def __init__(self, names: tuple[str, ...], hidden_size: int, dtype, device, sequence_parallel: bool):
        super().__init__()
        for name in names:
            p = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            setattr(p, "sequence_parallel", sequence_parallel)  # TP ranks see different sequence shards
            self.register_parameter(name, p)

    def forward(self, name: str) -> torch.nn.Parameter:
        return getattr(self, name)


def _bias_dropout(x_with_bias, residual, prob: float, training: bool) -> torch.Tensor:
    x, bias = x_with_bias
    if bias is not None:
        x = x + bias
    return F.dropout(x, p=prob, training=training)


def get_bias_dropout(training: bool, fused: bool):
    """`get_bias_dropout_add` without the add: the sublayer's own output v, which AttnRes mixes over depth."""
    return lambda x_with_bias, residual, prob: _bias_dropout(x_with_bias, residual, prob, training)


def layer_specs(block_spec):
    """The decoder's TransformerBlockSubmodules with bias-dropout in place of bias-dropout-add (new spec objects)."""
    specs = []
    for spec in block_spec.layer_specs:
        sub = dataclasses.replace(spec.submodules, self_attn_bda=get_bias_dropout, mlp_bda=get_bias_dropout)
        specs.append(dataclasses.replace(spec, submodules=sub))
    return dataclasses.replace(block_spec, layer_specs=specs)


def install(decoder: torch.nn.Module, mode: str, block_size: int = 0):
    """Give `decoder` (a TransformerBlock built from `layer_specs`) its pseudo-queries and the mixing hooks."""
    config = decoder.config
    if mode not in MODES:
        raise ValueError(f"attention residuals mode must be one of {MODES}, got {mode!r}")
    if not (decoder.pre_process and decoder.final_layernorm is not None):
        raise ValueError("Attention Residuals need the whole decoder on one pipeline stage "
                         "(--pipeline-model-parallel-size 1)")
    if config.recompute_granularity == "full" or "layernorm" in (config.recompute_modules or ()):
        raise ValueError("Attention Residuals do not support full recomputation or recomputed layernorms")
    ref = decoder.final_layernorm.weight if hasattr(decoder.final_layernorm, "weight") else \
        next(decoder.parameters())
    make = lambda names: PseudoQueries(names, config.hidden_size, config.params_dtype, ref.device,
                                       config.sequence_parallel)
    decoder.attn_res_block_size = resolve_block_size(mode, block_size, config.num_layers)
    decoder.attn_res_eps = config.layernorm_epsilon
    decoder._attn_res_sources = None
    for index, layer in enumerate(decoder.layers):
        layer.attn_res = make(("attention_query", "mlp_query"))
        layer.input_layernorm.register_forward_pre_hook(_mixing_hook(decoder, layer.attn_res, "attention_query",
                                                                     first=index == 0))
        layer.pre_mlp_layernorm.register_forward_pre_hook(_mixing_hook(decoder, layer.attn_res, "mlp_query"))
    decoder.final_attn_res = make(("query",))
    decoder.final_layernorm.register_forward_pre_hook(_mixing_hook(decoder, decoder.final_attn_res, "query"))
    decoder.register_forward_pre_hook(_start)
    decoder.register_forward_hook(_stop, always_call=True)


_PENDING = object()  # the decoder's forward has begun; the first layer's input (the embedding) starts the sources


def _start(decoder, args):
    decoder._attn_res_sources = _PENDING


def _stop(decoder, args, output):
    decoder._attn_res_sources = None


def _mixing_hook(decoder, queries: PseudoQueries, name: str, first: bool = False):
    def hook(module, args):
        sources = decoder._attn_res_sources
        if sources is None:  # the module called outside the decoder's forward (e.g. by the inference engine)
            return None
        x, rest = args[0], args[1:]
        if first:
            if sources is not _PENDING:
                raise RuntimeError("Attention Residuals: the first layer ran twice in one decoder forward "
                                   "(activation recomputation of whole layers is not supported)")
            sources = decoder._attn_res_sources = DepthSources(x, decoder.attn_res_block_size, decoder.attn_res_eps)
        else:  # the previous sublayer's output
            sources.add(x)
        return (sources.mix(queries(name)),) + rest

    return hook


def is_installed(decoder: torch.nn.Module) -> bool:
    return hasattr(decoder, "final_attn_res")


# --------------------------------------------------------------------------------------------------------
# the inference engine's decode loop (it calls the layers' weights, not their modules)
# --------------------------------------------------------------------------------------------------------


def run_layers(decoder, x: torch.Tensor, sublayers: list[tuple[Callable, Callable]]) -> torch.Tensor:
    """The input of the final norm for new tokens `x` (their embedding), given each layer's (attention, MLP) as
    functions of their input: the sources are those tokens' own sublayer outputs, kept for this step only."""
    sources = DepthSources(x, decoder.attn_res_block_size, decoder.attn_res_eps)
    for layer, (attention, mlp) in zip(decoder.layers, sublayers):
        sources.add(attention(sources.mix(layer.attn_res("attention_query"))))
        sources.add(mlp(sources.mix(layer.attn_res("mlp_query"))))
    return sources.mix(decoder.final_attn_res("query"))
