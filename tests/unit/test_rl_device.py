"""RL step tensors live on the process group's device: NCCL takes no host tensors, and a host tensor mixed with
device ones fails. Run on the meta device, where any tensor built on the host (or moved there) meets a meta one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ext import platform
from megatron_ext.models import context_parallel
from megatron_ext.rl import forward as rl_forward
from megatron_ext.rl.batch import micro_batches
from megatron_ext.rl.env import DigitEnv, digit_tasks
from megatron_ext.rl.loss import aggregation_weights
from megatron_ext.rl.rollout import reference_groups
from megatron_ext.rl.trainer import k1_sums
from megatron_ext.rl.types import TrainingSample

META = torch.device("meta")


@pytest.fixture
def reduced(monkeypatch):
    """Two ranks, this one tensor-parallel rank 1 of the last pipeline stage; the devices of what is reduced."""
    seen = []
    monkeypatch.setattr(platform, "device", lambda: META)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, *a, **k: out.__setitem__(
        slice(None), [obj, (obj[0] + ["k1"], obj[1] + ["mismatch_max"])]))
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda *a, **k: 1)
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda *a, **k: True)
    return seen


def test_step_metrics_are_reduced_on_the_device(reduced):
    # this rank logged "policy" only; the other rank's names get zeros here: on the device, as is the TP mask
    rl_forward._add("policy", torch.ones(4, device=META), torch.ones(4, device=META))
    with pytest.raises(NotImplementedError):  # meta tensors have no values to bring to the host
        rl_forward.pop_metrics()
    assert reduced == [META, META]
    rl_forward._SUMS.clear()


def test_k1_sums_are_reduced_on_the_device(reduced, monkeypatch):
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda *a, **k: 0)
    monkeypatch.setattr(context_parallel, "document_bounds", lambda *a: None)  # host values, used only under CP
    samples = [TrainingSample.from_rollout(g.rollouts[0], 0.5, i)
               for i, g in enumerate(reference_groups(digit_tasks("train", 3, seed=1), DigitEnv))]
    weights = aggregation_weights("token-mean", [s.loss_mask for s in samples], 8)
    mbs = micro_batches(samples, weights, 64, 1, 0, 2)
    ref = [torch.zeros(1, mb["tokens"].numel(), device=META) for mb in mbs]
    with pytest.raises(NotImplementedError):
        k1_sums(mbs, ref, len(samples))
    assert reduced == [META]
