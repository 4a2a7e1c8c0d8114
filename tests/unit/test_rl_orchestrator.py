"""The orchestrator against fake workers (threads with random delays, weights swapped mid-rollout): admission
control never lets a trained token lag its trainer step by more than --rl-max-staleness versions, staleness 0 is
fully on-policy, every prompt is trained exactly once, and a lost worker's prompts are requeued."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest

from megatron_ext.rl.ledger import Ledger
from megatron_ext.rl.orchestrator import Orchestrator, OrchestratorConfig, RolloutResult, Stopped, WorkerLost
from megatron_ext.rl.types import Group, Reward, Rollout, Sample, Segment


class FakeFleet:
    """Workers as threads: one request at a time each; every token takes a random time and is drawn by the newest
    weights the worker has received (in-flight updates), never older than the request's min_version."""

    def __init__(self, size: int, rng: random.Random, group_size: int = 3, tokens: int = 4, token_s=0.002):
        self.size, self.rng, self.g, self.tokens, self.token_s = size, rng, group_size, tokens, token_s
        self.pool = ThreadPoolExecutor(4 * size)
        self.locks = [threading.Lock() for _ in range(size)]
        self.generation = [0] * size
        self.version = [0] * size
        self.kill_at: dict[int, int] = {}  # request id -> kill its worker while it runs
        self.hang_at: set[int] = set()  # request ids whose worker hangs until it is replaced
        self.started: list[tuple[int, list[str]]] = []
        self.published = []

    def submit(self, worker, request):
        return self.pool.submit(self._run, worker, request, self.generation[worker])

    def _run(self, w, request, generation):
        with self.locks[w]:
            if generation != self.generation[w]:
                raise WorkerLost("killed")
            while self.version[w] < request.min_version:  # like a real worker: wait for the published weights
                time.sleep(0.001)
            self.started.append((w, [t["id"] for t in request.tasks]))
            t0, start = time.perf_counter(), self.version[w]
            if request.request_id in self.hang_at:
                while generation == self.generation[w]:
                    time.sleep(0.005)
                raise WorkerLost("killed while hanging")
            groups = []
            for task in request.tasks:
                rollouts = []
                for j in range(self.g):
                    versions = []
                    for _ in range(self.tokens):
                        time.sleep(self.rng.random() * self.token_s)
                        if request.request_id in self.kill_at:
                            self.generation[w] += 1
                            del self.kill_at[request.request_id]
                        if generation != self.generation[w]:
                            raise WorkerLost("killed mid-rollout")
                        versions.append(self.version[w])
                    sample = Sample([1] * self.tokens, [-0.1] * self.tokens, [-0.1] * self.tokens, versions, "stop")
                    rollouts.append(Rollout(task["id"], j, [Segment.environment([0]), Segment.model(sample)], "stop",
                                            Reward({"r": float(j)}, float(j))))
                groups.append(Group(task["id"], rollouts))
            return RolloutResult(request.request_id, groups, start, time.perf_counter() - t0)

    def wait(self, handles, timeout):
        done, _ = wait(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle):
        return handle.result()

    def publish(self, version, weights):
        delay = self.rng.random() * 0.01
        self.published.append(version)

        def deliver():  # workers receive new weights a little later, each on its own
            time.sleep(delay)
            for w in range(self.size):
                self.version[w] = max(self.version[w], version)
        threading.Thread(target=deliver, daemon=True).start()
        return {"seconds": 0.0, "bytes": 0}

    def restart(self, worker, version, weights):
        self.generation[worker] += 1
        self.version[worker] = version


def _run(K, seed, workers=2, P=3, prompts=17, per_request=2, kill=(), hang=(), timeout=600.0):
    rng = random.Random(seed)
    fleet = FakeFleet(workers, rng)
    fleet.kill_at = {r: 1 for r in kill}
    fleet.hang_at = set(hang)
    tasks = [{"id": f"p{i}"} for i in range(prompts)]
    ledger = Ledger([t["id"] for t in tasks])
    cfg = OrchestratorConfig(prompts_per_step=P, max_staleness=K, prompts_per_request=per_request, seed=seed,
                             poll_s=0.01, request_timeout_s=timeout)
    orch = Orchestrator(cfg, fleet, ledger, {t["id"]: t for t in tasks}, version=0, weights=dict, log=lambda *a, **k: None)
    trained, step, metrics = [], 0, []
    while True:
        out = orch.next_batch(step)
        if out is None:
            break
        groups, m = out
        metrics.append(m)
        for g in groups:
            for r in g.rollouts:
                for v in r.versions:
                    assert 0 <= step - v <= K, (K, seed, step, v)  # the bound, on every trained token
            trained.append(g.prompt_id)
        assert m["staleness max"] <= K
        time.sleep(rng.random() * 0.02)  # a training step of random length
        step += 1
        orch.publish(step)
    fleet.pool.shutdown()
    return trained, metrics, fleet, orch


