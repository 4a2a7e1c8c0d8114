"""The RL forward step: packed rollouts through the model, per-token log-probabilities, the GRPO loss.

Log-probabilities are the negatives of the per-token cross-entropy the model computes when given labels
(Megatron-Core's vocabulary-parallel cross-entropy, so TP needs no gathered vocabulary); passing labels also keeps
the MTP path (self-distillation with the trunk detached) running as in pretraining. The main head's logits are
captured from the output layer for the entropy (vocabulary-parallel reductions, mtp/distill.py). With routing
replay the decoder's routers take the experts the sampler chose (Megatron-Core's RouterReplay).

The loss each micro-batch returns is already normalised over the whole step (batch['agg_weight']); the factor
returned with it undoes the schedule's division by the micro-batch count and DDP's averaging over DP x CP.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_ext import platform
from megatron_ext.data.sft import packed_batch
from megatron_ext.models import context_parallel
from megatron_ext.mtp import distill
from megatron_ext.rl.loss import LossConfig, grpo_loss
from megatron_ext.training import lm

PER_TOKEN_KEYS = ("sampler_logprobs", "advantage", "agg_weight", "sample_ids", "versions", "old_logprobs",
                  "ref_logprobs")

# Step statistics: name -> [sum, count] (token means) and name -> max, reset by pop_metrics().
_SUMS: dict[str, torch.Tensor] = {}
_MAX: dict[str, torch.Tensor] = {}
TP_SPLIT_METRICS = ("routing replay agreement",)


def _add(name: str, values: torch.Tensor, mask: torch.Tensor):
    s = torch.stack([(values * mask).sum().double(), mask.sum().double()]).detach()
    _SUMS[name] = _SUMS[name] + s if name in _SUMS else s


def _max(name: str, value: torch.Tensor):
    v = value.detach().double().reshape(())
    _MAX[name] = torch.maximum(_MAX[name], v) if name in _MAX else v


def pop_metrics() -> dict[str, float]:
    """Token means and maxima of the step over every rank (a collective: every rank calls it)."""
    names = sorted(_SUMS)
    names_max = sorted(_MAX)
    box = [(names, names_max)]
    # ranks without the loss (earlier pipeline stages) learn the names from the last stage
    if dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, box[0])
        names = sorted({n for g in gathered for n in g[0]})
        names_max = sorted({n for g in gathered for n in g[1]})
    device = platform.device()  # the process group's (NCCL takes no host tensors), also for names absent here
    zeros = torch.zeros(2, dtype=torch.float64, device=device)
    sums = torch.stack([_SUMS.get(n, zeros).to(device) for n in names]) if names else None
    maxes = torch.stack([_MAX.get(n, zeros[0]).to(device) for n in names_max]) if names_max else None
    out = {}
    if sums is not None:
        # tensor-parallel ranks hold the same loss values: count each data/context/pipeline slot once; routers
        # under sequence parallelism see different tokens on each tensor-parallel rank: count them all
        if parallel_state.get_tensor_model_parallel_rank() != 0:
            sums = sums * torch.tensor([[float(n in TP_SPLIT_METRICS)] for n in names], dtype=sums.dtype,
                                       device=device)
        dist.all_reduce(sums)
    if maxes is not None:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    if sums is not None:  # to the host once, after both reductions
        out.update({n: s / c if c > 0 else 0.0 for n, (s, c) in zip(names, sums.tolist())})
    if maxes is not None:
        out.update(zip(names_max, maxes.tolist()))
    _SUMS.clear()
    _MAX.clear()
    return out


class _MainLogits:
    """Captures the main head's logits from the output layer (call number `index` of a forward: Megatron-Core's
    GPTModel runs its MTP heads first, then the main head), divided by the sampling temperature: the trainer's
    log-probabilities are then those of the distribution the sampler drew from (as verl divides its logits), so the
    importance ratio and k1 compare like with like. The consumer gets a copy, because Megatron-Core's
    vocabulary-parallel cross-entropy overwrites its input."""

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0, keep: bool = True):
        self.model = getattr(model, "module", model)
        self.index = self.model.config.mtp_num_layers or 0
        self.temperature, self.keep = temperature, keep
        self.calls, self.logits = 0, None

    def _hook(self, module, inputs, output):
        k, self.calls = self.calls, self.calls + 1
        if k != self.index:
            return None
        logits, bias = output
        if self.temperature != 1.0:
            logits = logits / self.temperature
        if not self.keep:
            return logits, bias
        self.logits = logits
        return logits.clone(), bias

    def __enter__(self):
        wanted = self.keep or self.temperature != 1.0
        self.handle = self.model.output_layer.register_forward_hook(self._hook) \
            if wanted and getattr(self.model, "post_process", False) else None
        if self.handle is not None and hasattr(self.model, "main_logits_temperature"):
            self.model.main_logits_temperature = self.temperature  # MTP distils from the undivided logits
        return self

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.remove()
            if hasattr(self.model, "main_logits_temperature"):
                self.model.main_logits_temperature = 1.0


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, the vocabulary split over the tensor-parallel group."""
    logp = distill.vocab_parallel_log_softmax(logits)
    return distill.tp_sum(-(logp.exp() * logp).sum(-1))


