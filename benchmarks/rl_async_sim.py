"""Asynchronous RL at cluster scale, simulated: the real orchestrator (megatron_ext/rl/orchestrator.py: admission
gate, ledger, requeue on failure, staleness accounting) on a virtual clock, with simulated rollout workers and a
simulated trainer, so that thousands of workers and long-tailed agentic rollouts cost seconds of CPU.

    python benchmarks/rl_async_sim.py --workers 1024 --staleness 2 --json
    python benchmarks/rl_async_sim.py --sweep --plot docs/rl_async_sim.png     # the table of docs/benchmarks.md
    python benchmarks/rl_async_sim.py --validate                               # against this machine's runs

Every run is done twice with the same seed, at --staleness K and at 0 (the synchronous baseline on the same code
path); "speedup" is the ratio of their samples trained per second, counted after the first step (as
benchmarks/rl_async.py does).

The model, and what it leaves out:
- A worker is one inference engine replica. --worker ray (default): the Ray `RolloutWorker` of rl/workers.py,
  running up to --worker-concurrency of its requests at once (--rl-worker-concurrency; the rest of
  --requests-per-worker queue), each request's episodes turn by turn in lockstep, every turn of every running
  request that waits decoded as one engine batch (the worker's `Batcher`), environments stepped in sequence
  (--parallel-tools: at once). --worker ray --continuous-batching (rl_composer's --rl-continuous-batching): the
  same worker, whose engine runs one decode loop: a generate call joins the batch when it arrives, each row leaves
  when it finishes, and the call returns once its own rows have (engine_batch_rows of --json is then the fraction
  of decoding time spent at each number of rows decoding). --worker server: --worker-concurrency requests at once in
  one continuous batch, every sequence on its own timeline (an SGLang-style server behind rl/remote_fleet.py's
  request slots). A decode step takes --decode-latency x (1 + batch / --batch-knee) seconds, the batch being the
  sequences decoding: larger batches give more tokens per second but slower tokens. Prefill is not modelled.
- An episode is --turns model turns with a tool call after each but the last (latency lognormal, median
  --tool-latency, sigma --tool-sigma); its response length is lognormal (median --length-median, sigma
  --length-sigma) cut at --max-length, split evenly over the turns. A request ends with its longest episode.
- Weights published by the trainer reach every worker when the publication ends; each token is tagged with the
  newest version its worker had when it was drawn (in-flight updates between decode steps), so staleness is
  measured by the orchestrator's own accounting, not assumed. Tokens are carried in chunks of --token-quantum
  (their count, not their ids, is what the orchestrator's accounting touches); a rollout is the prompt's
  environment segment and one model segment per turn (tool outputs, never trained, are left out).
- A request fails with probability --failure-rate at a uniform point of its run (ray: after one of its turns, and
  the worker loses every request it holds): the worker raises `WorkerLost`, the orchestrator requeues its prompts
  and restarts it (--restart-s of virtual time).
- The trainer's step takes --train-fixed-s + tokens trained x --train-token-s; publication takes
  --weights-gb / --bandwidth-gbs.

Orchestrator CPU is real: process time of the trainer-side calls (next_batch, publish, including the ledger and
the staleness metrics), minus the simulated fleet's own time.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import heapq
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.rl.ledger import Ledger, trained_counts  # noqa: E402
from megatron_ext.rl.orchestrator import Orchestrator, OrchestratorConfig, RolloutResult, WorkerLost  # noqa: E402
from megatron_ext.rl.types import Group, Reward, Rollout, Segment  # noqa: E402


class Clock:
    """Virtual seconds; the fleet moves it forward to the next event, the trainer by its step and publication."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Job:
    worker: int
    generation: int
    request: object
    start: float
    end: float
    failed: bool
    lengths: np.ndarray     # [sequences] response tokens
    tools: np.ndarray       # [sequences, turns - 1] tool seconds
    token_s: float


