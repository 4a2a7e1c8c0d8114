"""The asynchronous RL orchestrator: prompts to rollout workers, finished groups to trainer batches, staleness
bounded by admission control (rank 0 of the trainer runs it; the workers are any `Fleet`, Ray actors in a run).

    Ledger cursor (each prompt id once)
        | admit: only while target step - newest published version <= max_staleness   [admission gate]
        v
    admission queue (prompt ids, each with the trainer step that will train it: slot n -> step base + n // P)
        | dispatch: a request of <= prompts_per_request prompts to a worker with a free request slot
        v
    Fleet (rollout workers: engine replica + environments; G samples per prompt; weights swapped mid-rollout)
        | ray.wait / futures: finished requests as they complete; a lost worker's prompts go back to the queue front
        v
    finished groups (ledger pending)  --next_batch(step): all groups whose slot is `step`-->  trainer
        ^                                                                                     |
        +------------------- publish(version = step + 1): weights to every worker <----------+

One loop, driven by the trainer's thread (no background threads): `next_batch(step)` pumps until the step's
batch is complete, and `publish(version)` hands new weights to the fleet. Between the two calls the workers keep
generating whatever was dispatched, which is where the overlap comes from.

- `_pump` consumes finished requests and worker failures; produces finished groups (ledger.finish) and requeued
  prompts; blocks on `fleet.wait` for at most `poll_s`; unblocked by any request finishing.
- `_admit_and_dispatch` consumes free worker request slots and the ledger's cursor; produces requests; blocked by
  the admission gate (the trainer not far enough ahead) or by every worker being busy.
- `next_batch(step)` consumes the groups of slot `step`; blocks until all of them finished (the trainer is idle
  meanwhile: measured); returns them with the step's metrics.
- `publish(version)` consumes the trainer's weights; produces a versioned publication to every worker (which
  applies it between decode steps of whatever it is generating); it re-opens the admission gate.

Why a fixed slot per admitted prompt: a prompt admitted while the newest published version is v is trained at
step (slot) s with s - v <= max_staleness, and since every token a worker draws comes from weights at least as
new as the version it started from, no token is ever trained more than max_staleness versions after the weights
that produced it. With max_staleness 0 the batch of step s is admitted only after version s is published and is
sampled entirely by it: the synchronous baseline, on this same code path. Finished groups are never dropped.
"""

from __future__ import annotations

import collections
import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from megatron_ext.rl.ledger import Ledger
from megatron_ext.rl.types import Group


@dataclass
class OrchestratorConfig:
    prompts_per_step: int           # P: groups per trainer batch
    max_staleness: int              # K: versions a sample may lag the weights that train on it
    prompts_per_request: int = 1    # prompts a worker generates together (one engine batch of G samples each)
    requests_per_worker: int = 2    # dispatched and not finished per worker (one running, one queued behind it)
    request_timeout_s: float = 600.0  # a worker silent this long on its running request is killed and replaced
    max_worker_restarts: int = 8    # lost workers replaced over the run before it stops with an error
    seed: int = 0
    poll_s: float = 0.05


@dataclass
class RolloutRequest:
    request_id: int
    tasks: list[dict]
    seed: int
    min_version: int   # the worker starts with weights at least this new (the newest published at dispatch)


@dataclass
class RolloutResult:
    request_id: int
    groups: list[Group]
    start_version: int     # the weights the first tokens were drawn with
    busy_s: float          # seconds the worker spent on the request (generation, environments, weight swaps)
    swaps: int = 0         # in-flight weight updates applied during the request
    swap_s: float = 0.0
    speculation: dict = field(default_factory=dict)  # MTP drafts: drafted, accepted, main_forwards, tokens


class Stopped(Exception):
    """next_batch gave up waiting because the trainer was asked to stop."""


class WorkerFailure(RuntimeError):
    """The rollout fleet cannot go on (Ray did not start, out of memory, workers keep dying): the run stops."""


