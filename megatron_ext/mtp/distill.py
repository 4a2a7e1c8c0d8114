"""MTP self-distillation: each MTP layer learns the main head's full distribution at its position.

For MTP depth k the target at position t is softmax(main logits at t + k / T), detached; the loss is
KL(target || softmax(MTP-k logits at t / T)), masked like the main loss (positions whose target lies past the
sequence or in another packed document do not count) and normalised per token as Megatron normalises its MTP
cross-entropy. Megatron-Core's own MTP cross-entropy still runs, for logging only (its weight is set to zero).

`detach_trunk` keeps every MTP gradient inside the MTP layers: their inputs (the trunk's hidden states and the
shared embedding) and the shared output weight are detached for the MTP path, so the trunk's gradients are those of
the main loss alone (used during RL, where the MTP loss must not perturb the policy).

Vocabulary-parallel logits are handled with reductions over the tensor-parallel group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_ext.models import context_parallel

# name -> summed per-micro-batch values, reset by pop_metrics(); read by the training step's loss reduction
_METRICS: dict[str, torch.Tensor] = {}


def _tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over a vocabulary split across the tensor-parallel group (last dim local)."""
    logits = logits.float()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=_tp_group())
    shifted = logits - local_max
    sum_exp = shifted.exp().sum(dim=-1, keepdim=True)
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        sum_exp = _AllReduceSum.apply(sum_exp)
    return shifted - sum_exp.log()


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group for a value each rank then uses on its own vocabulary shard: every rank's gradient
    with respect to it is partial, so the backward pass sums them too."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=_tp_group())
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=_tp_group())
        return grad


def tp_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of per-shard partials into a value every rank then uses whole (identity backward, like the loss)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x)


def _tp_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Global argmax of vocabulary-parallel logits [..., V/tp]."""
    values, index = logits.max(dim=-1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return index
    index = index + parallel_state.get_tensor_model_parallel_rank() * logits.size(-1)
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=_tp_group())
    mine = torch.where(values == best, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=_tp_group())
    return mine


def _bounds(seq_local: int, packed_seq_params=None) -> tuple[int, ...]:
    return context_parallel.document_bounds(seq_local * context_parallel.cp_size(), packed_seq_params)


def shift_positions(x: torch.Tensor, k: int, packed_seq_params=None) -> torch.Tensor:
    """[b, s] values k positions ahead in the same sequence or document (0 past its end), CP-aware."""
    return context_parallel.shift_left(x, k, _bounds(x.size(1), packed_seq_params), dim=1)


def top1_agreement(main_logits: torch.Tensor, mtp_logits: torch.Tensor, k: int, packed_seq_params=None):
    """[b, s]: 1 where MTP-k's argmax at t equals the main head's argmax at t + k (logits [s, b, V/tp])."""
    bounds = _bounds(main_logits.size(0), packed_seq_params)
    ahead = context_parallel.shift_left(_tp_argmax(main_logits.detach()), k, bounds, dim=0)
    return (_tp_argmax(mtp_logits.detach()) == ahead).float().transpose(0, 1)


def shifted_mask(loss_mask: torch.Tensor, k: int, packed_seq_params=None) -> torch.Tensor:
    """[b, s] mask of positions t whose distillation target t + k exists in the same document (and counts)."""
    bounds = _bounds(loss_mask.size(1), packed_seq_params)
    ahead = context_parallel.shift_left(loss_mask.float(), k, bounds, dim=1)
    return ahead * (loss_mask > 0).float()


def self_distillation_losses(main_logits: torch.Tensor, mtp_logits: list[torch.Tensor], loss_mask: torch.Tensor,
                             temperature: float, packed_seq_params=None):
    """Per-depth (per-token KL [b, s], mask [b, s], top-1 agreement [b, s]) from [s, b, V/tp] logits.

    Under context parallelism the positions are this rank's chunks; targets k positions ahead may come from the
    next chunk on another rank (`context_parallel.shift_left`)."""
    bounds = _bounds(main_logits.size(0), packed_seq_params)
    target = vocab_parallel_log_softmax(main_logits.detach() / temperature)  # [s, b, V/tp]
    out = []
    for k, logits in enumerate(mtp_logits, start=1):
        log_q = vocab_parallel_log_softmax(logits / temperature)
        log_p = context_parallel.shift_left(target, k, bounds, dim=0)
        kl = tp_sum((log_p.exp() * (log_p - log_q)).sum(dim=-1, keepdim=True)).squeeze(-1)  # [s, b]
        mask = shifted_mask(loss_mask, k, packed_seq_params)
        out.append((kl.transpose(0, 1), mask, top1_agreement(main_logits, logits, k, packed_seq_params)))
    return out


def attach(output: torch.Tensor, losses, scaling_factor: float, per_token: bool, training: bool,
           name: str = "distill loss") -> torch.Tensor:
    """Give the MTP losses their gradient through `output` (Megatron's MTPLossAutoScaler, which the pipeline
    schedule scales like the main loss) and record them for logging.

    Per-token means count the tokens of the whole sequence: under context parallelism the token count is summed
    over the CP group and the loss multiplied by the CP size, because gradients are averaged over data- and
    context-parallel ranks alike (Megatron-Core's own MTP loss divides by the local count, mis-scaling it)."""
    num_layers = len(losses)
    cp = context_parallel.cp_size()
    for k, (kl, mask, agree) in enumerate(losses, start=1):
        tokens = mask.sum()
        if cp > 1:
            tokens = tokens.detach().clone()
            dist.all_reduce(tokens, group=parallel_state.get_context_parallel_group())
        tokens = tokens.clamp(min=1) / cp
        loss = (kl * mask).sum()
        if training:
            _record(f"mtp_{k} {name}", loss.detach() / tokens)
            _record(f"mtp_{k} top1 agreement", (agree * mask).sum() / tokens)
            scale = scaling_factor / num_layers
            output = MTPLossAutoScaler.apply(output, scale * loss if per_token else scale * loss / tokens)
    return output


def _record(name: str, value: torch.Tensor):
    _METRICS[name] = _METRICS.get(name, 0.0) + value.float()


def clear_metrics():
    """Forget the recorded values (a run's end: the next run in this process starts without them)."""
    _METRICS.clear()


def pop_metrics(num_microbatches: int) -> dict[str, float]:
    """Micro-batch means of the recorded values, averaged over data-parallel ranks; clears the record."""
    if not _METRICS:
        return {}
    names = sorted(_METRICS)
    values = torch.stack([torch.as_tensor(_METRICS[n]) for n in names]) / num_microbatches
    dist.all_reduce(values, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    values /= parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    _METRICS.clear()
    return dict(zip(names, values.tolist()))  # one read back for all of them