class SimFleet:
    """The `Fleet` protocol of rl/orchestrator.py on a virtual clock, for continuous-batching servers (--worker
    server): a request's run is drawn when it is submitted and becomes an event at its end (or at its failure)."""

    def __init__(self, a: argparse.Namespace, clock: Clock, version: int):
        self.a, self.clock, self.size = a, clock, a.workers
        self.rng = np.random.default_rng(a.seed)
        self.free_at = [[0.0] * a.worker_concurrency for _ in range(a.workers)]  # per concurrent lane
        self.generation = [0] * a.workers
        self.heap: list = []
        self.jobs: dict[int, _Job] = {}
        self.pub_t, self.pub_v = [-math.inf], [version]
        self.tokens: dict[str, int] = {}   # prompt id -> response tokens of its finished group
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self._ids = 0

    def _timed(fn):  # noqa: N805 (the fleet's own CPU is not the orchestrator's)
        def wrapper(self, *args):
            t0 = time.process_time()
            try:
                return fn(self, *args)
            finally:
                self.cpu_s += time.process_time() - t0
        return wrapper

    def _draw(self, n: int):
        a = self.a
        lengths = np.minimum(np.maximum(
            self.rng.lognormal(math.log(a.length_median), a.length_sigma, n), 1), a.max_length).astype(np.int64)
        tools = self.rng.lognormal(math.log(max(a.tool_latency, 1e-9)), a.tool_sigma, (n, a.turns - 1)) \
            if a.tool_latency > 0 and a.turns > 1 else np.zeros((n, max(a.turns - 1, 0)))
        return lengths, tools

    @_timed
    def submit(self, worker: int, request) -> int:
        a, now = self.a, self.clock.now
        n = len(request.tasks) * a.group_size
        lengths, tools = self._draw(n)
        lanes = self.free_at[worker]
        lane = int(np.argmin(lanes))
        start = max(now, lanes[lane])
        batch = n * (1 + sum(t > start for i, t in enumerate(lanes) if i != lane))  # the requests running beside
        token_s = a.decode_latency * (1 + batch / a.batch_knee)
        run = float((lengths * token_s + tools.sum(axis=1)).max())
        failed = bool(self.rng.random() < a.failure_rate)
        end = start + (run * self.rng.random() if failed else run)
        lanes[lane] = end
        self._ids += 1
        self.jobs[self._ids] = _Job(worker, self.generation[worker], request, start, end, failed, lengths, tools,
                                    token_s)
        heapq.heappush(self.heap, (end, self._ids))
        return self._ids

    def _live(self, handle: int) -> bool:
        job = self.jobs.get(handle)
        return job is not None and job.generation == self.generation[job.worker]

    @_timed
    def wait(self, handles: list, timeout: float) -> list:
        """Every request finished by now; if none, the clock moves to the next end (at most `timeout` ahead)."""
        while self.heap and not self._live(self.heap[0][1]):
            heapq.heappop(self.heap)
        if not self.heap:
            self.clock.now += timeout
            return []
        if self.heap[0][0] > self.clock.now:
            self.clock.now = min(self.heap[0][0], self.clock.now + timeout)
        return self._pop_ready(self.heap)

    def _pop_ready(self, heap: list) -> list:
        """The live handles of (time, handle) entries up to now."""
        ready = []
        while heap and heap[0][0] <= self.clock.now:
            _, h = heapq.heappop(heap)
            if self._live(h):
                ready.append(h)
        return ready

    def version_at(self, t: np.ndarray) -> np.ndarray:
        return np.asarray(self.pub_v)[np.searchsorted(self.pub_t, t, side="right") - 1]

    @_timed
    def result(self, handle: int) -> RolloutResult:
        job = self.jobs.pop(handle)
        a = self.a
        self.busy_s += job.end - job.start
        if job.failed:
            raise WorkerLost("simulated worker failure")
        turns, q, n = a.turns, a.token_quantum, len(job.lengths)
        per_turn = _per_turn(job.lengths, turns)
        decode = per_turn * job.token_s
        begin = job.start + np.concatenate([np.zeros((n, 1)), np.cumsum(decode[:, :-1] + job.tools, axis=1)], 1)
        chunks = np.maximum(1, -(-per_turn // q)).reshape(-1)           # version tags per (sequence, turn)
        first = np.repeat(np.cumsum(chunks) - chunks, chunks)
        within = np.arange(chunks.sum()) - first
        times = np.repeat(begin.reshape(-1), chunks) + (within + 0.5) * np.repeat((decode.reshape(-1) / chunks),
                                                                                  chunks)
        return _result(self, job.request, job.lengths, chunks, times, job.start, job.end)

    @_timed
    def publish(self, version: int, weights) -> dict:
        seconds = self.a.weights_gb / self.a.bandwidth_gbs
        self.clock.now += seconds
        self.pub_t.append(self.clock.now)
        self.pub_v.append(version)
        return {"seconds": seconds, "bytes": int(self.a.weights_gb * 1e9)}

    @_timed
    def restart(self, worker: int, version: int, weights):
        self.generation[worker] += 1
        self.free_at[worker] = [self.clock.now + self.a.restart_s] * self.a.worker_concurrency


def _per_turn(lengths: np.ndarray, turns: int) -> np.ndarray:
    """[sequences, turns] response tokens: a sequence's length split evenly over its turns."""
    per_turn = np.repeat((lengths // turns)[:, None], turns, axis=1)
    per_turn += np.arange(turns)[None, :] < (lengths % turns)[:, None]
    return per_turn


def _tag_steps(per_turn: np.ndarray, quantum: int) -> tuple[np.ndarray, np.ndarray]:
    """One turn's rows of `per_turn` tokens, carried as `chunks` version tags per row: the tags' decode steps,
    counted from the row's first (the middle token of each chunk), in (row, chunk) order."""
    chunks = np.maximum(1, -(-per_turn // quantum))
    row = np.repeat(np.arange(len(per_turn)), chunks)
    within = np.arange(chunks.sum()) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    return chunks, (within + 0.5) * (per_turn[row] / chunks[row])


def _result(fleet, request, lengths: np.ndarray, chunks: np.ndarray, times: np.ndarray, start: float,
            end: float) -> RolloutResult:
    """The request's groups as a worker returns them: per (sequence, turn) `chunks[k]` version tags, drawn at
    `times` (in (sequence, turn, chunk) order) by the newest weights published by then."""
    a, turns = fleet.a, fleet.a.turns
    versions = fleet.version_at(times).tolist()
    counts, groups, pos, k = chunks.tolist(), [], 0, 0
    for i, task in enumerate(request.tasks):
        rollouts = []
        for j in range(a.group_size):
            segments = [Segment([0], False)]
            for turn in range(turns):
                c = counts[k * turns + turn]
                segments.append(Segment([1] * c, True, [0.0] * c, [0.0] * c, versions[pos:pos + c]))
                pos += c
            rollouts.append(Rollout(task["id"], j, segments, "stop", Reward({"r": 0.0}, 0.0)))
            k += 1
        fleet.tokens[task["id"]] = int(lengths[i * a.group_size:(i + 1) * a.group_size].sum())
        groups.append(Group(task["id"], rollouts))
    pub_t = np.asarray(fleet.pub_t)
    swaps = int(np.sum((pub_t > start) & (pub_t <= end)))
    return RolloutResult(request.request_id, groups, int(fleet.version_at(np.asarray([start]))[0]), end - start,
                         swaps=swaps)


@dataclass
class _Held:
    """A request a simulated Ray worker holds: its episodes advance turn by turn in lockstep (rl/rollout.py), each
    turn one call into the worker's batcher."""
    handle: int
    worker: int
    generation: int
    request: object
    per_turn: np.ndarray    # [sequences, turns] response tokens
    tools: np.ndarray       # [sequences, turns - 1] tool seconds
    lengths: np.ndarray
    fail_turn: int          # the turn after which the worker dies (-1: none)
    turn: int = 0
    ready_at: float = 0.0   # its next call waits in the batcher from then
    start: float = -1.0
    end: float = 0.0
    times: list = None      # per turn: [sequences, chunks] draw times, flattened
    chunks: list = None
    join_t: float = 0.0     # continuous batching: when its call joined the engine's batch,
    join_steps: float = 0.0  # the engine's decode steps then,
    target: float = 0.0     # and the step count at which its call's last row finishes


class _EngineWorker:
    def __init__(self):
        self.held: list[_Held] = []                  # running (at most --worker-concurrency)
        self.queue: collections.deque = collections.deque()
        self.batch: list[_Held] = []                 # in the engine now
        self.busy_until = 0.0
        self.down_until = 0.0
        self.dead = False
        self.seq = -1


class RayWorkerFleet(SimFleet):
    """Ray rollout workers as rl/workers.py runs them (--worker ray): a worker runs up to --worker-concurrency of
    its requests at once (the rest wait in its queue); each request's episodes take their turns in lockstep (one
    generate call per turn); the batcher runs every call waiting once all running requests have one waiting (or
    --batch-wait-s after the first), as one engine batch whose rows leave as they finish; a call arriving while a
    batch decodes waits for the next. After a turn the request steps its environments one after another (tool
    calls in sequence, as run_groups does; --parallel-tools: at once). A batch whose rows have lengths L_i takes
    decode-latency x (max L + sum L / batch-knee) (each decode step costs 1 + rows still in it / knee), and a
    token k of any row is drawn at the matching point of it, so in-flight swaps tag tokens by the step they fall
    in. Failures kill the worker at the end of a turn: all its requests are lost."""

    def __init__(self, a: argparse.Namespace, clock: Clock, version: int):
        super().__init__(a, clock, version)
        self.workers = [self._new_worker() for _ in range(a.workers)]
        self.events: list = []          # (time, worker, seq): a worker's next batch end or dispatch
        self.done: list = []            # (time, handle): requests finished or failed
        self.failed: set[int] = set()
        self.engine_busy_s = 0.0
        self._seq = 0
        self.batch_rows: collections.Counter = collections.Counter()  # engine batches by their rows

    def _advance(self, until: float):
        while self.events and self.events[0][0] <= until:
            t, w, seq = heapq.heappop(self.events)
            if seq == self.workers[w].seq:
                self._step(w, t)

    def _schedule(self, w: int, now: float):
        wk = self.workers[w]
        self._seq += 1
        wk.seq = self._seq
        if wk.dead:
            return
        t = self._next_event(wk, now)
        if t < math.inf:
            heapq.heappush(self.events, (max(t, now), w, wk.seq))

    def _next_event(self, wk: _EngineWorker, now: float) -> float:
        """The batch's end, or when the batcher starts the next one (inf: nothing to do)."""
        if wk.batch:
            return wk.busy_until
        if wk.held:
            ready = [h.ready_at for h in wk.held]
            return min(max(ready), min(ready) + self.a.batch_wait_s)
        return math.inf

    def _activate(self, wk: _EngineWorker, now: float):
        while wk.queue and len(wk.held) < self.a.worker_concurrency:
            h = wk.queue.popleft()
            h.start = h.ready_at = max(now, wk.down_until)
            wk.held.append(h)

    def _end_turn(self, wk: _EngineWorker, h: _Held, t: float) -> bool:
        """Request `h`'s generate call returned at `t`: the request ends, steps its environments (its next call
        waits from then), or (its failure turn) the process dies and every request it holds is lost (False)."""
        a = self.a
        h.turn += 1
        if h.turn - 1 == h.fail_turn:
            heapq.heappush(self.done, (t, h.handle))
            self.failed.add(h.handle)
            self.busy_s += t - h.start
            wk.dead, wk.held = True, []
            wk.queue.clear()
            wk.seq = -1
            return False
        if h.turn == a.turns:
            heapq.heappush(self.done, (t, h.handle))
            self.busy_s += t - h.start
            h.end = t
            wk.held.remove(h)
        else:
            tools = h.tools[:, h.turn - 1]
            h.ready_at = t + float(tools.max() if a.parallel_tools else tools.sum())
        return True

    def _step(self, w: int, t: float):
        a, wk = self.a, self.workers[w]
        if wk.batch and t >= wk.busy_until:
            for h in wk.batch:
                if not self._end_turn(wk, h, t):
                    wk.batch = []
                    return
            wk.batch = []
            self._activate(wk, t)
        if not wk.batch and wk.held:
            ready = [h.ready_at for h in wk.held]
            if t >= min(max(ready), min(ready) + a.batch_wait_s):
                self._start_batch(wk, [h for h in wk.held if h.ready_at <= t], t)
        self._schedule(w, t)

    def _start_batch(self, wk: _EngineWorker, batch: list, t: float):
        a = self.a
        L = np.concatenate([h.per_turn[:, h.turn] for h in batch])
        dl = a.decode_latency
        duration = dl * (float(L.max()) + float(L.sum()) / a.batch_knee)
        srt = np.sort(L)
        prefix = np.concatenate([[0], np.cumsum(srt)])
        for h in batch:
            chunks, k = _tag_steps(h.per_turn[:, h.turn], a.token_quantum)
            idx = np.searchsorted(srt, k)
            drawn = prefix[idx] + k * (len(srt) - idx)                   # rows' tokens decoded up to that step
            h.times.append((t + dl * (k + drawn / a.batch_knee), chunks))
        wk.batch, wk.busy_until = batch, t + duration
        self.batch_rows[len(L)] += 1
        self.engine_busy_s += duration

    @SimFleet._timed
    def submit(self, worker: int, request) -> int:
        a, now = self.a, self.clock.now
        self._advance(now)
        n = len(request.tasks) * a.group_size
        lengths, tools = self._draw(n)
        fail_turn = int(self.rng.integers(a.turns)) if self.rng.random() < a.failure_rate else -1
        self._ids += 1
        h = _Held(self._ids, worker, self.generation[worker], request, _per_turn(lengths, a.turns), tools, lengths,
                  fail_turn, times=[])
        self.jobs[self._ids] = h
        wk = self.workers[worker]
        if not wk.dead:
            wk.queue.append(h)
            self._enqueued(worker, now)
        return self._ids

    def _enqueued(self, w: int, now: float):
        """A request joined worker `w`'s queue at `now`."""
        wk = self.workers[w]
        self._activate(wk, now)
        if not wk.batch:
            self._schedule(w, now)

    @SimFleet._timed
    def wait(self, handles: list, timeout: float) -> list:
        """Every request finished by now; if none, the clock moves to the next finish (at most `timeout` ahead)."""
        limit = self.clock.now + timeout
        while True:
            while self.done and not self._live(self.done[0][1]):
                heapq.heappop(self.done)
            first = self.done[0][0] if self.done else math.inf
            if self.events and self.events[0][0] <= min(first, limit):
                self._advance(self.events[0][0])
                continue
            break
        if first > limit:
            self.clock.now = limit
            return []
        self.clock.now = max(self.clock.now, first)
        return self._pop_ready(self.done)

    @SimFleet._timed
    def result(self, handle: int) -> RolloutResult:
        h = self.jobs.pop(handle)
        if handle in self.failed:
            self.failed.discard(handle)
            raise WorkerLost("simulated worker failure")
        n, turns = len(h.lengths), self.a.turns
        chunks = np.stack([c for _, c in h.times], axis=1)             # [sequences, turns]
        per_turn_times = [np.split(t, np.cumsum(c)[:-1]) for t, c in h.times]
        times = np.concatenate([per_turn_times[turn][i] for i in range(n) for turn in range(turns)])
        return _result(self, h.request, h.lengths, chunks.reshape(-1), times, h.start, h.end)

    @SimFleet._timed
    def restart(self, worker: int, version: int, weights):
        self.generation[worker] += 1
        wk = self.workers[worker] = self._new_worker()
        wk.down_until = self.clock.now + self.a.restart_s

    def _new_worker(self) -> _EngineWorker:
        return _EngineWorker()

    def engine_rows(self) -> dict:
        """engine_batch_rows of --json: engine batches by their rows."""
        return dict(sorted(self.batch_rows.items()))


class _ContinuousWorker(_EngineWorker):
    """A worker's engine under continuous batching. `steps` counts its decode steps (each gives every row in the
    batch one token); between two events the batch, hence the step's cost, is constant, so `steps` is piecewise
    linear in time, with breakpoints (`bt`, `bs`) at the events since the oldest call in the batch joined."""

    def __init__(self):
        super().__init__()
        self.steps = 0.0
        self.rows: list = []        # heap: the step count at which each row in the batch finishes
        self.bt, self.bs = [0.0], [0.0]


class ContinuousRayWorkerFleet(RayWorkerFleet):
    """--worker ray --continuous-batching: rl/workers.py with --rl-continuous-batching. A worker's engine runs one
    decode loop; a generate call (one turn of a request's still-running episodes) joins its batch when it arrives,
    each row leaves when it finishes, and the call returns once its own rows have all finished. A decode step takes
    decode-latency x (1 + rows decoding / batch-knee). Requests, turns, tools, queueing and failures are as in
    RayWorkerFleet; --batch-wait-s does not apply. engine_batch_rows is time-weighted: the fraction of the engines'
    decoding time spent at each number of rows decoding."""

    EPS = 1e-6  # decode steps: a row whose finishing step is this close has finished (rounding)

    def _new_worker(self) -> _EngineWorker:
        return _ContinuousWorker()

    def _step_s(self, rows: int) -> float:
        return self.a.decode_latency * (1 + rows / self.a.batch_knee)

    def _next_event(self, wk: _ContinuousWorker, now: float) -> float:
        """The next row to finish at the current batch's pace, or the next call to arrive."""
        t = min((h.ready_at for h in wk.held if h not in wk.batch), default=math.inf)
        if wk.rows:
            t = min(t, now + (wk.rows[0] - wk.steps) * self._step_s(len(wk.rows)))
        return t

    def _enqueued(self, w: int, now: float):
        self._step(w, now)

    def _decode_until(self, wk: _ContinuousWorker, t: float):
        if not wk.rows:  # idle: no call in the batch refers back to earlier steps
            wk.bt, wk.bs = [t], [wk.steps]
            return
        dt = t - wk.bt[-1]
        if dt > 0:
            rows = len(wk.rows)
            wk.steps += dt / self._step_s(rows)
            wk.bt.append(t)
            wk.bs.append(wk.steps)
            self.batch_rows[rows] += dt
            self.engine_busy_s += dt

    def _step(self, w: int, t: float):
        wk = self.workers[w]
        self._decode_until(wk, t)
        done = wk.steps + self.EPS
        while wk.rows and wk.rows[0] <= done:
            heapq.heappop(wk.rows)
        for h in [h for h in wk.batch if h.target <= done]:
            wk.batch.remove(h)
            chunks, k = _tag_steps(h.per_turn[:, h.turn], self.a.token_quantum)
            h.times.append((np.maximum(self._time_at(wk, h.join_steps + k), h.join_t), chunks))
            if not self._end_turn(wk, h, t):
                wk.batch, wk.rows = [], []
                return
        if wk.batch and len(wk.bt) > 256:
            del wk.bt[:max(0, bisect.bisect_right(wk.bt, min(h.join_t for h in wk.batch)) - 1)]
            del wk.bs[:len(wk.bs) - len(wk.bt)]
        self._activate(wk, t)
        for h in wk.held:
            if h.ready_at <= t and h not in wk.batch:  # its call joins the batch
                per_turn = h.per_turn[:, h.turn]
                h.join_t, h.join_steps, h.target = t, wk.steps, wk.steps + float(per_turn.max())
                for n in per_turn.tolist():
                    heapq.heappush(wk.rows, wk.steps + n)
                wk.batch.append(h)
        self._schedule(w, t)

    @staticmethod
    def _time_at(wk: _ContinuousWorker, steps: np.ndarray) -> np.ndarray:
        """When the engine reached each of `steps` (its first time there)."""
        bt, bs = np.asarray(wk.bt), np.asarray(wk.bs)
        if len(bt) == 1:
            return np.full(len(steps), bt[0])
        i = np.clip(np.searchsorted(bs, steps, side="left"), 1, len(bs) - 1)
        ds = bs[i] - bs[i - 1]
        return bt[i - 1] + (steps - bs[i - 1]) * (bt[i] - bt[i - 1]) / np.where(ds > 0, ds, 1.0)

    def engine_rows(self) -> dict:
        total = sum(self.batch_rows.values()) or 1.0
        return {rows: round(s / total, 4) for rows, s in sorted(self.batch_rows.items())}

    def rows_mean(self) -> float:
        """Rows decoding, averaged over the engines' decoding time."""
        return sum(r * s for r, s in self.batch_rows.items()) / (sum(self.batch_rows.values()) or 1.0)


def simulate(a: argparse.Namespace, staleness: int) -> dict:
    """One run at --staleness `staleness`: the trainer's loop of rl/trainer.py (next_batch, train, publish) with
    the real orchestrator and ledger. Python's cyclic collector is off meanwhile: the simulated groups are
    millions of small objects, and scanning them took 70% of the simulation's CPU (none form cycles)."""
    gc.disable()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the ledger fsyncs its log every step
    try:
        with tempfile.TemporaryDirectory(prefix="rl_async_sim_", dir=shm) as log_dir:
            return _simulate(a, staleness, log_dir)
    finally:
        gc.enable()


def _simulate(a: argparse.Namespace, staleness: int, log_dir: str) -> dict:
    clock = Clock()
    ray = ContinuousRayWorkerFleet if a.continuous_batching else RayWorkerFleet
    fleet = (ray if a.worker == "ray" else SimFleet)(a, clock, version=0)
    P = a.prompts_per_step
    tasks = [{"id": f"p{i}"} for i in range(P * a.steps)]
    ledger = Ledger([t["id"] for t in tasks], log_dir=log_dir)
    cfg = OrchestratorConfig(P, staleness, prompts_per_request=a.prompts_per_request,
                             requests_per_worker=a.requests_per_worker, request_timeout_s=a.request_timeout,
                             max_worker_restarts=10 ** 9, seed=a.seed, poll_s=1e9)
    orch = Orchestrator(cfg, fleet, ledger, {t["id"]: t for t in tasks}, version=0, weights=dict,
                        log=lambda *x, **k: None, clock=clock)
    cpu, waited, hist, trained_samples, first_end = 0.0, 0.0, np.zeros(0, np.int64), 0, None
    restarts = 0
    for step in range(a.steps + 1):
        c0, f0, t0 = time.process_time(), fleet.cpu_s, clock.now
        out = orch.next_batch(step)
        cpu += time.process_time() - c0 - (fleet.cpu_s - f0)
        if out is None:
            break
        groups, m = out
        if step:
            waited += clock.now - t0
        if m["staleness max"] > staleness:
            raise AssertionError(f"staleness {m['staleness max']} > {staleness} at step {step}")
        hist = _add(hist, np.bincount(orch.last_staleness.astype(np.int64)))
        restarts += int(m["worker restarts"])
        ledger.log_trained(step, groups)
        tokens = sum(fleet.tokens[g.prompt_id] for g in groups)
        clock.now += a.train_fixed_s + tokens * a.train_token_s
        if step:
            trained_samples += sum(len(g.rollouts) for g in groups)
        c0, f0 = time.process_time(), fleet.cpu_s
        orch.publish(step + 1)
        cpu += time.process_time() - c0 - (fleet.cpu_s - f0)
        if step == 0:
            first_end = clock.now
    counts = trained_counts(log_dir)
    samples = P * a.steps * a.group_size
    wall = clock.now - first_end
    return {"samples_per_s": trained_samples / wall, "wall_s": clock.now, "step_s": wall / (a.steps - 1),
            "trainer_idle": waited / wall,
            "worker_utilisation": fleet.busy_s / (clock.now * a.workers * a.worker_concurrency),
            "engine_busy": getattr(fleet, "engine_busy_s", math.nan) / (clock.now * a.workers),
            "engine_batch_rows": fleet.engine_rows() if hasattr(fleet, "engine_rows") else {},
            "engine_rows_mean": fleet.rows_mean() if hasattr(fleet, "rows_mean") else math.nan,
            "staleness_max": int(len(hist) - 1), "staleness_hist": (hist / max(hist.sum(), 1)).round(4).tolist(),
            "prompts_trained_once": sorted(counts) == sorted(t["id"] for t in tasks) and
            set(counts.values()) == {1} and ledger.exhausted,
            "orchestrator_cpu_ms_per_sample": 1e3 * cpu / samples, "orchestrator_cpu_s": cpu,
            "worker_restarts": restarts}


def _add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    n = max(len(x), len(y))
    return np.pad(x, (0, n - len(x))) + np.pad(y, (0, n - len(y)))


def run(a: argparse.Namespace, sync: dict | None = None) -> dict:
    out = simulate(a, a.staleness)
    sync = out if a.staleness == 0 else sync or simulate(a, 0)
    out["speedup"] = out["samples_per_s"] / sync["samples_per_s"]
    out["sync_samples_per_s"] = sync["samples_per_s"]
    out["sync_trainer_idle"] = sync["trainer_idle"]
    out["sync_worker_utilisation"] = sync["worker_utilisation"]
    out.update(workers=a.workers, staleness=a.staleness, prompts_per_step=a.prompts_per_step,
               group_size=a.group_size, steps=a.steps, seed=a.seed)
    return out


# docs/benchmarks.md, "Asynchronous RL: sync vs async throughput" (idle re-run, 2026-12-01): per run, the
# synchronous step's wait for rollouts (the generation time), the trainer's reference + training seconds of the
# synchronous and of the asynchronous run, publication seconds, and the measured async / sync samples per second
MEASURED = [
    # name, flags of benchmarks/rl_async.py, workers, P, G, response tokens, sync wait, sync ref+train,
    # async ref+train, publish, measured ratio
    ("after warm-up #1", "", 2, 8, 8, 2, 0.057, 0.165 + 0.351, 0.197 + 0.396, 0.013, 104.495 / 108.955),
    ("after warm-up #2", "", 2, 8, 8, 2, 0.051, 0.140 + 0.303, 0.141 + 0.299, 0.011, 140.895 / 126.509),
    ("untrained 24 tokens", "--sizes", 2, 8, 8, 22, 0.205, 0.277 + 0.555, 0.326 + 0.649, 0.011, 64.500 / 61.022),
    ("balanced run 1", "--workers 1 --scratch-length 48 --prompts-per-step 4 --group-size 4", 1, 4, 4, 48, 0.348,
     0.125 + 0.245, 0.140 + 0.265, 0.012, 37.545 / 21.885),
    ("balanced run 2", "--workers 1 --scratch-length 48 --prompts-per-step 4 --group-size 4", 1, 4, 4, 48, 0.370,
     0.135 + 0.267, 0.146 + 0.315, 0.013, 33.092 / 20.355),
]


def validate(seed: int = 0) -> list[dict]:
    """The measured configurations, fed their measured times: the generation of a step is the synchronous run's
    wait (its requests run one after another on each worker, prompts per request as --rl-prompts-per-request
    0 chooses), the trainer's step is each run's own reference + training time (on two shared cores the workers'
    decoding slows the trainer while they overlap; the simulation has no such contention, so it is given the
    time measured under it)."""
    rows = []
    for name, _, workers, P, G, tokens, wait, train0, train1, publish, measured in MEASURED:
        per_request = max(1, P // (2 * workers))
        sequential = math.ceil(P / per_request / workers)
        argv = ["--workers", str(workers), "--prompts-per-step", str(P), "--group-size", str(G),
                "--prompts-per-request", str(per_request), "--length-median", str(tokens), "--length-sigma", "0",
                "--max-length", str(tokens), "--turns", "1", "--tool-latency", "0", "--batch-knee", "1e12",
                "--decode-latency", str(wait / (sequential * tokens)), "--failure-rate", "0", "--steps", "16",
                "--train-token-s", "0", "--weights-gb", str(publish), "--bandwidth-gbs", "1", "--seed", str(seed)]
        a = parser().parse_args(argv + ["--train-fixed-s", str(train0)])
        check(a)
        sync = simulate(a, 0)
        a = parser().parse_args(argv + ["--train-fixed-s", str(train0), "--staleness", "1"])
        check(a)
        uncontended = simulate(a, 1)["samples_per_s"] / sync["samples_per_s"]
        a = parser().parse_args(argv + ["--train-fixed-s", str(train1), "--staleness", "1"])
        check(a)
        out = simulate(a, 1)
        ratio = out["samples_per_s"] / sync["samples_per_s"]
        rows.append({"run": name, "measured": measured, "simulated": ratio, "error": ratio / measured - 1,
                     "uncontended": uncontended,
                     "staleness_max": out["staleness_max"], "prompts_trained_once": out["prompts_trained_once"]})
    return rows


SWEEP_WORKERS = (64, 256, 1024, 4096)
DESIGNS = (("Ray workers", [], "-o"), ("Ray workers, late binding", ["--requests-per-worker", "1"], ":^"),
           ("Ray workers batching x4", ["--requests-per-worker", "4", "--worker-concurrency", "4"], "-.D"),
           ("batching servers x4", ["--worker", "server", "--requests-per-worker", "4", "--worker-concurrency", "4"],
            "--s"),
           ("Ray workers, continuous batching x4",
            ["--continuous-batching", "--requests-per-worker", "4", "--worker-concurrency", "4"], "-v"))
SWEEP_K = (0, 1, 2, 3, 4)


def sweep(a: argparse.Namespace, extra: list[str]) -> list[dict]:
    """N x K at the default (long-tailed) settings for the DESIGNS: Ray workers running one request at a time
    with one queued (the default flags), the same with one request per worker (--requests-per-worker 1, late
    binding), Ray workers batching four requests (--rl-requests-per-worker 4 --rl-worker-concurrency 4),
    continuous-batching servers with four request slots each (--worker server), and Ray workers batching four
    requests continuously (the same with --continuous-batching); one synchronous run per N and design."""
    rows = []
    for design, flags, _ in DESIGNS:
        if a.design and design not in a.design:
            continue
        for n in a.sweep_workers or SWEEP_WORKERS:
            sync = None
            for k in SWEEP_K:
                b = parser().parse_args(extra + flags + ["--workers", str(n), "--staleness", str(k), "--steps",
                                                         str(a.steps)])
                check(b)
                t0 = time.process_time()
                out = run(b, sync)
                if k == 0:
                    sync = out
                out.update(design=design, sim_cpu_s=time.process_time() - t0)
                rows.append(out)
                print(json.dumps(out), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| design | N | K | speedup | trainer idle | worker util | engine busy | staleness histogram (0, 1, ..) | "
            "orchestrator CPU ms/sample |\n|---|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['design']} | {r['workers']} | {r['staleness']} | {r['speedup']:.2f} | {r['trainer_idle']:.2f} | "
        f"{r['worker_utilisation']:.2f} | {'-' if math.isnan(r['engine_busy']) else format(r['engine_busy'], '.2f')} | "
        f"{' / '.join(f'{x:.2f}' for x in r['staleness_hist'])} | {r['orchestrator_cpu_ms_per_sample']:.3f} |\n"
        for r in rows)


def plot(rows: list[dict], path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 5.2))
    for d, (design, _, style) in enumerate(DESIGNS):
        for i, n in enumerate(SWEEP_WORKERS):
            rs = [r for r in rows if r["design"] == design and r["workers"] == n]
            if not rs:
                continue
            ks = [r["staleness"] for r in rs]
            label = f"{design}, N={n}"
            axes[0].plot(ks, [r["speedup"] for r in rs], style, color=f"C{i}", label=label)
            axes[1].plot(ks, [r["trainer_idle"] for r in rs], style, color=f"C{i}")
            axes[1].plot(ks, [r["worker_utilisation"] for r in rs], style, color=f"C{i}", alpha=0.4)
            if n == 1024:
                for r in rs:
                    h = r["staleness_hist"]
                    axes[2].bar(np.arange(len(h)) + 0.16 * r["staleness"] - 0.35 + 0.032 * d, h, width=0.032,
                                color=f"C{r['staleness']}", alpha=1.0 - 0.8 * d / len(DESIGNS),
                                label=f"K={r['staleness']}" if d == 0 else None)
        rs = [r for r in rows if r["design"] == design and r["staleness"] == 2]
        axes[3].plot([r["workers"] for r in rs], [r["orchestrator_cpu_ms_per_sample"] for r in rs], style,
                     color=f"C{d + 5}", label=f"{design}, K=2")
    axes[0].axhline(2.5, color="grey", lw=0.8, ls=":")
    axes[0].set(xlabel="K (--rl-max-staleness)", ylabel="async / sync samples per second", title="speed-up")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=7)
    axes[1].set(xlabel="K", ylabel="fraction", title="trainer idle (dark), worker utilisation (light)")
    axes[2].set(xlabel="token staleness (versions)", ylabel="fraction of tokens", title="staleness, N=1024")
    axes[2].legend(fontsize=7)
    axes[3].set(xscale="log", xlabel="workers", ylabel="ms per sample", title="orchestrator CPU")
    axes[3].axhline(1.0, color="grey", lw=0.8, ls=":")
    axes[3].legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=110)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("cluster and run")
    g.add_argument("--workers", type=int, default=1024, help="rollout workers (engine replicas)")
    g.add_argument("--staleness", type=int, default=2, help="--rl-max-staleness K (0: synchronous)")
    g.add_argument("--steps", type=int, default=12, help="trainer steps")
    g.add_argument("--prompts-per-step", type=int, default=0, help="P (default: one per worker)")
    g.add_argument("--group-size", type=int, default=8, help="G samples per prompt")
    g.add_argument("--prompts-per-request", type=int, default=1, help="--rl-prompts-per-request")
    g.add_argument("--requests-per-worker", type=int, default=2,
                   help="requests the orchestrator keeps in flight per worker (its requests_per_worker)")
    g.add_argument("--worker", choices=("ray", "server"), default="ray",
                   help="ray: rl/workers.py's Ray worker (turns batched across its running requests); server: a "
                        "continuous-batching server behind --rl-remote-servers slots (every sequence on its own)")
    g.add_argument("--worker-concurrency", type=int, default=1,
                   help="requests a worker runs at once (--rl-worker-concurrency; server: its batch), the rest of "
                        "--requests-per-worker wait in its queue")
    g.add_argument("--batch-wait-s", type=float, default=0.05,
                   help="ray: a turn waits this long at most for the worker's other requests (WorkerConfig)")
    g.add_argument("--continuous-batching", action="store_true",
                   help="ray: mirrors rl_composer's --rl-continuous-batching: a worker's engine runs one decode "
                        "loop, a request's generate call joins it when it arrives, each row leaves when it finishes "
                        "and the call returns once its own rows have (no --batch-wait-s); requests beyond "
                        "--worker-concurrency still queue")
    g.add_argument("--parallel-tools", action="store_true",
                   help="ray: a request's episodes call their tools at once (run_groups steps them in sequence)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("rollouts")
    g.add_argument("--length-median", type=float, default=26000.0,
                   help="tokens per episode, median (fitted to published SWE-agent trajectory lengths: "
                        "docs/benchmarks.md, issue 29)")
    g.add_argument("--length-sigma", type=float, default=0.56, help="lognormal sigma of the episode length (fitted)")
    g.add_argument("--max-length", type=int, default=131072, help="response length cap (--grpo-max-response-length)")
    g.add_argument("--turns", type=int, default=8, help="model turns per episode (a tool call between two)")
    g.add_argument("--tool-latency", type=float, default=2.0, help="seconds per tool call, median")
    g.add_argument("--tool-sigma", type=float, default=1.0)
    g.add_argument("--decode-latency", type=float, default=0.02, help="seconds per decode step at batch 1")
    g.add_argument("--batch-knee", type=float, default=64.0, help="batch at which a decode step takes twice as long")
    g.add_argument("--failure-rate", type=float, default=0.001, help="probability that a request's worker dies")
    g.add_argument("--restart-s", type=float, default=60.0, help="seconds to replace a lost worker")
    g.add_argument("--request-timeout", type=float, default=86400.0, help="--rl-rollout-timeout")
    g.add_argument("--token-quantum", type=int, default=2048, help="tokens per version tag carried (accounting)")
    g = p.add_argument_group("trainer")
    g.add_argument("--train-token-s", type=float, default=1.5e-6, help="trainer seconds per response token")
    g.add_argument("--train-fixed-s", type=float, default=5.0, help="trainer seconds per step besides tokens")
    g.add_argument("--planner-model", default="",
                   help="instead of --train-token-s: megatron_ext/planning.py's fastest layout for this preset "
                        "(e.g. kimi-k2.5) on --trainer-gpus, its tokens per second x 3/4 (the reference pass)")
    g.add_argument("--trainer-gpus", type=int, default=512)
    g.add_argument("--trainer-gpu", default="h200", help="a GPU of megatron_ext/planning.py's GPUS")
    g.add_argument("--weights-gb", type=float, default=1040.0, help="bytes published per step (GB)")
    g.add_argument("--bandwidth-gbs", type=float, default=100.0, help="publication bandwidth (GB/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", action="store_true", help="N = 64..4096 x K = 0..4 for five designs: a markdown table")
    p.add_argument("--design", action="append", default=[], choices=[d for d, _, _ in DESIGNS],
                   help="with --sweep: only this design (repeatable)")
    p.add_argument("--plot", default="", help="with --sweep: write the figure here (docs/rl_async_sim.png)")
    p.add_argument("--sweep-workers", type=int, action="append", default=[],
                   help="with --sweep: only this N (repeatable)")
    p.add_argument("--rows", action="append", default=[],
                   help="the table (and --plot) from these files of the sweep's JSON lines instead of running it")
    p.add_argument("--validate", action="store_true", help="the runs measured on this machine, simulated")
    return p


def check(a: argparse.Namespace):
    for name in ("workers", "steps", "group_size", "prompts_per_request", "requests_per_worker",
                 "worker_concurrency", "turns",
                 "max_length", "token_quantum"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if a.staleness < 0 or a.prompts_per_step < 0:
        raise SystemExit("--staleness and --prompts-per-step must be >= 0")
    if a.steps < 2:
        raise SystemExit("--steps must be >= 2 (throughput counts the steps after the first)")
    for name in ("length_median", "decode_latency", "batch_knee", "bandwidth_gbs"):
        if getattr(a, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if a.batch_wait_s < 0:
        raise SystemExit("--batch-wait-s must be >= 0")
    if not 0 <= a.failure_rate < 1:
        raise SystemExit("--failure-rate must be in [0, 1)")
    if a.continuous_batching and a.worker != "ray":
        raise SystemExit("--continuous-batching applies to --worker ray (a --worker server batches continuously)")
    a.prompts_per_step = a.prompts_per_step or a.workers
    if a.planner_model:
        a.train_token_s = planner_token_s(a)


def planner_token_s(a: argparse.Namespace) -> float:
    """Trainer seconds per token from the planner's fastest layout that fits (sequences of --max-length, a batch of
    P x G); a step is a training pass plus a reference forward pass (about a third of one), hence 4/3."""
    from megatron_ext import planning
    from megatron_ext.models.presets import get_preset

    try:
        model, gpu = get_preset(a.planner_model), planning.GPUS[a.trainer_gpu]
    except (ValueError, KeyError):
        raise SystemExit(f"--planner-model {a.planner_model!r} / --trainer-gpu {a.trainer_gpu!r}: choose a preset of "
                         f"megatron_ext/models/presets.py and one of {sorted(planning.GPUS)}") from None
    work = planning.Workload(a.max_length, a.prompts_per_step * a.group_size)
    fits = planning.plan(model, gpu, a.trainer_gpus, work)
    if not fits:
        raise SystemExit(f"--planner-model {a.planner_model}: no layout fits on {a.trainer_gpus} {a.trainer_gpu} GPUs")
    return 4 / 3 / fits[0].tokens_per_s


def main(argv=None):
    a = parser().parse_args(argv)
    check(a)
    if a.validate:
        rows = validate(a.seed)
        print("| run | measured async / sync | simulated | error | simulated, no contention |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['measured']:.2f} | {r['simulated']:.2f} | {100 * r['error']:+.0f}% | "
                  f"{r['uncontended']:.2f} |")
        return
    if a.rows:
        rows = {}
        for path in a.rows:
            with open(path) as f:
                for line in f:
                    if line.startswith("{"):
                        r = json.loads(line)
                        rows.setdefault((r["design"], r["workers"], r["staleness"]), r)
        order = {d: i for i, (d, _, _) in enumerate(DESIGNS)}
        rows = [rows[k] for k in sorted(rows, key=lambda k: (order[k[0]], k[1], k[2]))]
        print(table(rows))
        if a.plot:
            plot(rows, a.plot)
        return
    if a.sweep:
        argv = list(argv if argv is not None else sys.argv[1:])
        own = ("--design", "--sweep-workers")
        extra = [x for i, x in enumerate(argv) if x not in ("--sweep", "--plot", a.plot, "--json") + own
                 and (i == 0 or argv[i - 1] not in own)]
        rows = sweep(a, extra)
        print(table(rows))
        if a.plot:
            plot(rows, a.plot)
        return
    out = run(a)
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
