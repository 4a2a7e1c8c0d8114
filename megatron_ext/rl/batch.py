"""Training samples -> packed THD micro-batches, laid out as SFT packs conversations (data/sft.py).

Each row of `seq_length` input positions holds whole samples back to back (first-fit, in order), each a document
of its own in `cu_seqlens`; inputs are a sample's tokens but the last, labels the tokens after. Per-token fields
are label-aligned: position p of a document carries the mask, sampler log-probability, advantage, aggregation
weight and version of the token it predicts. A sample longer than a row is an error (raise --seq-length or
lower --grpo-max-response-length), never silently cut.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_ext.data.sft import pack
from megatron_ext.rl.types import TrainingSample

FLOAT_FIELDS = ("loss_mask", "sampler_logprobs", "advantage", "agg_weight")


def rows_of(samples: list[TrainingSample], seq_length: int, pad_multiple: int = 1) -> list[list[int]]:
    spans = [_span(s, pad_multiple) for s in samples]
    for i, n in enumerate(spans):
        if n > seq_length:
            raise ValueError(f"a rollout of {len(samples[i].token_ids)} tokens needs {n} positions, more than "
                             f"--seq-length {seq_length}: raise --seq-length or lower --grpo-max-response-length")
    return pack(spans, seq_length)


def _span(s: TrainingSample, pad_multiple: int) -> int:
    return -(-s.positions // pad_multiple) * pad_multiple


def build_row(samples: list[TrainingSample], members: list[int], weights: list[np.ndarray], seq_length: int,
              pad_id: int, max_documents: int, pad_multiple: int = 1, global_ids: list[int] | None = None,
              routing_shape: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """One packed row. `weights[i]` is sample i's per-token aggregation weight (over its tokens), `global_ids[i]`
    its number within the step (sample_ids; -1 on padding)."""
    s = seq_length
    row = {"tokens": np.full(s, pad_id, np.int64), "labels": np.full(s, pad_id, np.int64),
           "position_ids": np.zeros(s, np.int64), "sample_ids": np.full(s, -1, np.int64),
           "versions": np.full(s, -1, np.int64)}
    row.update({k: np.zeros(s, np.float32) for k in FLOAT_FIELDS})
    routing = None
    if routing_shape is not None:
        # padding positions route to experts 0..k-1: any k distinct experts (a repeated one would leave the
        # token with fewer than k and unbalance the tensor-parallel token exchange)
        routing = np.broadcast_to(np.arange(routing_shape[-1]), (s, *routing_shape)).astype(np.int64)
    bounds = [0]
    for i in members:
        smp, lo, n = samples[i], bounds[-1], samples[i].positions
        row["tokens"][lo:lo + n], row["labels"][lo:lo + n] = smp.token_ids[:-1], smp.token_ids[1:]
        row["loss_mask"][lo:lo + n] = smp.loss_mask[1:]
        row["sampler_logprobs"][lo:lo + n] = smp.logprobs[1:]
        row["advantage"][lo:lo + n] = smp.advantage
        row["agg_weight"][lo:lo + n] = weights[i][1:]
        row["versions"][lo:lo + n] = smp.versions[1:]
        row["sample_ids"][lo:lo + n] = global_ids[i] if global_ids is not None else i
        if routing is not None:
            if smp.routing is None or len(smp.routing) < n:
                raise ValueError("--rl-routing-replay: a rollout has no routing for every input position; the "
                                 "sampler must return routing (SamplingParams.return_routing)")
            routing[lo:lo + n] = smp.routing[:n]
        span = _span(smp, pad_multiple)
        row["position_ids"][lo:lo + span] = np.arange(span)
        bounds.append(lo + span)
    row["position_ids"][bounds[-1]:] = np.arange(s - bounds[-1])
    if bounds[-1] < s:
        bounds.append(s)
    cu = np.full(max_documents + 1, -1, np.int32)
    cu[:len(bounds)] = bounds
    row["cu_seqlens"] = cu
    out = {k: torch.from_numpy(v) for k, v in row.items()}
    if routing is not None:
        out["routing"] = torch.from_numpy(routing)
    return out


def micro_batches(samples: list[TrainingSample], weights: list[np.ndarray], seq_length: int, micro_batch_size: int,
                  pad_id: int, num_microbatches: int | None = None, pad_multiple: int = 1,
                  global_ids: list[int] | None = None, routing_shape=None) -> list[dict[str, torch.Tensor]]:
    """This rank's samples as `num_microbatches` micro-batches of `micro_batch_size` packed rows.

    Every rank of a step must run the same number of micro-batches (expert-parallel all-to-alls, pipeline
    schedules), so a rank whose samples fill fewer spreads them out: rows are split (down to one sample each)
    until every micro-batch has at least one, and dealt to micro-batches round-robin. A micro-batch without any
    trainable token would make Megatron-Core's logged MTP cross-entropy 0/0; only a rank with fewer samples than
    micro-batches gets one."""
    rows = rows_of(samples, seq_length, pad_multiple) if samples else []
    needed = -(-len(rows) // micro_batch_size)
    if num_microbatches is None:
        num_microbatches = max(needed, 1)
    if needed > num_microbatches:
        raise ValueError(f"{len(rows)} rows need {needed} micro-batches, more than {num_microbatches}")
    while len(rows) < num_microbatches and any(len(r) > 1 for r in rows):
        widest = max(range(len(rows)), key=lambda i: len(rows[i]))
        rows.append([rows[widest].pop()])
    slots = [rows[m::num_microbatches] for m in range(num_microbatches)]
    max_documents = max([len(r) for r in rows] + [0]) + 1
    out = []
    for slot in slots:
        slot = slot + [[] for _ in range(micro_batch_size - len(slot))]
        built = [build_row(samples, r, weights, seq_length, pad_id, max_documents, pad_multiple, global_ids,
                           routing_shape) for r in slot]
        out.append({k: torch.stack([b[k] for b in built]) for k in built[0]})
    return out


def rows_needed(samples: list[TrainingSample], seq_length: int, micro_batch_size: int, pad_multiple: int = 1) -> int:
    """Micro-batches these samples fill (for agreeing on one count over the ranks)."""
    return max(-(-len(rows_of(samples, seq_length, pad_multiple)) // micro_batch_size), 1) if samples else 1