class WorkerLost(RuntimeError):
    """A worker process died or was killed (its requests are requeued); `fatal` when retrying cannot help
    (Ray's memory monitor killed it: the run stops with the message)."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class Fleet(Protocol):
    """The rollout workers as the orchestrator sees them (Ray actors in workers.py, threads in the tests)."""

    size: int

    def submit(self, worker: int, request: RolloutRequest) -> Any: ...  # a handle

    def wait(self, handles: list, timeout: float) -> list: ...  # the finished ones among handles

    def result(self, handle) -> RolloutResult: ...  # raises WorkerLost

    def publish(self, version: int, weights: Callable[[], dict]) -> dict: ...  # {"seconds": .., "bytes": ..}

    def restart(self, worker: int, version: int, weights: Callable[[], dict]): ...  # kill (if alive) and replace


@dataclass
class _InFlight:
    worker: int
    request: RolloutRequest
    slots: list[int]
    submitted: float


@dataclass
class _Stats:
    """Counters between two batches (reset by next_batch)."""
    gate_blocked_s: float = 0.0
    busy_s: float = 0.0
    swaps: int = 0
    requeued: int = 0
    restarts: int = 0
    request_latency: list = field(default_factory=list)
    speculation: collections.Counter = field(default_factory=collections.Counter)
    since: float = field(default_factory=time.perf_counter)


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig, fleet: Fleet, ledger: Ledger, tasks_by_id: dict[str, dict],
                 version: int, weights: Callable[[], dict], log=print, clock: Callable[[], float] = time.perf_counter):
        """`clock`: seconds for every duration, timeout and metric (a virtual clock in benchmarks/rl_async_sim.py)."""
        self.cfg, self.fleet, self.ledger, self.tasks, self.log = cfg, fleet, ledger, tasks_by_id, log
        self.clock = clock
        self.weights = weights
        self.base = version                     # the step of slot 0
        self.published = version
        self.slots: list[str] = []              # slot n -> prompt id (trained at step base + n // P)
        self.slot_of: dict[str, int] = {}
        self.queue: collections.deque[int] = collections.deque()  # admitted slots waiting for a worker
        self.inflight: dict[Any, _InFlight] = {}
        self.finished: dict[int, tuple[Group, int, float]] = {}  # slot -> (group, start version, finished at)
        self.restarts = 0
        self.stats = _Stats(since=clock())
        self._blocked_since: Optional[float] = None
        self._request_ids = 0
        self._busy_since = [0.0] * fleet.size
        # bookkeeping that keeps every pump O(log workers) at thousands of workers (benchmarks/rl_async_sim.py)
        self._load = [0] * fleet.size                      # requests in flight per worker
        self._free = [(0, w) for w in range(fleet.size)]   # heap (load, worker) of workers with a free slot; stale
        self._oldest: list[tuple[float, int]] = []         # heap (busy since, worker) for timeouts; stale entries
        self._exhausted = False
        for g in list(ledger.pending):          # finished before a checkpoint: trained first
            slot = self._new_slot(g.prompt_id)
            self.finished[slot] = (g, version, self.clock())

    # ---- admission -------------------------------------------------------------------------------------------
    def _new_slot(self, prompt_id: str) -> int:
        self.slots.append(prompt_id)
        self.slot_of[prompt_id] = len(self.slots) - 1
        return len(self.slots) - 1

    def step_of(self, slot: int) -> int:
        return self.base + slot // self.cfg.prompts_per_step

    def gate_open(self) -> bool:
        """Whether the next prompt may start: the step that will train it is at most K versions ahead of the
        newest published weights."""
        return self.step_of(len(self.slots)) - self.published <= self.cfg.max_staleness

    def _admit(self, n: int) -> list[int]:
        out = []
        while len(out) < n and self.gate_open():
            ids = self.ledger.admit(1)
            if not ids:
                break
            out.append(self._new_slot(ids[0]))
        return out

    def _admit_and_dispatch(self):
        """Requests to the least-loaded workers first (every worker gets one before any gets a second: with fewer
        requests than request slots, filling worker 0's queue first leaves workers idle and runs requests one
        after another on the others)."""
        wanted = False
        while self._free:
            load, w = self._free[0]
            if load != self._load[w] or load >= self.cfg.requests_per_worker:
                heapq.heappop(self._free)
                continue
            room = self.cfg.prompts_per_request
            slots = [self.queue.popleft() for _ in range(min(room, len(self.queue)))]
            slots += self._admit(room - len(slots))
            if not slots:
                wanted = not self.ledger_exhausted()
                break
            heapq.heappop(self._free)
            self._submit(w, slots)
        now = self.clock()
        blocked = wanted and not self.gate_open()
        if blocked and self._blocked_since is None:
            self._blocked_since = now
        elif not blocked and self._blocked_since is not None:
            self.stats.gate_blocked_s += now - self._blocked_since
            self._blocked_since = None

    def ledger_exhausted(self) -> bool:
        """No prompt left to admit (once true it stays true: only admission adds prompts in flight)."""
        self._exhausted = self._exhausted or (self.ledger.cursor >= len(self.ledger.prompt_ids) and
                                              all(p in self.slot_of for p in self.ledger.in_flight))
        return self._exhausted

    def _set_load(self, worker: int, load: int):
        self._load[worker] = load
        if load < self.cfg.requests_per_worker:
            heapq.heappush(self._free, (load, worker))
        if len(self._free) > 4 * self.fleet.size + 64:  # drop stale entries
            self._free = [(n, w) for w, n in enumerate(self._load) if n < self.cfg.requests_per_worker]
            heapq.heapify(self._free)

    def _mark_busy(self, worker: int, now: float):
        self._busy_since[worker] = now
        heapq.heappush(self._oldest, (now, worker))

    def _submit(self, worker: int, slots: list[int]):
        self._request_ids += 1
        rid = self._request_ids
        request = RolloutRequest(rid, [self.tasks[self.slots[s]] for s in slots],
                                 seed=self.cfg.seed * 1_000_003 + rid * 7919, min_version=self.published)
        if not self._load[worker]:
            self._mark_busy(worker, self.clock())
        handle = self.fleet.submit(worker, request)
        self.inflight[handle] = _InFlight(worker, request, slots, self.clock())
        self._set_load(worker, self._load[worker] + 1)

    # ---- completion and failures -------------------------------------------------------------------------
    def _pump(self, timeout: float):
        self._admit_and_dispatch()
        if not self.inflight:
            return
        for handle in self.fleet.wait(list(self.inflight), timeout):
            f = self.inflight.pop(handle, None)
            if f is None:  # its worker was replaced while handling an earlier handle: requeued already
                continue
            self._set_load(f.worker, self._load[f.worker] - 1)
            try:
                result = self.fleet.result(handle)
            except WorkerLost as e:
                self._lost(f, e)
                continue
            now = self.clock()
            self._mark_busy(f.worker, now)
            self.stats.busy_s += result.busy_s
            self.stats.swaps += result.swaps
            self.stats.speculation.update(result.speculation)
            self.stats.request_latency.append(now - f.submitted)
            for slot, group in zip(f.slots, result.groups):
                if group.prompt_id != self.slots[slot]:
                    raise RuntimeError(f"worker {f.worker} answered request {f.request.request_id} with prompt "
                                       f"{group.prompt_id!r} where {self.slots[slot]!r} was asked")
                self.ledger.finish(group)
                self.finished[slot] = (group, result.start_version, now)
        self._check_timeouts()
        self._admit_and_dispatch()

    def _check_timeouts(self):
        """Only the longest-silent busy workers are looked at (a heap of busy-since times; stale entries are
        those of workers that finished something or went idle since)."""
        now = self.clock()
        while self._oldest:
            since, w = self._oldest[0]
            if since != self._busy_since[w] or not self._load[w]:
                heapq.heappop(self._oldest)
                continue
            if now - since <= self.cfg.request_timeout_s:
                break
            heapq.heappop(self._oldest)
            self._replace(w, f"worker {w} made no progress for {self.cfg.request_timeout_s:.0f} s "
                             "(--rl-rollout-timeout): killed")

    def _lost(self, f: _InFlight, error: WorkerLost):
        if error.fatal:
            raise WorkerFailure(f"rollout worker {f.worker} failed and the run cannot continue: {error}")
        self._replace(f.worker, f"worker {f.worker} lost ({error})", f.slots)

    def _replace(self, worker: int, reason: str, failed: tuple = ()):
        """Requeue every prompt the worker held (`failed`: those of the request that reported the loss) at the
        queue's front, in slot order, then replace the worker."""
        mine = [h for h, f in self.inflight.items() if f.worker == worker]
        slots = sorted(list(failed) + [s for h in mine for s in self.inflight.pop(h).slots])
        self._set_load(worker, 0)
        self.queue.extendleft(reversed(slots))
        self.restarts += 1
        self.stats.requeued += len(slots)
        self.stats.restarts += 1
        if self.restarts > self.cfg.max_worker_restarts:
            raise WorkerFailure(f"{reason}; {self.restarts} rollout workers replaced in this run (more than "
                               f"{self.cfg.max_worker_restarts}): stopping. Look at the workers' logs (Ray: "
                               "/tmp/ray/session_latest/logs) for why they die")
        self.log(f"{reason}: {len(slots)} prompt(s) requeued, worker restarted", flush=True)
        self.fleet.restart(worker, self.published, self.weights)
        self._mark_busy(worker, self.clock())

    # ---- the trainer's side ------------------------------------------------------------------------------
    def next_batch(self, step: int, stop: Callable[[], bool] = lambda: False
                   ) -> Optional[tuple[list[Group], dict[str, float]]]:
        """The groups of slot `step` (all of them finished; fewer than P only at the end of the prompts) and the
        step's metrics; None when every prompt was trained. Blocks while they are being generated; raises
        `Stopped` when `stop()` turns true meanwhile (a SIGTERM: the trainer saves and exits)."""
        if step != self.published:
            raise RuntimeError(f"next_batch({step}) while version {self.published} is the newest published: "
                               "publish the weights of every step first")
        P = self.cfg.prompts_per_step
        lo = (step - self.base) * P
        t0 = self.clock()
        ready = lo  # slots lo..ready-1 are finished (they stay so until taken below)
        while True:
            hi = min(lo + P, len(self.slots))
            if hi <= lo and self.ledger_exhausted():  # no prompt left for this step
                return None
            while ready < hi and ready in self.finished:
                ready += 1
            if (hi - lo == P or self.ledger_exhausted()) and ready >= hi:
                break
            if stop():
                raise Stopped(f"stopped while waiting for the rollouts of step {step + 1}")
            self._pump(self.cfg.poll_s)
        waited = self.clock() - t0
        taken = [self.finished.pop(s) for s in range(lo, hi)]
        groups = [g for g, _, _ in taken]
        self.ledger.take_groups([g.prompt_id for g in groups])
        metrics = self._metrics(step, taken, waited)
        self._admit_and_dispatch()
        return groups, metrics

    def publish(self, version: int) -> dict[str, float]:
        """New weights to every worker (they apply them mid-rollout); opens the admission gate by one step."""
        stats = self.fleet.publish(version, self.weights)
        self.published = version
        self._admit_and_dispatch()  # start the prompts the new version admits before the trainer moves on
        return stats

    def _metrics(self, step: int, taken: list, waited: float) -> dict[str, float]:
        now = self.clock()
        stale, spans = [], []
        for g, start, _ in taken:
            for r in g.rollouts:
                v = [v for s in r.segments if s.trainable for v in s.versions]
                stale.extend(step - x for x in v)
                spans.append(len(set(v)) > 1)
        stale = np.asarray(stale or [0])
        s = self.stats
        wall = max(now - s.since, 1e-9)
        out = {"staleness mean": float(stale.mean()), "staleness max": float(stale.max()),
               "samples spanning versions": float(np.mean(spans)) if spans else 0.0,
               "start version lag mean": float(np.mean([step - start for _, start, _ in taken])),
               "queue admitted": float(len(self.queue)),
               "queue in flight": float(sum(len(f.slots) for f in self.inflight.values())),
               "queue finished": float(len(self.finished)),
               "finished group wait s": float(np.mean([now - t for _, _, t in taken])),
               "request latency s": float(np.mean(s.request_latency)) if s.request_latency else 0.0,
               "seconds gate blocked": s.gate_blocked_s + (now - self._blocked_since if self._blocked_since else 0),
               "seconds batch wait": waited,
               # per request lane: a worker running C requests at once (--rl-worker-concurrency) has C lanes
               "worker utilisation": min(1.0, s.busy_s / (wall * self.fleet.size * getattr(self.fleet, "concurrency",
                                                                                             1))),
               "weight swaps in flight": float(s.swaps), "requeued prompts": float(s.requeued),
               "worker restarts": float(s.restarts)}
        if s.speculation.get("drafted"):  # --rl-speculative on the workers
            out["mtp acceptance"] = s.speculation["accepted"] / s.speculation["drafted"]
            out["mtp tokens per forward"] = s.speculation["tokens"] / max(s.speculation["main_forwards"], 1)
        if self._blocked_since is not None:
            self._blocked_since = now
        self.stats = _Stats(since=now)
        self.last_staleness = stale
        return out

    def close(self):
        self.inflight.clear()
