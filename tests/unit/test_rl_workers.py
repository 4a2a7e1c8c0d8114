"""Ray rollout workers (one local Ray instance for the module): a worker builds the trainer's model itself,
generates whole groups on the published weights, receives changed tensors only, applies a publication that
arrives mid-request, answers single generate requests, and a kill -9 of its process is reported as a lost worker
that a restart replaces."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import model_weights
from megatron_ext.rl.env import DEFAULT_DIGIT_WEIGHTS, DIGIT_REWARDS, VOCAB, DigitEnv, Rubric, digit_tasks
from megatron_ext.rl.orchestrator import RolloutRequest, WorkerLost
from megatron_ext.rl.rollout import EpisodeConfig, Sampling
from megatron_ext.rl.workers import EngineBackendFactory, FleetGenerate, RayFleet, WorkerConfig, worker_model_args
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model

ray = pytest.importorskip("ray")


class _Digits:  # picklable environment factory
    def __call__(self):
        return DigitEnv(Rubric(DIGIT_REWARDS, DEFAULT_DIGIT_WEIGHTS))


@pytest.fixture(scope="module")
def fleet():
    args = parse_args(["--model", "tiny", "--vocab-size", "32", "--seq-length", "64"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=5))[0]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}})
    cfg = WorkerConfig(EpisodeConfig(3, Sampling(max_tokens=6, stop_token_ids=(VOCAB.eos,)), 1, 6))
    f = RayFleet(1, cfg, EngineBackendFactory(worker_model_args(args)), _Digits(), 0,
                 lambda: model_weights(model), delta=True)
    yield f, model
    f.close()
    ray.shutdown()
    destroy()


def test_worker_generates_groups_on_published_weights_and_survives_kill(fleet):
    f, model = fleet
    tasks = digit_tasks("train", 2, seed=3)
    result = f.result(f.submit(0, RolloutRequest(1, tasks, seed=7, min_version=0)))
    assert [g.prompt_id for g in result.groups] == [t["id"] for t in tasks]
    assert all(len(g.rollouts) == 3 and r.versions == [0] for g in result.groups for r in g.rollouts)
    # the worker's tokens are the trainer's model's: its logprobs equal a teacher-forced forward here
    r = result.groups[0].rollouts[0]
    ids = torch.tensor([r.token_ids])
    with torch.no_grad():
        lp = -model(ids[:, :-1], torch.arange(ids.shape[1] - 1).unsqueeze(0), None, labels=ids[:, 1:])[0]
    n = len(r.segments[0].token_ids)
    assert r.segments[1].logprobs == pytest.approx(lp[n - 1:].tolist(), abs=1e-4)

    with torch.no_grad():  # one changed tensor: only it travels
        model.output_layer.weight.mul_(1.5)
    stats = f.publish(1, lambda: model_weights(model))
    assert stats["publish bytes"] == model.output_layer.weight.numel() * 4 < stats["publish bytes full"]
    result = f.result(f.submit(0, RolloutRequest(2, tasks[:1], seed=7, min_version=1)))
    assert result.start_version == 1 and all(r.versions == [1] for r in result.groups[0].rollouts)
    single = FleetGenerate(f)([[VOCAB.bos, 5, 6]], 2, Sampling(max_tokens=3, seed=1))
    assert len(single) == 1 and len(single[0]) == 2 and all(s.versions == [1] * len(s.token_ids) for s in single[0])

    os.kill(f.worker_pid(0), signal.SIGKILL)
    with pytest.raises(WorkerLost) as lost:
        f.result(f.submit(0, RolloutRequest(3, tasks, seed=7, min_version=1)))
    assert not lost.value.fatal
    f.restart(0, 1, lambda: model_weights(model))
    result = f.result(f.submit(0, RolloutRequest(4, tasks[:1], seed=7, min_version=1)))
    assert result.start_version == 1


def test_rollout_workers_get_only_the_gpus_the_trainer_does_not_use():
    from megatron_ext.rl.workers import free_gpus

    assert free_gpus({"LOCAL_WORLD_SIZE": "4"}, device_count=8) == ["4", "5", "6", "7"]
    assert free_gpus({"LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "3,5,6"}) == ["6"]
    # a launcher that narrows each rank to its own GPU leaves none: refused, not an actor waiting forever
    assert free_gpus({"LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0"}) == []


def test_rollout_workers_without_gpus_or_too_big_a_model_are_refused():
    from megatron_ext import planning
    from megatron_ext.models.presets import KIMI_K2_5, TINY
    from megatron_ext.rl.orchestrator import WorkerFailure
    from megatron_ext.rl.workers import check_worker_gpus

    check_worker_gpus(4, 1.0, available=4.0)
    with pytest.raises(WorkerFailure, match="--rl-rollout-workers 3 need 3 GPUs the trainer does not use; Ray has 0"):
        check_worker_gpus(3, 1.0, available=0.0)
    gpus, _ = planning.rollout_replica_gpus(KIMI_K2_5, planning.GPUS["h200"].memory_gib)
    assert gpus >= 16 and planning.rollout_replica_gpus(TINY, planning.GPUS["h200"].memory_gib)[0] == 1
    with pytest.raises(WorkerFailure, match=f"needs {gpus} GPUs .* --rl-remote-servers"):
        check_worker_gpus(1, 1.0, available=8.0, replica_gpus=gpus, model="kimi-k2.5")
