"""The asynchronous orchestrator's `Fleet` over remote inference servers (--rl-remote-servers with
--rl-rollout-workers N): rollouts generate on SGLang-native servers (ours: tools/serve.py), not on Ray actors.

    worker w = one request slot on server w mod S (N slots over S servers; a slot runs one request at a time)
        | submit: a thread of rank 0 runs the request's episodes: environments here, every generate call an HTTP
        |         /generate to the slot's server (RemoteGenerate over that one server)
        v
    RolloutResult (tokens carry the versions the server reports per token: staleness is measured, not assumed)

    publish(version): the trainer has written DIR/v<version> (a weights-only checkpoint, every rank its shards);
        every live server loads it (POST /update_weights_from_disk) and reports the version before publish returns,
        so a request dispatched afterwards draws its first token from weights at least that new (the admission
        gate's guarantee). Our server swaps weights between engine calls (one request's tokens share a version), so
        a multi-turn rollout in progress continues its later turns on the new weights, and its tokens say so.

Faults: a server that dies, closes the connection or times out (`ServerUnavailable`) fails the requests it held;
the orchestrator requeues their prompts at the queue's front and calls `restart`, which probes the server and,
when it is down, moves every slot it had to the live servers (fewest slots first). A server that answers wrongly
(`RequestRejected`, `BadResponse`) stops the run with its message; so does losing every server, or a live server
failing to load the weights.

Environments run on rank 0's threads (one per slot): right for cheap environments (digits, the scripted tools);
sandboxed coding environments are processes of their own anyway (env/sandbox), so the threads only wait on them.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Callable, Sequence

from megatron_ext.rl.orchestrator import RolloutRequest, RolloutResult, WorkerFailure, WorkerLost
from megatron_ext.rl.remote import ReloadFailed, RemoteGenerate, RemoteServerError, ServerUnavailable
from megatron_ext.rl.rollout import run_groups
from megatron_ext.rl.workers import WorkerConfig, timed_envs


class RemoteFleet:
    """`Fleet` (orchestrator.py) whose workers are request slots on remote servers; `path_of(version)` is the
    directory the trainer wrote that version's weights to."""

    def __init__(self, urls: Sequence[str], workers: int, cfg: WorkerConfig, make_env, path_of: Callable[[int], str],
                 speculative: bool = False, log=print):
        urls = [u.rstrip("/") for u in urls]
        if workers < len(urls):
            raise ValueError(f"--rl-rollout-workers {workers} is fewer than the {len(urls)} --rl-remote-servers: "
                             "give at least one request slot per server")
        self.urls, self.size, self.cfg, self.make_env, self.path_of, self.log = \
            urls, workers, cfg, make_env, path_of, log
        self.clients = {u: RemoteGenerate([u], speculative=speculative) for u in urls}
        self.server_of = [urls[w % len(urls)] for w in range(workers)]
        self.dead: set[str] = set()
        self._lock = threading.Lock()

    def live(self) -> list[str]:
        return [u for u in self.urls if u not in self.dead]

    # ---- Fleet ---------------------------------------------------------------------------------------------------
    def submit(self, worker: int, request: RolloutRequest) -> Future:
        """The request on a daemon thread of its own: one abandoned by the orchestrator (timed out, its server
        hung) never holds up another request, nor the process's exit."""
        future, url = Future(), self.server_of[worker]

        def run():
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self._rollout(url, request))
            except BaseException as e:  # noqa: BLE001 (handed to the orchestrator's thread by result())
                future.set_exception(e)

        threading.Thread(target=run, daemon=True, name=f"remote-rollout-{worker}").start()
        return future

    def _rollout(self, url: str, request: RolloutRequest) -> RolloutResult:
        t0 = time.perf_counter()
        ep = self.cfg.episode
        episode = replace(ep, sampling=replace(ep.sampling, seed=request.seed))
        make_env = timed_envs(self.make_env, self.cfg.env_timeout_s)
        client = self.clients[url]
        groups = run_groups(request.tasks, make_env, client, episode, self.cfg.std_normalize)
        versions = sorted({v for g in groups for r in g.rollouts for s in r.segments if s.trainable
                           for v in s.versions})
        # the server's weights changed under the request (an in-flight reload) once per version after the first
        return RolloutResult(request.request_id, groups, versions[0] if versions else request.min_version,
                             time.perf_counter() - t0, swaps=max(0, len(versions) - 1),
                             speculation=client.pop_speculation())

    def wait(self, handles: list, timeout: float) -> list:
        done, _ = wait(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle) -> RolloutResult:
        try:
            return handle.result()
        except ServerUnavailable as e:
            raise WorkerLost(f"server unavailable: {e}") from e
        except RemoteServerError as e:  # a 4xx or a protocol mismatch: sending it elsewhere fails alike
            raise WorkerLost(f"server error that retrying cannot fix: {type(e).__name__}: {e}", fatal=True) from e

    def restart(self, worker: int, version: int, weights=None):
        """A slot's request failed: when its server does not answer, every slot on it moves to the live servers."""
        url = self.server_of[worker]
        if url not in self.dead and self._answers(url):
            return  # a transient failure (a 5xx, an abort, a timeout): the slot stays
        self._mark_dead(url)

    def _answers(self, url: str) -> bool:
        try:
            self.clients[url].version_of(url)
            return True
        except RemoteServerError:
            return False

    def _mark_dead(self, url: str):
        with self._lock:
            if url in self.dead:
                return
            self.dead.add(url)
            live = self.live()
            if not live:
                raise WorkerFailure(f"every --rl-remote-servers server is down (the last: {url}): restart them and "
                                    "resume the run from its checkpoint (--load)")
            moved = [w for w, u in enumerate(self.server_of) if u == url]
            for w in moved:
                load = {u: sum(1 for x in self.server_of if x == u) for u in live}
                self.server_of[w] = min(live, key=lambda u: (load[u], live.index(u)))
        self.log(f"remote server {url} is down: its {len(moved)} request slot(s) moved to {live}", flush=True)

    def publish(self, version: int, weights=None) -> dict[str, float]:
        """Every live server loads DIR/v<version> and reports `version` before this returns. A server that stopped
        answering is dropped (its slots move); one that answers but cannot load the weights stops the run."""
        t0 = time.perf_counter()
        path = self.path_of(version)
        live = self.live()
        try:
            RemoteGenerate(live).reload(path, version)
        except ReloadFailed as e:
            down = [u for u in live if not self._answers(u)]
            for u in down:
                self._mark_dead(u)
            stuck = [u for u in self.live() if self._version(u) != version]
            if stuck:
                raise WorkerFailure(f"weights version {version} ({path}) not loaded by {stuck}: {e}") from e
        size = float(sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files))
        return {"publish seconds": time.perf_counter() - t0, "publish bytes": size, "publish bytes full": size}

    def _version(self, url: str):
        try:
            return self.clients[url].version_of(url)
        except RemoteServerError:
            return None

    def close(self):
        """Nothing to stop: requests still running belong to daemon threads and their results are dropped."""
