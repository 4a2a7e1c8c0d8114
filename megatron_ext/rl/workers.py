"""Rollout workers as Ray actors, and the Ray fleet the orchestrator drives.

A worker is one process: a generation backend (by default an InferenceEngine on the trainer's model code, built
by the same model provider, single rank) plus its environments; it runs whole groups (G samples per prompt,
multi-turn episodes, rewards) and returns them. Weights arrive on a second actor thread (`stage`) while the first
one generates; the generating thread applies the newest staged weights before each generate call and between
decode steps (the engine's `between_steps` hook), so a long rollout continues on new weights and every token
records the version that drew it.

The backend is any factory returning an object with `generate` (a GenerateFn), `apply(weights, version)` and
`version`, optionally `set_between_steps(fn)`; `EngineBackend` is the local engine. The fleet takes such a
factory, so a client of remote inference servers is another backend, not another worker.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_ext.rl.env import Environment, StepResult
from megatron_ext.rl.orchestrator import RolloutRequest, RolloutResult, WorkerFailure, WorkerLost
from megatron_ext.rl.rollout import EngineGenerate, EpisodeConfig, run_groups
from megatron_ext.rl.types import Reward

# launcher variables a Ray worker inherits from the torchrun rank that started Ray: a worker is its own
# one-rank job and must not join the trainer's rendezvous (TORCHELASTIC_USE_AGENT_STORE alone makes a tcp://
# init wait forever for an agent's store), so these and every TORCHELASTIC_* variable are dropped
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class FleetConfig:
    """How the trainer runs generation outside itself (rl_composer.py's --rl-rollout-workers group)."""
    workers: int
    max_staleness: int = 0
    ray_address: Optional[str] = None
    prompts_per_request: int = 0       # 0: prompts per step / (2 x workers), at least 1
    requests_per_worker: int = 2       # in flight per worker (--rl-requests-per-worker)
    concurrency: int = 1               # of those, decoded together by a worker (--rl-worker-concurrency)
    continuous_batching: bool = False  # their turns join one decode batch between steps (--rl-continuous-batching)
    request_timeout_s: float = 600.0
    env_timeout_s: float = 300.0
    delta: bool = True                 # publish only changed tensors when that is fewer bytes

    def per_request(self, prompts_per_step: int) -> int:
        return self.prompts_per_request or max(1, prompts_per_step // (2 * self.workers))


@dataclass
class WorkerConfig:
    episode: EpisodeConfig
    std_normalize: bool = False
    env_timeout_s: float = 300.0   # an environment call (step / score) running longer ends its episode
    threads: int = 1               # torch intra-op threads of the worker process
    batch_wait_s: float = 0.05     # a turn waits this long at most for the worker's other requests to join its batch
    continuous_batching: bool = False  # calls join the decode batch between steps (--rl-continuous-batching)


# ---- weights across processes ------------------------------------------------------------------------------
def pack_weights(weights: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """Host numpy arrays (zero-copy readable from Ray's object store); bf16/fp16 travel as raw 16-bit words."""
    out = {}
    for name, t in weights.items():
        t = t.detach().to("cpu", copy=False).contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            out[name] = (t.view(torch.int16).numpy(), str(t.dtype).split(".")[1])
        else:
            out[name] = (t.numpy(), "")
    return out


def unpack_weights(packed: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    out = {}
    with warnings.catch_warnings():  # arrays in the object store are read-only; they are only copied from
        warnings.simplefilter("ignore", UserWarning)
        for name, (arr, dtype) in packed.items():
            t = torch.from_numpy(arr)
            out[name] = t.view(getattr(torch, dtype)) if dtype else t
    return out


def packed_bytes(packed: dict) -> int:
    return sum(a.nbytes for a, _ in packed.values())


# ---- environments with a time limit ------------------------------------------------------------------------
def timed_envs(make_env: Callable[[], Environment], timeout_s: float) -> Callable[[], Environment]:
    """make_env's environments wrapped in TimedEnv (unchanged when timeout_s is 0/None), keeping the factory's
    `concurrency` (rollout.run_groups runs that many environment calls at once; each TimedEnv is its own)."""
    if not timeout_s:
        return make_env

    def make() -> Environment:
        return TimedEnv(make_env(), timeout_s)

    make.concurrency = getattr(make_env, "concurrency", 1)
    return make


class TimedEnv:
    """An environment whose step / score run in a helper thread for at most `timeout_s`: a hung environment ends
    its episode (scored 0 with an error naming the timeout) instead of holding the worker forever."""

    def __init__(self, env: Environment, timeout_s: float):
        self.env, self.timeout_s, self.timed_out = env, timeout_s, None

    def _call(self, name, *a):
        box = {}

        def run():
            try:
                box["value"] = getattr(self.env, name)(*a)
            except BaseException as e:  # re-raised in the calling thread
                box["error"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self.timed_out = f"environment {name}() still running after {self.timeout_s:g} s (--rl-env-timeout)"
            return None
        if "error" in box:
            raise box["error"]
        return box["value"]

    def reset(self, task):
        return self.env.reset(task)

    def step(self, tokens) -> StepResult:
        if self.timed_out:
            return StepResult([], True)
        out = self._call("step", tokens)
        return StepResult([], True) if self.timed_out else out

    def score(self):
        if not self.timed_out:
            out = self._call("score")
            if not self.timed_out:
                return out
        return Reward({}, 0.0, self.timed_out)

    def close(self):
        if hasattr(self.env, "close"):
            self.env.close()


# ---- the local engine backend ------------------------------------------------------------------------------
def worker_model_args(args: argparse.Namespace) -> argparse.Namespace:
    """The trainer's flags for a one-process replica: same architecture, no parallelism, nothing loaded (the
    weights come from the trainer) or saved."""
    a = copy.copy(args)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "world_size"):
        if hasattr(a, name):
            setattr(a, name, 1)
    a.load = a.save = None  # (with a save target its initialize_distributed would start a checkpoint writer queue)
    a.sequence_parallel = False
    return a


class EngineBackend:
    """An InferenceEngine on a fresh one-rank replica of the trainer's model (Megatron-Core's parallel state of
    size 1 in this process; weights until the first `apply` are the initialisation's)."""

    def __init__(self, model_args: argparse.Namespace, speculative: bool = False, draft_depth: Optional[int] = None,
                 speculation_policy: str = "always", prefix_cache_mb: float = 0):
        from megatron_ext.inference.engine import InferenceEngine
        from megatron_ext.training.initialize import initialize_distributed
        from megatron_ext.training.step import build_model

        initialize_distributed(model_args)
        self.model_args = model_args
        self.model = build_model(model_args, wrap_ddp=False)
        self.model[0].eval()
        self.engine = InferenceEngine(self.model[0], weights_version=-1)
        # MTP speculation (--rl-speculative) decodes request by request: weights then swap between generate calls
        self.generate = EngineGenerate(self.engine, speculative=speculative, draft_depth=draft_depth,
                                       speculation_policy=speculation_policy)
        if not speculative:  # an episode's next turn continues its last turn's cache (multi-turn runs only)
            self.engine.enable_prefix_store(prefix_cache_mb)

    @property
    def version(self) -> int:
        return self.engine.weights_version

    def apply(self, weights: dict[str, torch.Tensor], version: int):
        self.engine.update_weights(weights.items(), version=version, strict=False)

    def apply_path(self, path: str, version: int):
        """The weights of a (weights-only) checkpoint directory written by a trainer of any TP/EP layout:
        Megatron's dist_checkpointing reshards them onto this one-rank replica, in place."""
        from megatron_ext.training.checkpointing import load_weights

        load_weights(self.model_args, self.model, path, log=lambda *a, **k: None)
        self.engine.weights_version = version

    def set_between_steps(self, fn: Callable[[], bool]):
        self.engine.between_steps = fn


@dataclass
class EngineBackendFactory:
    model_args: argparse.Namespace
    speculative: bool = False
    draft_depth: Optional[int] = None
    speculation_policy: str = "always"
    prefix_cache_mb: float = 0  # --rl-prefix-cache-mb where episodes have several turns, else 0

    def __call__(self) -> EngineBackend:
        return EngineBackend(self.model_args, self.speculative, self.draft_depth, self.speculation_policy,
                             self.prefix_cache_mb)


# ---- several requests, one engine ----------------------------------------------------------------------------
@dataclass
class _Pending:
    calls: list
    since: float
    out: Any = None
    done: bool = False


class _Holding:
    """What both batchers share: the requests the worker holds, and one call as a batch of one."""

    def __init__(self):
        self.max_sequence_length: Optional[int] = None
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._holders = 0
        self._busy = False

    def hold(self, delta: int):
        """A request arrives at (+1) or leaves (-1) the worker."""
        with self._cond:
            self._holders += delta
            self._cond.notify_all()

    @property
    def holders(self) -> int:
        return self._holders

    def __call__(self, prompts, n, sampling):
        return self.many([(prompts, n, sampling)])[0]


class Batcher(_Holding):
    """The generate calls of every request a worker holds, decoded as one engine batch (--rl-worker-concurrency).

    Each request runs its episodes on its own thread; a turn's call waits here until every request the worker
    holds has a call waiting too (or `wait_s` passed: one in a tool call does not hold the others up), then one of
    the waiting threads runs them all through `run` while calls that arrive meanwhile gather for the next batch.
    Only that thread touches the engine, so weights are swapped (`before`, and the engine's between-steps hook)
    between decode steps of a batch, never inside one, and every token still records the version that drew it."""

    def __init__(self, run: Callable[[list], list], before: Callable[[], Any], wait_s: float):
        super().__init__()
        self.run, self.before, self.wait_s = run, before, wait_s

    def many(self, calls: list) -> list:
        me = _Pending(calls, time.monotonic())
        with self._cond:
            self._pending.append(me)
            self._cond.notify_all()
            while not me.done:
                if self._busy:
                    self._cond.wait()
                    continue
                left = self._pending[0].since + self.wait_s - time.monotonic()
                if len(self._pending) < self._holders and left > 0:
                    self._cond.wait(left)
                    continue
                batch, self._pending, self._busy = self._pending, [], True
                self._cond.release()
                try:
                    self._lead(batch)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._cond.notify_all()
        if isinstance(me.out, BaseException):
            raise me.out
        return me.out

    def _lead(self, batch: list[_Pending]):
        try:
            self.before()
            outs = self.run([c for p in batch for c in p.calls])
        except BaseException as e:  # noqa: BLE001 (every request of the batch fails with it)
            outs = [e] * sum(len(p.calls) for p in batch)
        k = 0
        for p in batch:
            got = outs[k:k + len(p.calls)]
            k += len(p.calls)
            p.out = next((o for o in got if isinstance(o, BaseException)), got)
            p.done = True


class ContinuousBatcher(_Holding):
    """The generate calls of every request a worker holds, decoded in one continuous batch
    (--rl-continuous-batching): a call joins the running decode batch at the next step boundary (its prompts are
    prefilled then), each row leaves when it finishes, and a call returns as soon as its own rows have all
    finished, without waiting for another request's longer rows or for a batch to end.

    One waiting thread at a time drives the engine: it admits the calls that arrived, runs decode steps and hands
    finished calls their samples, until its own call is done; then another waiting thread takes over. Weights are
    swapped by the engine's between-steps hook (the rows in flight are re-encoded) or, with no row in flight,
    before the next call is admitted (`before`), so every token records the version that drew it. A failure inside
    the engine fails every call in flight and starts a new batch; a call the engine refuses fails alone."""

    def __init__(self, gen, before: Callable[[], Any]):
        super().__init__()
        self.gen, self.before = gen, before
        self._running: dict[int, _Pending] = {}  # ticket -> call in the decode batch

    def many(self, calls: list) -> list:
        me = _Pending(calls, time.monotonic())
        with self._cond:
            self._pending.append(me)
            while not me.done:
                if self._busy:
                    self._cond.wait()
                    continue
                self._busy = True
                try:
                    self._drive(me)
                finally:
                    self._busy = False
                    self._cond.notify_all()
        if isinstance(me.out, BaseException):
            raise me.out
        return me.out

    def _drive(self, me: _Pending):
        """Decode steps (the lock released while the engine works) until `me` is done."""
        while not me.done:
            joining, self._pending = self._pending, []
            self._cond.release()
            try:
                finished = self._step(joining)
            finally:
                self._cond.acquire()
            for p, out in finished:
                p.out, p.done = out, True
            if finished:  # wake only the threads whose call may be done (not every thread at every step)
                self._cond.notify_all()

    def _step(self, joining: list[_Pending]) -> list[tuple[_Pending, Any]]:
        finished = []
        try:
            if joining and not self.gen.decoding:
                self.before()  # nothing in flight: the newest weights before the prefill
            for p in joining:
                try:
                    self._running[self.gen.submit(p.calls)] = p
                except ValueError as e:  # a request the engine refuses fails alone
                    finished.append((p, e))
            for ticket, out in self.gen.advance().items():
                finished.append((self._running.pop(ticket), out))
        except BaseException as e:  # noqa: BLE001 (every call in flight fails with it)
            settled = {id(p) for p, _ in finished} | {id(p) for p in self._running.values()}
            lost = list(self._running.values()) + [p for p in joining if id(p) not in settled]
            finished += [(p, e) for p in lost]
            self._running = {}
            self.gen.reset()
        return finished


# ---- the worker ---------------------------------------------------------------------------------------------
class RolloutWorker:
    """One rollout worker process (a Ray actor: `rollout` on the default thread, `stage` on a second one)."""

    def __init__(self, cfg: WorkerConfig, backend_factory: Callable[[], Any], make_env: Callable[[], Environment]):
        for name in [v for v in os.environ if v in _LAUNCHER_VARS or v.startswith("TORCHELASTIC_")]:
            os.environ.pop(name)
        torch.set_num_threads(cfg.threads)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the log
        self.cfg, self.make_env = cfg, make_env
        self.backend = backend_factory()
        self._cond = threading.Condition()
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: Optional[int] = None
        self._staged_path: Optional[str] = None
        self._swaps, self._swap_s = 0, 0.0
        if hasattr(self.backend, "set_between_steps"):
            self.backend.set_between_steps(self._swap)
        gen = self.backend.generate
        if cfg.continuous_batching:
            if not hasattr(gen, "submit"):
                raise ValueError(f"--rl-continuous-batching needs the local inference engine's generator; "
                                 f"{type(gen).__name__} has no continuous batch")
            self.batcher = ContinuousBatcher(gen, self._swap)
        else:
            many = getattr(gen, "many", None) or (lambda calls: [gen(*c) for c in calls])
            self.batcher = Batcher(many, self._swap, cfg.batch_wait_s)
        # the context a turn may fill (rollout.run_groups ends a sequence that has no room for another turn)
        self.batcher.max_sequence_length = getattr(gen, "max_sequence_length", None)

    def pid(self) -> int:
        return os.getpid()

    def stage(self, packed, version: int, full: bool = False) -> float:
        """Receive a publication (all weights, the ones that changed since the previous version, or the path of a
        checkpoint directory holding them); applied by the generating thread at its next chance. Returns the
        seconds spent here."""
        t0 = time.perf_counter()
        weights = {} if isinstance(packed, str) else unpack_weights(packed)
        with self._cond:
            if full:
                self._staged = {}
            self._staged_path = packed if isinstance(packed, str) else None
            self._staged.update(weights)
            self._staged_version = version if self._staged_version is None else max(version, self._staged_version)
            self._cond.notify_all()
        return time.perf_counter() - t0

    def _swap(self) -> bool:
        with self._cond:
            if self._staged_version is None or self._staged_version <= self.backend.version:
                return False
            weights, version, path = self._staged, self._staged_version, self._staged_path
            self._staged, self._staged_version, self._staged_path = {}, None, None
        t0 = time.perf_counter()
        if path is not None:
            self.backend.apply_path(path, version)
        else:
            self.backend.apply(weights, version)
        self._swaps += 1
        self._swap_s += time.perf_counter() - t0
        with self._cond:  # a request that checked for these weights while they were being applied waits for them
            self._cond.notify_all()
        return True

    def generate(self, prompts: list[list[int]], n: int, sampling) -> list:
        """One generate request outside the orchestrator's rollouts (e.g. a sub-agent's turn): the GenerateFn
        signature, on the newest weights this worker has (in the batch of the rollouts running beside it)."""
        return self.batcher(prompts, n, sampling)

    def held(self) -> int:
        """Requests this worker is running now."""
        return self.batcher.holders

    def engine_batches(self) -> dict[int, int]:
        """Engine batches so far by their rows (samples decoded together)."""
        return dict(getattr(self.backend.generate, "batch_rows", {}))

    def engine_steps(self) -> dict[int, int]:
        """With continuous batching: decode steps so far by the rows they decoded."""
        return dict(getattr(self.backend.generate, "step_rows", {}))

    def rollout(self, request: RolloutRequest) -> RolloutResult:
        """One request's groups; with --rl-worker-concurrency C, up to C of these run at once on the actor's
        threads and their turns share engine batches (`Batcher`)."""
        self.batcher.hold(1)
        try:
            return self._rollout(request)
        finally:
            self.batcher.hold(-1)

    def _rollout(self, request: RolloutRequest) -> RolloutResult:
        with self._cond:  # weights at least as new as the trainer's when the request was dispatched
            def ready():
                staged = -1 if self._staged_version is None else self._staged_version
                return max(self.backend.version, staged) >= request.min_version
            if not self._cond.wait_for(ready, timeout=600):
                raise RuntimeError(f"weights version {request.min_version} never reached this worker")
        t0 = time.perf_counter()
        swaps0, swap_s0 = self._swaps, self._swap_s
        ep = self.cfg.episode
        episode = replace(ep, sampling=replace(ep.sampling, seed=request.seed))
        make_env = timed_envs(self.make_env, self.cfg.env_timeout_s)
        groups = run_groups(request.tasks, make_env, self.batcher, episode, self.cfg.std_normalize)
        # the first tokens are drawn by the oldest weights the request saw (the batch's leader swaps, not this thread)
        versions = [v for g in groups for r in g.rollouts for s in r.segments if s.trainable for v in s.versions]
        start = min(versions) if versions else self.backend.version
        pop = getattr(self.backend.generate, "pop_speculation", None)
        return RolloutResult(request.request_id, groups, start, time.perf_counter() - t0, self._swaps - swaps0,
                             self._swap_s - swap_s0, pop() if pop else {})


# ---- Ray -----------------------------------------------------------------------------------------------------
def free_gpus(environ=None, device_count: Optional[int] = None) -> list[str]:
    """This node's GPUs that the trainer's ranks do not use (torchrun's local rank r trains on visible device r),
    as CUDA_VISIBLE_DEVICES ids: the only ones a local Ray instance may hand to rollout workers."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d for d in visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(torch.cuda.device_count() if device_count is None else device_count)]
    return ids[int(environ.get("LOCAL_WORLD_SIZE", "1")):]


def check_worker_gpus(workers: int, per_worker: float, available: float, replica_gpus: int = 1,
                      model: str = "the model"):
    """Refuse rollout workers that would wait forever for a GPU, or share the trainer's, or cannot hold the
    model, naming what to do instead."""
    if replica_gpus > 1:
        raise WorkerFailure(
            f"a rollout replica of {model} needs {replica_gpus} GPUs (tools/plan_parallelism.py --serve), but each "
            "--rl-rollout-workers worker is a one-GPU copy of the model: run rollouts on tensor/expert-parallel "
            "inference servers with --rl-remote-servers URL ... (SGLang protocol; docs/gpu.md)")
    if per_worker and workers * per_worker > available:
        raise WorkerFailure(
            f"--rl-rollout-workers {workers} need {workers * per_worker:g} GPUs the trainer does not use; Ray has "
            f"{available:g}. Start torchrun with fewer ranks per node, give Ray GPU nodes of its own "
            "(--ray-address), or use --rl-remote-servers")


def start_ray(address: Optional[str], num_cpus: int, log=print):
    """Join the cluster at `address`, or start a local instance in this process; a clear error when neither
    works. Workers get this checkout's code (local: PYTHONPATH; cluster: shipped as a py_module)."""
    import ray

    if ray.is_initialized():
        return
    import megatron_ext
    from megatron_ext import lifetime

    pkg = os.path.dirname(os.path.abspath(megatron_ext.__file__))
    env_vars = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        if address:
            ray.init(address=address, runtime_env={"py_modules": [pkg], "env_vars": env_vars},
                     log_to_driver=True)
        else:
            env_vars["PYTHONPATH"] = os.pathsep.join([os.path.dirname(pkg)] + [p for p in os.environ.get(
                "PYTHONPATH", "").split(os.pathsep) if p])
            lifetime.supervise_descendants()  # the local instance's agents would outlive a killed trainer
            gpus = free_gpus() if torch.cuda.is_available() else []
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)  # Ray assigns workers only these devices
            try:
                ray.init(num_cpus=num_cpus, num_gpus=len(gpus), include_dashboard=False,
                         runtime_env={"env_vars": env_vars}, log_to_driver=True)
            finally:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES")
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
    except Exception as e:  # noqa: BLE001 (Ray raises many types; all mean the same here)
        where = f"join the Ray cluster at --ray-address {address}" if address else "start a local Ray instance"
        raise WorkerFailure(f"could not {where}: {type(e).__name__}: {e}. "
                           + ("Check that `ray start --head` runs there and the address/port is reachable"
                              if address else "Check free memory and /tmp space (Ray's object store and logs "
                              "live there), or start one with `ray start --head` and pass --ray-address")) from e
    log(f"Ray: {'joined ' + address if address else 'local instance started'} "
        f"({ray.cluster_resources().get('CPU', 0):g} CPUs)", flush=True)


def _actor_class(ray, concurrency: int = 1):
    """RolloutWorker as a Ray actor whose `stage` runs on its own thread, beside `concurrency` threads of
    `rollout` (and single `generate` calls)."""

    class _RayRolloutWorker(RolloutWorker):
        @ray.method(concurrency_group="weights")
        def stage(self, packed: dict, version: int, full: bool = False) -> float:
            return super().stage(packed, version, full)

        @ray.method(concurrency_group="weights")
        def pid(self) -> int:  # answered while a rollout runs
            return super().pid()

        @ray.method(concurrency_group="weights")
        def held(self) -> int:
            return super().held()

        @ray.method(concurrency_group="weights")
        def engine_batches(self) -> dict[int, int]:
            return super().engine_batches()

        @ray.method(concurrency_group="weights")
        def engine_steps(self) -> dict[int, int]:
            return super().engine_steps()

        @ray.method(concurrency_group="rollouts")
        def rollout(self, request: RolloutRequest) -> RolloutResult:
            return super().rollout(request)

        @ray.method(concurrency_group="rollouts")
        def generate(self, prompts: list[list[int]], n: int, sampling) -> list:
            return super().generate(prompts, n, sampling)

    return ray.remote(concurrency_groups={"weights": 1, "rollouts": concurrency})(_RayRolloutWorker)


def _replica_gpus(model_args) -> tuple[int, str]:
    if model_args is None:
        return 1, "the model"
    from megatron_ext import planning

    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / planning.GIB
    gpus, _ = planning.rollout_replica_gpus(model_args.arch, memory, context=model_args.seq_length)
    return gpus, getattr(model_args, "model", "the model")


class RayFleet:
    """`Fleet` over Ray actors. Publication: the weights go into the object store once per version (ray.put)
    and every worker reads them from there (shared memory on its node); only the tensors that changed since the
    previous version when that is fewer bytes (`delta`)."""

    def __init__(self, size: int, cfg: WorkerConfig, backend_factory, make_env, version: int,
                 weights: Callable[[], dict], delta: bool = True, num_gpus: float = 0.0, log=print,
                 path_of: Optional[Callable[[int], str]] = None, concurrency: int = 1):
        import ray

        self.ray, self.size, self.log, self.concurrency = ray, size, log, concurrency
        if num_gpus:
            model_args = getattr(backend_factory, "model_args", None)
            check_worker_gpus(size, num_gpus, ray.available_resources().get("GPU", 0.0),
                              *_replica_gpus(model_args))
        self.actor_cls = _actor_class(ray, concurrency)
        self._args = (cfg, backend_factory, make_env)
        self.num_gpus, self.delta = num_gpus, delta
        # by path (a trainer with TP/EP > 1): every rank wrote path_of(version); the workers load and reshard it
        self.path_of = path_of
        self._last: Optional[dict[str, torch.Tensor]] = None
        self.actors = [None] * size
        self.pids: list[Optional[int]] = [None] * size
        self._next, self._generate_lock = -1, threading.Lock()
        full = self._pack_full(weights, version)
        for w in range(size):
            self._start(w, full, version)

    def _pack_full(self, weights: Callable[[], dict], version: int):
        if self.path_of is not None:
            return self.path_of(version)
        current = weights()
        if self.delta:
            self._last = {k: v.detach().to("cpu", copy=True) for k, v in current.items()}
        return self.ray.put(pack_weights(current))

    def _start(self, w: int, full_ref, version: int):
        actor = self.actor_cls.options(num_cpus=1, num_gpus=self.num_gpus, max_restarts=0,
                                       name=None).remote(*self._args)
        actor.stage.remote(full_ref, version, True)
        self.actors[w] = actor
        self.pids[w] = None

    def worker_pid(self, w: int) -> int:
        if self.pids[w] is None:
            self.pids[w] = self.ray.get(self.actors[w].pid.remote())
        return self.pids[w]

    # Fleet
    def submit(self, worker: int, request):
        ref = self.actors[worker].rollout.remote(request)
        return ref

    def wait(self, handles: list, timeout: float) -> list:
        ready, rest = self.ray.wait(handles, num_returns=1, timeout=timeout)
        if ready and rest:
            more, _ = self.ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        return ready

    def result(self, handle) -> RolloutResult:
        ex = self.ray.exceptions
        try:
            return self.ray.get(handle)
        except ex.OutOfMemoryError as e:
            raise WorkerLost(f"Ray's memory monitor killed the worker: {e}. Lower --grpo-prompts-per-step, "
                             "--rl-prompts-per-request or --rl-rollout-workers, or give the node more memory",
                             fatal=True) from e
        except (ex.RayActorError, ex.ActorUnavailableError, ex.WorkerCrashedError, ex.ObjectLostError) as e:
            if "memory monitor" in str(e):
                raise WorkerLost(f"Ray's memory monitor killed the worker: {str(e).splitlines()[0]}", fatal=True) \
                    from e
            raise WorkerLost(f"{type(e).__name__}: {str(e).splitlines()[0]}") from e

    def publish(self, version: int, weights: Callable[[], dict]) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.path_of is not None:
            path = self.path_of(version)
            for actor in self.actors:
                actor.stage.remote(path, version, True)
            size = float(sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files))
            return {"publish seconds": time.perf_counter() - t0, "publish bytes": size, "publish bytes full": size}
        current = weights()
        full_bytes = sum(t.numel() * t.element_size() for t in current.values())
        send, is_full = current, True
        if self.delta and self._last is not None:
            changed = {k: v for k, v in current.items() if not torch.equal(v.detach().cpu(), self._last[k])}
            changed_bytes = sum(t.numel() * t.element_size() for t in changed.values())
            if changed_bytes < full_bytes:
                send, is_full = changed, False
            for k, v in changed.items():
                self._last[k].copy_(v.detach())
        packed = pack_weights(send)
        ref = self.ray.put(packed)
        for actor in self.actors:
            actor.stage.remote(ref, version, is_full)
        return {"publish seconds": time.perf_counter() - t0, "publish bytes": float(packed_bytes(packed)),
                "publish bytes full": float(full_bytes)}

    def restart(self, worker: int, version: int, weights: Callable[[], dict]):
        try:
            self.ray.kill(self.actors[worker], no_restart=True)
        except Exception:  # noqa: BLE001 (already dead)
            pass
        if self.path_of is not None:
            self._start(worker, self.path_of(version), version)
            return
        current = weights()
        self._start(worker, self.ray.put(pack_weights(current)), version)

    def generate(self, prompts: list[list[int]], n: int, sampling):
        """Submit a single generate request to the fleet (round-robin over the workers; queued behind their
        rollouts); returns a Ray ObjectRef of `list[list[Sample]]`. `FleetGenerate` wraps it as a GenerateFn."""
        with self._generate_lock:  # callers on several threads (sub-agents) each get the next worker
            self._next = (self._next + 1) % self.size
            worker = self._next
        return self.actors[worker].generate.remote(prompts, n, sampling)

    def close(self):
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass


class FleetGenerate:
    """A GenerateFn over the rollout fleet (blocking), for callers outside the orchestrator (agent harnesses)."""

    def __init__(self, fleet: RayFleet):
        self.fleet = fleet

    def __call__(self, prompts, n, sampling):
        return self.fleet.ray.get(self.fleet.generate(prompts, n, sampling))