@pytest.mark.parametrize("K", [0, 1, 3])
def test_admission_bounds_staleness_under_random_delays(K):
    for seed in range(6 if K else 3):
        trained, metrics, fleet, _ = _run(K, seed, workers=1 + seed % 3, P=2 + seed % 3, per_request=1 + seed % 2)
        assert sorted(trained) == sorted(f"p{i}" for i in range(17))  # each prompt once, none dropped
        if K == 0:  # synchronous: every token drawn by the weights that train on it
            assert all(m["staleness max"] == 0 and m["samples spanning versions"] == 0 for m in metrics)


def test_staleness_is_used_when_allowed():
    """With K > 0 the workers run ahead: some trained tokens really are older than the trainer (otherwise the
    bound above is checked on an idle pipeline)."""
    _, metrics, _, _ = _run(2, 0, workers=3, P=2, prompts=24)
    assert max(m["staleness max"] for m in metrics) >= 1


def test_lost_worker_prompts_are_requeued_and_trained_once():
    trained, metrics, fleet, orch = _run(1, 3, workers=2, P=3, prompts=15, kill=(2, 5))
    assert sorted(trained) == sorted(f"p{i}" for i in range(15))
    assert sum(m["requeued prompts"] for m in metrics) >= 2 and orch.restarts == 2
    started = [p for _, ps in fleet.started for p in ps]
    assert len(started) > len(set(started))  # the killed requests' prompts started again


def test_hung_worker_times_out_and_its_prompts_run_elsewhere():
    t0 = time.perf_counter()
    trained, metrics, fleet, orch = _run(1, 4, workers=2, P=2, prompts=8, per_request=1, hang=(3,), timeout=0.5)
    assert sorted(trained) == sorted(f"p{i}" for i in range(8))
    assert orch.restarts == 1 and sum(m["requeued prompts"] for m in metrics) >= 1
    assert time.perf_counter() - t0 < 30


class _Hangs:
    def reset(self, task):
        return [1]

    def step(self, tokens):
        time.sleep(30)

    def score(self):
        return Reward({"r": 1.0}, 1.0)


def test_hung_environment_ends_its_episode_with_an_error_reward():
    from megatron_ext.rl.workers import TimedEnv

    env = TimedEnv(_Hangs(), timeout_s=0.2)
    env.reset({})
    t0 = time.perf_counter()
    result = env.step([2])
    assert result.done and result.observation == []
    reward = env.score()
    assert reward.total == 0.0 and "after 0.2 s" in reward.error and time.perf_counter() - t0 < 5


def test_timed_environments_keep_the_factorys_concurrency():
    """Ray workers and the remote fleet wrap environments in TimedEnv (--rl-env-timeout): the wrapper factory keeps
    the coding factory's concurrency, so their rollouts' environment calls still overlap."""
    from megatron_ext.rl.workers import TimedEnv, timed_envs

    def factory():
        return _Hangs()

    factory.concurrency = 6
    wrapped = timed_envs(factory, 0.2)
    assert wrapped.concurrency == 6 and isinstance(wrapped(), TimedEnv)
    assert timed_envs(factory, 0) is factory and timed_envs(_Hangs, 0.2).concurrency == 1


def test_a_stop_request_ends_the_wait_for_a_batch():
    """SIGTERM while the trainer waits for rollouts: next_batch gives up (the trainer then saves; the prompts in
    flight are regenerated after the resume)."""
    fleet = FakeFleet(1, random.Random(0))
    fleet.hang_at = {1}
    tasks = [{"id": f"p{i}"} for i in range(4)]
    orch = Orchestrator(OrchestratorConfig(prompts_per_step=2, max_staleness=0, poll_s=0.01), fleet,
                        Ledger([t["id"] for t in tasks]), {t["id"]: t for t in tasks}, version=0, weights=dict,
                        log=lambda *a, **k: None)
    t0 = time.perf_counter()
    with pytest.raises(Stopped):
        orch.next_batch(0, stop=lambda: time.perf_counter() - t0 > 0.2)
    assert orch.ledger.in_flight and not orch.ledger.pending  # in flight: saved as such, generated again later
    fleet.restart(0, 0, dict)  # release the hanging thread
    fleet.pool.shutdown()