def _decoder_routers(model: torch.nn.Module) -> list:
    chunk = getattr(model, "module", model)
    out = []
    for layer in chunk.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            if router.router_replay is None:
                raise ValueError("--rl-routing-replay needs the model built with moe_enable_routing_replay")
            out.append(router)
    return out


@torch.no_grad()
def _agreement_hook(router, inputs):
    """Before a replayed routing: the fraction of the sampler's expert choices the trainer's router would make
    itself (its own top-k on this forward's scores), recorded as 'routing replay agreement'."""
    target = router.router_replay.target_topk_idx
    if target is None:
        return
    logits = router.gating(inputs[0]).view(-1, router.config.num_moe_experts)
    cfg = router.config
    _, own = topk_routing_with_score_function(
        logits.float(), router.topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
        group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=router.score_function, expert_bias=router.expert_bias)
    hits = own.gather(1, target.to(own.device).long()).float()
    _add("routing replay agreement", hits.mean(1), router._rl_valid.to(hits.device).float())


def moe_layer_offset(model: torch.nn.Module) -> int:
    """How many MoE layers precede this pipeline stage's first layer."""
    chunk = getattr(model, "module", model)
    first = chunk.decoder.layers[0].layer_number - 1 if len(chunk.decoder.layers) else 0
    pattern = chunk.config.moe_layer_freq
    pattern = pattern if isinstance(pattern, list) else [1] * chunk.config.num_layers
    return int(sum(pattern[:first]))


def set_replay(model: torch.nn.Module, routing: torch.Tensor | None, valid: torch.Tensor | None = None):
    """Replay `routing` [T, moe_layers, topk] (this rank's input positions) in the decoder's routers, or stop.
    With `valid` [T] (positions holding a sample, not padding), also measure the routing agreement."""
    routers = _decoder_routers(model)
    for router in routers:
        handle = getattr(router, "_rl_agreement_hook", None)
        if handle is not None:
            handle.remove()
            router._rl_agreement_hook = None
    replays = [router.router_replay for router in routers]
    if routing is None:
        for r in replays:
            r.clear_indices()
            r.clear_router_replay_action()
        return
    offset = moe_layer_offset(model)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    chunk = getattr(model, "module", model)
    if chunk.config.sequence_parallel and tp > 1:  # routers see this rank's slice of the sequence
        n = routing.size(0) // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        routing = routing[rank * n:(rank + 1) * n]
        valid = None if valid is None else valid[rank * n:(rank + 1) * n]
    for k, r in enumerate(replays):
        r.clear_indices()
        r.set_target_indices(routing[:, offset + k].long().contiguous())
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    if valid is not None:
        for router in routers:
            router._rl_valid = valid
            router._rl_agreement_hook = router.register_forward_pre_hook(_agreement_hook)


