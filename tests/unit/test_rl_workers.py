"""Ray rollout workers (one local Ray instance for the module): a worker builds the trainer's model itself,
generates whole groups on the published weights, receives changed tensors only, applies a publication that
arrives mid-request, answers single generate requests, and a kill -9 of its process is reported as a lost worker
that a restart replaces. With --rl-worker-concurrency a worker decodes the turns of several requests in one engine
batch; killed while it holds several, every one of them is requeued and each prompt is still trained once."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import model_weights
from megatron_ext.rl.env import DEFAULT_DIGIT_WEIGHTS, DIGIT_REWARDS, VOCAB, DigitEnv, Rubric, StepResult, digit_tasks
from megatron_ext.rl.ledger import Ledger, trained_counts
from megatron_ext.rl.orchestrator import Orchestrator, OrchestratorConfig, RolloutRequest, WorkerLost
from megatron_ext.rl.rollout import EpisodeConfig, Sampling
from megatron_ext.rl.workers import EngineBackendFactory, FleetGenerate, RayFleet, WorkerConfig, worker_model_args
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model

ray = pytest.importorskip("ray")


class _Digits:  # picklable environment factory
    def __call__(self):
        return DigitEnv(Rubric(DIGIT_REWARDS, DEFAULT_DIGIT_WEIGHTS))


class _TwoTurns(DigitEnv):
    """Two model turns with an observation (and `delay` seconds of tool time) between them."""

    def __init__(self, delay: float = 0.0):
        super().__init__(Rubric(DIGIT_REWARDS, DEFAULT_DIGIT_WEIGHTS))
        self.delay, self.turns = delay, 0

    def step(self, model_tokens):
        self.turns += 1
        time.sleep(self.delay)
        super().step(model_tokens)
        return StepResult([VOCAB.eq], self.turns >= 2)


class _TwoTurnsFactory:  # picklable
    def __init__(self, delay: float):
        self.delay = delay

    def __call__(self):
        return _TwoTurns(self.delay)


@pytest.fixture(scope="module")
def ray_model():
    args = parse_args(["--model", "tiny", "--vocab-size", "32", "--seq-length", "64"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=5))[0]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}})
    yield args, model
    ray.shutdown()
    destroy()


@pytest.fixture(scope="module")
def fleet(ray_model):
    args, model = ray_model
    cfg = WorkerConfig(EpisodeConfig(3, Sampling(max_tokens=6, stop_token_ids=(VOCAB.eos,)), 1, 6))
    f = RayFleet(1, cfg, EngineBackendFactory(worker_model_args(args)), _Digits(), 0,
                 lambda: model_weights(model), delta=True)
    yield f, model
    f.close()


def _batched_fleet(ray_model, delay: float, batch_wait_s: float) -> RayFleet:
    """One worker running up to 3 requests at once; episodes of two turns, G = 2."""
    args, model = ray_model
    cfg = WorkerConfig(EpisodeConfig(2, Sampling(max_tokens=4, stop_token_ids=(VOCAB.eos,)), 2, 8),
                       batch_wait_s=batch_wait_s)
    return RayFleet(1, cfg, EngineBackendFactory(worker_model_args(args)), _TwoTurnsFactory(delay), 0,
                    lambda: model_weights(model), delta=True, concurrency=3)


def _wait_held(f: RayFleet, n: int, timeout: float = 120.0):
    deadline = time.time() + timeout
    while ray.get(f.actors[0].held.remote()) < n:
        assert time.time() < deadline, f"the worker never held {n} requests"
        time.sleep(0.05)


def test_worker_decodes_its_requests_in_one_batch_and_a_kill_loses_them_all(ray_model):
    args, model = ray_model
    f = _batched_fleet(ray_model, delay=0.0, batch_wait_s=60.0)  # batches only when all three requests wait
    try:
        tasks = digit_tasks("train", 6, seed=3)
        # dispatched before version 1 exists: the three wait for it together, then start on it together
        handles = [f.submit(0, RolloutRequest(i, tasks[2 * i:2 * i + 2], seed=11 * i, min_version=1))
                   for i in range(3)]
        _wait_held(f, 3)
        f.publish(1, lambda: model_weights(model))
        results = [f.result(h) for h in handles]
        for i, r in enumerate(results):
            assert [g.prompt_id for g in r.groups] == [t["id"] for t in tasks[2 * i:2 * i + 2]]
            assert all(len(g.rollouts) == 2 for g in r.groups)
            for g in r.groups:
                for ro in g.rollouts:
                    turns = [s for s in ro.segments if s.trainable]
                    assert len(turns) == 2 and all(v == 1 for s in turns for v in s.versions)
            assert r.start_version == 1
        # 3 requests x 2 prompts x G = 2: each turn of all of them is one engine batch of 12 rows
        assert ray.get(f.actors[0].engine_batches.remote()) == {12: 2}

        handles = [f.submit(0, RolloutRequest(10 + i, tasks[2 * i:2 * i + 2], seed=i, min_version=2))
                   for i in range(3)]
        _wait_held(f, 3)
        os.kill(f.worker_pid(0), signal.SIGKILL)
        for h in handles:
            with pytest.raises(WorkerLost):
                f.result(h)
    finally:
        f.close()


def test_continuous_worker_decodes_its_requests_together_and_a_kill_loses_them_all(ray_model):
    args, model = ray_model
    cfg = WorkerConfig(EpisodeConfig(2, Sampling(max_tokens=24), 2, 48), continuous_batching=True)
    f = RayFleet(1, cfg, EngineBackendFactory(worker_model_args(args)), _TwoTurnsFactory(0.0), 0,
                 lambda: model_weights(model), delta=True, concurrency=3)
    try:
        tasks = digit_tasks("train", 6, seed=5)
        handles = [f.submit(0, RolloutRequest(i, tasks[2 * i:2 * i + 2], seed=13 * i, min_version=1))
                   for i in range(3)]
        _wait_held(f, 3)
        f.publish(1, lambda: model_weights(model))
        for i, h in enumerate(f.result(h) for h in handles):
            assert [g.prompt_id for g in h.groups] == [t["id"] for t in tasks[2 * i:2 * i + 2]]
            for ro in (ro for g in h.groups for ro in g.rollouts):
                turns = [s for s in ro.segments if s.trainable]
                assert [len(s.token_ids) for s in turns] == [24, 24] and all(v == 1 for s in turns for v in s.versions)
        steps = ray.get(f.actors[0].engine_steps.remote())
        # 2 turns x 24 tokens of 3 requests x 2 prompts x G = 2 rows; some steps decoded several requests' rows
        assert sum(rows * n for rows, n in steps.items()) == 3 * 2 * 2 * 2 * 24 and max(steps) > 4, steps
        assert ray.get(f.actors[0].engine_batches.remote()) == {}  # no static batch ran

        handles = [f.submit(0, RolloutRequest(10 + i, tasks[2 * i:2 * i + 2], seed=i, min_version=2))
                   for i in range(3)]
        _wait_held(f, 3)
        decoded = lambda: sum(rows * n for rows, n in ray.get(f.actors[0].engine_steps.remote()).items())  # noqa: E731
        before = decoded()
        f.publish(2, lambda: model_weights(model))
        deadline = time.monotonic() + 60
        while decoded() == before and time.monotonic() < deadline:  # killed once the batch decodes (a fixed
            time.sleep(0.002)  # sleep raced it: on an idle machine the requests had finished)
        os.kill(f.worker_pid(0), signal.SIGKILL)
        for h in handles:
            with pytest.raises(WorkerLost):
                f.result(h)
    finally:
        f.close()


@pytest.mark.slow
def test_orchestrator_requeues_every_request_of_a_batched_worker_killed_mid_batch(ray_model, tmp_path):
    args, model = ray_model
    f = _batched_fleet(ray_model, delay=0.3, batch_wait_s=60.0)
    try:
        tasks = digit_tasks("train", 12, seed=4)
        ledger = Ledger([t["id"] for t in tasks], log_dir=str(tmp_path))
        cfg = OrchestratorConfig(prompts_per_step=6, max_staleness=1, prompts_per_request=2, requests_per_worker=3,
                                 request_timeout_s=600, poll_s=0.05)
        logs = []
        orch = Orchestrator(cfg, f, ledger, {t["id"]: t for t in tasks}, 0, lambda: model_weights(model),
                            log=lambda *a, **k: logs.append(" ".join(map(str, a))))
        killed = []

        def killer():  # once the worker holds three requests, in the middle of their episodes
            _wait_held(f, 3)
            killed.append(f.worker_pid(0))
            os.kill(killed[0], signal.SIGKILL)
        t = threading.Thread(target=killer, daemon=True)
        t.start()
        step = 0
        while (out := orch.next_batch(step)) is not None:
            groups, metrics = out
            assert metrics["staleness max"] <= 1
            ledger.log_trained(step, groups)
            orch.publish(step + 1)
            step += 1
        t.join(5)
        assert killed and step == 2
        assert trained_counts(str(tmp_path)) == {t["id"]: 1 for t in tasks}
        assert any("lost" in m and "6 prompt(s) requeued" in m for m in logs), logs
        # the replacement worker batched requests too: more rows than one request's 2 prompts x G = 2
        assert max(ray.get(f.actors[0].engine_batches.remote())) > 4
    finally:
        f.close()


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


def test_a_workers_engine_keeps_finished_turns_only_when_asked(ray_model):
    """The prefix store costs a cache copy per finished row: a worker's engine has one only where the run's
    episodes have several turns (rl_composer passes --rl-prefix-cache-mb then, 0 otherwise), never when it
    decodes speculatively."""
    args, _ = ray_model
    plain = EngineBackendFactory(worker_model_args(args))()
    assert plain.engine.prefix_store is None
    multi = EngineBackendFactory(worker_model_args(args), prefix_cache_mb=64)()
    assert multi.engine.prefix_store is not None and multi.engine.prefix_store.max_bytes == 64 * 2 ** 20
    speculative = EngineBackendFactory(worker_model_args(args), speculative=True, prefix_cache_mb=64)()
    assert speculative.engine.prefix_store is None