def loss_func(batch: dict, cfg: LossConfig, capture: _MainLogits, scale: float, output_tensor: torch.Tensor):
    logp = -output_tensor.float().view(-1)
    flat = {k: v.view(-1) for k, v in batch.items() if k in PER_TOKEN_KEYS or k == "loss_mask"}
    entropy = None
    if capture.logits is not None:
        logits = capture.logits.transpose(0, 1).reshape(-1, capture.logits.size(-1))  # [s, b, v] -> [b s, v]
        if cfg.entropy_weight:
            entropy = vocab_parallel_entropy(logits)
        else:
            with torch.no_grad():
                entropy = vocab_parallel_entropy(logits.detach())
        capture.logits = None
    loss, stats = grpo_loss(logp, flat, cfg, entropy)
    mask = flat["loss_mask"]
    for name in ("policy", "is_corrected", "clipped", "mismatch", "k1", "k3", "entropy"):
        if name in stats:
            _add(name, stats[name], mask)
    _add("trainer_logprob", logp.detach(), mask)
    if mask.any():
        _max("mismatch_max", stats["mismatch"].max())
    ntok = mask.sum()
    report = {"rl loss": torch.stack([loss.detach() * ntok.clamp(min=1), ntok.float()])}
    return loss * scale, torch.ones((), dtype=torch.int), report


LOCAL_KEYS = ("ref_logprobs", "old_logprobs")  # already this rank's [1, T_local], from a forward-only pass


def local_batch(micro_batch: dict):
    """One THD sequence of the micro-batch's rows, this CP rank's chunks; routing and pass results set aside."""
    batch = dict(micro_batch)
    routing = batch.pop("routing", None)
    local = {k: batch.pop(k) for k in LOCAL_KEYS if k in batch}
    batch, packed_seq_params = lm.to_device(*packed_batch(batch))
    bounds = context_parallel.document_bounds(batch["tokens"].size(1), packed_seq_params)
    batch = context_parallel.shard_batch(batch, packed_seq_params)
    device = batch["tokens"].device
    batch.update({k: v.reshape(1, -1).to(device) for k, v in local.items()})
    if routing is not None:
        routing = routing.to(device)
    return batch, routing, packed_seq_params, bounds


def forward_step(cfg: LossConfig, scale: float, data_iterator, model, routing_replay: bool = False,
                 temperature: float = 1.0):
    """Megatron schedule forward step for packed RL micro-batches (see module doc for `scale`); log-probabilities
    under the sampling `temperature`."""
    batch, routing, packed_seq_params, bounds = local_batch(next(data_iterator))
    if routing_replay:
        if routing is None:
            raise ValueError("--rl-routing-replay: the micro-batch carries no routing")
        routing = routing.reshape(-1, *routing.shape[2:])
        if context_parallel.cp_size() > 1:
            routing = routing.index_select(0, context_parallel.local_index(bounds).to(routing.device))
        set_replay(model, routing, valid=batch["sample_ids"].view(-1) >= 0)
    capture = _MainLogits(model, temperature)
    with capture:
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    if routing_replay:
        set_replay(model, None)
    return output, partial(loss_func, batch, cfg, capture, scale)


def logprob_loss_func(batch: dict, output_tensor: torch.Tensor):
    """Forward-only: the per-token log-probabilities of the labels (reference / old policy passes)."""
    logp = -output_tensor.detach().float()
    return torch.zeros(()), torch.ones((), dtype=torch.int), {"logprobs": logp}


def logprob_forward_step(data_iterator, model, routing_replay: bool = False, temperature: float = 1.0):
    batch, routing, packed_seq_params, bounds = local_batch(next(data_iterator))
    if routing_replay and routing is not None:
        routing = routing.reshape(-1, *routing.shape[2:])
        if context_parallel.cp_size() > 1:
            routing = routing.index_select(0, context_parallel.local_index(bounds).to(routing.device))
        set_replay(model, routing)
    with _MainLogits(model, temperature, keep=False):
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params)
    if routing_replay and routing is not None:
        set_replay(model, None)
    return output, partial(logprob_loss_func, batch)
