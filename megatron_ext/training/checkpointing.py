"""Checkpoints through Megatron-Core `dist_checkpointing`: reshardable across TP/PP/EP/DP, atomic, verifiable.

Layout of a save directory (Megatron-LM's, so its tools recognise it)::

    SAVE/iter_0000040/            one dist checkpoint: model, optimizer, per-rank RNG, common state
    SAVE/iter_0000040/manifest.json   every file of the checkpoint with its size and CRC-32, written last
    SAVE/latest_checkpointed_iteration.txt

A checkpoint is written into ``iter_N.tmp`` and renamed only once every rank has finished and the manifest is
written; the tracker is replaced after that. A crash at any point leaves the previous tracker pointing at a
complete checkpoint (or, before the first tracker is written, a complete iter_N/ that `read_tracker` stands in for
it). Loading verifies the manifest first, so a truncated, missing or corrupted file is reported by
name before any tensor is read. The CRC-32 of each data file is computed from the bytes as they are written (no
second read; see `checksummed_writes`); verifying them on load reads every file once, spread over the ranks
(`--skip-checkpoint-checksums` checks sizes only).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import multiprocessing
import os
import pickle
import random
import shutil
import sys
import threading
import types
import zlib

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megatron_ext import platform
from megatron_ext.models.presets import field_flag
from megatron_ext.models.te_layout import drop_absent_extra_state

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
CHECKSUM_SIDECAR = ".crc32"  # NAME.crc32 next to each data file while a checkpoint is written; folded into the manifest
_READ_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the directory or file and what is wrong."""


RELEASE = "release"  # a converted checkpoint: weights only, training starts at iteration 0


def checkpoint_dir(root: str, iteration: int | str) -> str:
    return os.path.join(root, RELEASE if iteration == RELEASE else f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | str | None:
    """The checkpoint a --load of `root` means: the tracker's iteration (or release), None when nothing is saved.

    Without a tracker, the latest complete iter_N/ (its manifest is written before the rename that makes it
    visible) stands in: a kill between a first save's rename and its tracker write leaves exactly that, and the
    re-run of the same command resumes from it instead of being refused. A tracker that names an older iteration
    than some iter_N/ is obeyed (the tracker is the commit point, and rolling it back by hand is how one resumes
    from an earlier save)."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        complete = [n for n in saved_iterations(root)
                    if os.path.exists(os.path.join(checkpoint_dir(root, n), MANIFEST))]
        return complete[-1] if complete else None
    text = open(path).read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number or 'release', found {text!r}") from None


def saved_iterations(root: str) -> list[int]:
    """Iterations of the complete training checkpoints (iter_N/, not iter_N.tmp) under `root`."""
    if not os.path.isdir(root):
        return []
    names = (n[len("iter_"):] for n in os.listdir(root) if n.startswith("iter_"))
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(checkpoint_dir(root, int(n))))


def check_save_target(args: argparse.Namespace):
    """Refuse a run that would overwrite checkpoints it does not continue (a fresh start or another --load writing
    into a --save that holds a run's iter_N directories): only resuming from that --save, or --override-save,
    may write there. Called by the entry script before anything is built."""
    root = args.save
    if not root or getattr(args, "override_save", False) or getattr(args, "dry_run", False):
        return
    iterations = saved_iterations(root)
    if not iterations:
        return
    tag = read_tracker(root)
    same = bool(args.load) and os.path.abspath(args.load) == os.path.abspath(root)
    if same and isinstance(tag, int) and not args.finetune:
        return  # resuming this run: later iterations are rewritten by the run they belong to
    held = f"checkpoints at iteration{'s' if len(iterations) > 1 else ''} {', '.join(map(str, iterations))}"
    if tag is None:
        why = (f"--save {root} holds iter_N directories ({', '.join(map(str, iterations))}) but no {TRACKER} and no "
               f"complete checkpoint (iter_N/ with {MANIFEST}): nothing to resume from, and this run would overwrite "
               "them")
    elif same and tag == RELEASE:
        why = (f"--save {root} holds training {held} besides the converted checkpoint its tracker points at "
               f"({RELEASE}/): this run starts from iteration 0 and would overwrite them")
    elif same:
        why = f"--save {root} holds {held} and --finetune starts this run from iteration 0: it would overwrite them"
    else:
        start = "--load " + args.load if args.load else "no --load (a fresh start)"
        why = f"--save {root} already holds {held}, and this run starts from {start}: it would overwrite them"
    resume = "" if tag is None else f"Pass --load {root} to resume from the latest, "
    raise CheckpointError(f"{why}. {resume}{'c' if resume else 'C'}hoose another --save, or pass --override-save to "
                          "start over there (checkpoints of the same iteration are replaced)")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _layout(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                          "expert_model_parallel_size", "expert_tensor_parallel_size",
                                          "context_parallel_size")}


def _model_shards(layout: dict | None) -> dict:
    """The layout without the data-parallel size (what dp_reshardable optimizer state depends on)."""
    return {k: v for k, v in (layout or {}).items() if k != "world_size"}


def serializable_args(args: argparse.Namespace) -> dict:
    out = {}
    for k, v in vars(args).items():
        if dataclasses.is_dataclass(v):
            v = dataclasses.asdict(v)
        if isinstance(v, (str, int, float, bool, type(None), list, tuple, dict)):
            out[k] = v
    return out


def _optimizer_parts(optimizer) -> int:
    """How many optimizers Megatron-Core chained: one, or two once EP > 1 gives experts their own."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer])) if optimizer is not None else 0


def _rng_state() -> dict:
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if not platform.bridge_needed():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and not platform.bridge_needed():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(args: argparse.Namespace) -> ShardedObject:
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)


def optim_sharding_type(args: argparse.Namespace) -> str:
    """Megatron-LM's default for the distributed optimizer: dp_reshardable, each rank writing its own buffer shard
    with no gather (fully_reshardable collects a DP group's whole state on one host per save and load: ~100 GB
    for K2.5 stage 1); resharding across TP/PP/EP stays available as an explicit choice."""
    return "fully_reshardable" if getattr(args, "dist_ckpt_optim_fully_reshardable", False) else "dp_reshardable"


def _strategies(ckpt: str, args, loading: bool) -> dict:
    """Megatron-LM's fully parallel wrappers: the writes (and, when asked, the reads) of replicated shards are
    spread over the data-parallel ranks instead of all falling to the first replica."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import (get_default_load_sharded_strategy,
                                                                get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                            FullyParallelSaveStrategyWrapper)

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if loading:
        if not getattr(args, "ckpt_fully_parallel_load", False):
            return {}
        return {"sharded_strategy": FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(ckpt), group)}
    if not getattr(args, "ckpt_fully_parallel_save", True):
        return {}
    return {"sharded_strategy": FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)}


def _sharded_state_dict(args, model, optimizer, with_optimizer: bool, with_rng: bool, loading: bool,
                        sharding_type: str | None = None) -> dict:
    metadata = ensure_metadata_has_dp_cp_group({"distrib_optim_sharding_type": sharding_type or
                                                optim_sharding_type(args), "chained_optim_avoid_prefix": True})
    model_sd = _unwrap(model[0]).sharded_state_dict(metadata=metadata)
    state = {"model": model_sd}
    if with_optimizer and optimizer is not None:
        # The distributed optimizer's state in its canonical per-parameter form: loadable under any TP/PP/EP/DP.
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)
    if with_rng:
        state["rng_state"] = _rng_sharded_object(args)
    return state


@contextlib.contextmanager
def params_gathered(model):
    """Every rank's parameters hold the last step's update: with --overlap-param-gather the distributed optimizer
    updates only this rank's shard and leaves the all-gather to the next forward's hooks, so weights read right
    after a step mix updated and one-step-stale shards. As Megatron-LM around its saves: gather synchronously with
    the hooks off, put them back afterwards. Re-entrant: an inner use (a save inside a publication) finds the hooks
    already off and leaves them to the outer one."""
    chunks = [c for c in model if getattr(c, "use_forward_hook", False) and c.remove_forward_pre_hook_handles]
    for chunk in chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.enable_forward_pre_hook()


# Run in the writer queue's server (the initializer of `start_writer_queue`): exit when the process that started it
# is gone (megatron_ext.lifetime's watcher, which that server does not import), and import in the background what
# unpickling the writer's results needs (torch's checkpoint classes: ~1.5 s, else paid by the first save's put).
# It ignores the preemption signals (training.loop.PREEMPTION_SIGNALS): torchrun (whose workers run in their own
# sessions) and SLURM signal a rank's whole process group, this server included, and the trainer answers by saving,
# through this server; killed by the same signal, it failed that save (BrokenPipeError, iter_N.tmp left, the steps
# since the last save lost). It still ends with its parent (above) or by SIGKILL.
_SERVER_START = """
import importlib, os, signal, threading, time
for _sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_sig, signal.SIG_IGN)
def _watch(parent={parent}):
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
threading.Thread(target=_watch, name="parent-watch", daemon=True).start()
threading.Thread(target=importlib.import_module, args=("torch.distributed.checkpoint",), daemon=True).start()
"""


def start_writer_queue() -> bool:
    """Start the results queue of Megatron-Core's checkpoint writer now, without re-running the entry script, instead
    of at the first save; True when started here.

    The writer reports through a queue in a `multiprocessing.Manager` that `filesystem_async`'s
    `_get_write_results_queue` starts with the *spawn* method on the first save. A spawned child re-runs the entry
    script's top-level imports (torch, Megatron-Core) before it serves, so every process's first save waited
    about 3.5 s for it (a tiny run: 3.4 s for the first save, 0.2 s for the next). Here the same spawned Manager
    is started with the main module hidden for the moment of the spawn, so the child starts serving at once, and
    with an initializer that makes it exit when this process is gone (a kill -9 of the trainer must not leave it
    behind; megatron_ext.lifetime, which would do that, is not imported there) and imports torch's checkpoint
    classes in the background, which unpickling the first results needs (overlapping this process's start-up).
    (Forking it instead was tried: the forked server crashed collecting objects inherited from the trainer.) Called
    by `initialize_distributed` for a run with a save target, in the main thread before the run starts threads of
    its own; from another thread, with a queue already started, or with a Megatron-Core without that private hook,
    nothing changes."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as writer
    except ImportError:
        return False
    if (threading.current_thread() is not threading.main_thread()
            or not callable(getattr(writer, "_get_write_results_queue", None))
            or getattr(writer, "_results_queue", False) is not None):
        return False
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no spec, no file: the child runs no entry script
    try:
        manager.start(exec, (_SERVER_START.format(parent=os.getpid()),))
    finally:
        sys.modules["__main__"] = main
    writer._results_queue = manager.Queue()
    return True


def save_checkpoint(args: argparse.Namespace, iteration: int, model, optimizer, scheduler, extra: dict | None = None):
    """Save atomically under args.save; every rank calls this."""
    with params_gathered(model):
        _save_checkpoint(args, iteration, model, optimizer, scheduler, extra)


def _save_checkpoint(args, iteration, model, optimizer, scheduler, extra):
    root = args.save
    final, tmp = checkpoint_dir(root, iteration), checkpoint_dir(root, iteration) + ".tmp"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state_dict(args, model, optimizer, with_optimizer=not args.no_save_optim, with_rng=True,
                                loading=False)
    state.update(iteration=iteration, format_version=FORMAT_VERSION, args=serializable_args(args),
                 layout=_layout(args), optimizer_parts=_optimizer_parts(optimizer),
                 opt_param_scheduler=scheduler.state_dict() if scheduler else None,
                 optim_sharding_type=optim_sharding_type(args), **(extra or {}))
    with checksummed_writes():
        dist_checkpointing.save(state, tmp, **_strategies(tmp, args, loading=False))
    dist.barrier()
    if rank == 0:
        publish(root, tmp, final, iteration)
    dist.barrier()


def _exchange(a: str, b: str) -> bool:
    """Swaps two directories in one atomic step (Linux renameat2 with RENAME_EXCHANGE); False where the kernel,
    the C library or the file system (e.g. some network file systems) cannot, with nothing changed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def publish(root: str, tmp: str, final: str, tag: int | str):
    """Make a completely written checkpoint visible: manifest, rename, then the tracker (each step atomic). An
    iteration saved again (--override-save, or a resume from an older tracker) is swapped in atomically where the
    file system can (else the old one is moved aside, then the new one renamed in: a moment without iter_N/), and
    the old one is deleted only after the tracker write: deleted in place, a kill mid-delete would leave the
    tracker's checkpoint half gone for as long as a big rmtree takes."""
    _write_manifest(tmp)
    replaced = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(replaced, ignore_errors=True)
        if _exchange(tmp, final):
            os.replace(tmp, replaced)
        else:
            os.replace(final, replaced)
            os.replace(tmp, final)
    else:
        os.replace(tmp, final)
    tracker_tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(tag))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tracker_tmp, os.path.join(root, TRACKER))
    shutil.rmtree(replaced, ignore_errors=True)


class ChecksumStream:
    """A file opened for writing that keeps the CRC-32 of what passes through it and, on close, leaves it in a
    sidecar (NAME.crc32) for the manifest. A seek makes the running value meaningless: no sidecar then, and the
    manifest reads the file back instead."""

    def __init__(self, path, mode: str = "wb"):
        self._f = open(path, mode)
        self._path = os.fspath(path)
        self._crc, self._count = 0, 0
        self._valid = mode in ("wb", "bw")

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = self._f.write(view)
        n = len(view) if n is None else n
        self._crc = zlib.crc32(view[:n], self._crc)
        self._count += n
        return n

    def seek(self, *args):
        self._valid = False
        return self._f.seek(*args)

    def writable(self) -> bool:
        return True

    def close(self):
        if self._f.closed:
            return
        self._f.close()
        if self._valid and os.path.getsize(self._path) == self._count:
            with open(self._path + CHECKSUM_SIDECAR, "w") as f:
                json.dump({"size": self._count, "crc32": f"{self._crc:08x}"}, f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):  # tell, flush, fileno, closed, ...
        return getattr(self._f, name)


def _checksum_open(file, mode="r", *args, **kwargs):
    if mode in ("wb", "bw") and not args and not kwargs:
        return ChecksumStream(file, mode)
    return open(file, mode, *args, **kwargs)


@contextlib.contextmanager
def checksummed_writes():
    """While active, the data files Megatron-Core's torch_dist writer creates (FileSystemWriterAsync, in this
    process or the worker processes it forks) go through ChecksumStream. The writer opens them with the builtin
    `open`, which a module global of the same name shadows; anything it does not catch (a future writer, other
    files) is checksummed by reading it back when the manifest is written, so the manifest is complete either
    way."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    had = "open" in vars(filesystem_async)
    previous = vars(filesystem_async).get("open")
    filesystem_async.open = _checksum_open
    try:
        yield
    finally:
        if had:
            filesystem_async.open = previous
        else:
            del filesystem_async.open


def checksum_file_system():
    """A torch.distributed.checkpoint FileSystem whose written files go through ChecksumStream (set it as a
    FileSystemWriter's `fs`; tools/convert_checkpoint.py import writes through one)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ChecksumFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with ChecksumStream(path, mode) as stream:
                yield stream

    return ChecksumFileSystem()


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_manifest(ckpt: str):
    """manifest.json: size and CRC-32 per file. CRCs come from the sidecars written while the data files were
    written; files without one (the small common.pt, .metadata, metadata.json) are read here."""
    paths, sidecars = {}, {}
    for dirpath, _, names in os.walk(ckpt):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ckpt)
            if name.endswith(CHECKSUM_SIDECAR):
                sidecars[rel[: -len(CHECKSUM_SIDECAR)]] = path
            elif rel != MANIFEST:
                paths[rel] = path
    files = {}
    for rel, path in sorted(paths.items()):
        size, crc = os.path.getsize(path), None
        if rel in sidecars:
            with open(sidecars[rel]) as f:
                record = json.load(f)
            if record.get("size") == size:
                crc = record["crc32"]
        files[rel] = {"size": size, "crc32": crc or f"{file_crc32(path):08x}"}
    for sidecar in sidecars.values():
        os.remove(sidecar)
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, "checksum": "crc32", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_args(root: str, purpose: str) -> tuple[str, dict]:
    """(checkpoint directory, the flags recorded in it) of the latest checkpoint under `root`; `purpose` (a flag)
    begins the error."""
    tag = read_tracker(root)
    if tag is None:
        raise CheckpointError(f"{purpose}: no checkpoint under {root} ({TRACKER} missing)")
    ckpt = checkpoint_dir(root, tag)
    verify_checkpoint(ckpt)
    try:
        return ckpt, torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)["args"]
    except Exception as e:
        raise CheckpointError(f"cannot read the flags recorded in {ckpt}: {e}") from e


def checkpoint_arch(root: str):
    """The architecture recorded in the latest checkpoint under `root` (for --use-checkpoint-args)."""
    from megatron_ext.models.presets import ModelPreset

    ckpt, recorded = checkpoint_args(root, "--use-checkpoint-args")
    try:
        return ModelPreset(**recorded["arch"])
    except Exception as e:
        raise CheckpointError(f"cannot read the architecture recorded in {ckpt}: {e}") from e


def read_manifest(ckpt: str) -> dict:
    """{relative path: {"size": bytes, "crc32": hex or None}}; manifests of older checkpoints hold sizes only."""
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint directory {ckpt} does not exist")
    manifest_path = os.path.join(ckpt, MANIFEST)
    if not os.path.exists(manifest_path):
        raise CheckpointError(f"{ckpt} has no {MANIFEST}: it was not completely written (or is not ours)")
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
        return {rel: entry if isinstance(entry, dict) else {"size": int(entry), "crc32": None}
                for rel, entry in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupt: {e}") from None


def verify_checkpoint(ckpt: str, checksums: bool = False, rank: int = 0, world: int = 1):
    """Raise CheckpointError naming the problem if `ckpt` is not a complete checkpoint: every file present with its
    size, and with `checksums` its CRC-32 (this rank reads every world-th file, so ranks share the reading)."""
    files = read_manifest(ckpt)
    for rel, entry in files.items():
        path = os.path.join(ckpt, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        actual = os.path.getsize(path)
        if actual != entry["size"]:
            raise CheckpointError(f"checkpoint file {path} is {actual} bytes, expected {entry['size']}: truncated "
                                  "or overwritten")
    if checksums:
        for i, (rel, entry) in enumerate(sorted(files.items())):
            if i % world != rank or not entry.get("crc32"):
                continue
            path = os.path.join(ckpt, rel)
            actual = f"{file_crc32(path):08x}"
            if actual != entry["crc32"]:
                raise CheckpointError(f"checkpoint file {path} is corrupt: CRC-32 {actual}, the manifest records "
                                      f"{entry['crc32']} (same size: changed on disk after saving); restore it or "
                                      "load an earlier checkpoint")


def _verify_on_all_ranks(ckpt: str, checksums: bool):
    """verify_checkpoint with the checksum reading split over the ranks; every rank raises the same error."""
    if not checksums or not dist.is_initialized() or dist.get_world_size() == 1:
        verify_checkpoint(ckpt, checksums=checksums)
        return
    try:
        verify_checkpoint(ckpt, checksums=True, rank=dist.get_rank(), world=dist.get_world_size())
        problem = None
    except CheckpointError as e:
        problem = str(e)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} more problems found by other ranks)"
                                             if len(problems) > 1 else ""))


def _check_metadata(ckpt: str):
    """Megatron-Core's loader meets a damaged .metadata with an assertion or an unpickling error that names no
    file: read it first so the message does."""
    path = os.path.join(ckpt, ".metadata")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt ({type(e).__name__}: {e})") from None
    if not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"checkpoint file {path} is corrupt: it holds a {type(metadata).__name__}, not "
                              "torch.distributed.checkpoint metadata")


def _mtp_attach(args, common: dict, ckpt: str, log) -> bool:
    """Whether to add fresh MTP layers to a checkpoint without them (--mtp-attach), checked both ways."""
    saved = (common.get("args", {}).get("arch") or {}).get("mtp_num_layers", 0) or 0
    wanted = args.arch.mtp_num_layers if hasattr(args, "arch") else 0
    if getattr(args, "mtp_attach", False):
        if saved:
            raise CheckpointError(f"--mtp-attach: {ckpt} already has {saved} MTP layer(s); drop --mtp-attach")
        if not wanted:
            raise CheckpointError("--mtp-attach needs --mtp-num-layers >= 1")
        log(f"attaching {wanted} freshly initialised MTP layer(s) to {ckpt}; optimizer state starts fresh")
        return True
    if wanted and not saved:
        raise CheckpointError(f"{ckpt} has no MTP layers but this run has --mtp-num-layers {wanted}: pass "
                              "--mtp-attach to add fresh ones (the recipe attaches them mid-training) or "
                              "--mtp-num-layers 0")
    return False


# Architecture fields that change the checkpoint's tensors (MTP layers are checked by _mtp_attach): the only ones a
# weights-only load (--finetune, a converted checkpoint, the start of a stage) requires to match.
_WEIGHT_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "q_lora_rank",
                  "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
                  "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "first_k_dense",
                  "moe_router_enable_expert_bias", "untie_embeddings_and_output_weights",
                  "attention_residuals", "attn_res_block_size")


def _check_architecture(args, common: dict, ckpt: str, weights_only: bool):
    """Name the flag whose value makes this run's model differ from the checkpoint's, before any tensor is read.

    A resume continues the same run, so every recorded architecture field must match (a changed router top-k or
    YaRN factor loads without error and trains a different model); a weights-only load starts a new run from the
    weights, which may change what does not change a tensor (extend raises --seq-length and sets YaRN)."""
    saved_args = common.get("args") or {}
    saved = saved_args.get("arch")
    if not saved or not hasattr(args, "arch"):
        return
    here = dataclasses.asdict(args.arch)
    fields = _WEIGHT_FIELDS if weights_only else [f for f in saved if f in here]
    if not saved.get("mtp_num_layers"):  # none saved: _mtp_attach decides whether fresh ones may be added
        fields = [f for f in fields if f != "mtp_num_layers"]
    diffs = [f"{field_flag(f)} {here[f]} here, {saved[f]} in the checkpoint"
             for f in fields if f in saved and saved[f] != here[f]]
    saved_vocab = saved_args.get("padded_vocab_size")
    if saved_vocab and getattr(args, "padded_vocab_size", saved_vocab) != saved_vocab:
        diffs.append(f"--vocab-size {args.vocab_size} (padded to {args.padded_vocab_size}) here, "
                     f"{saved.get('vocab_size')} (padded to {saved_vocab}) in the checkpoint")
    if diffs:
        how = ("Pass --use-checkpoint-args to take the checkpoint's architecture, or fix the flags" if weights_only
               else "Resuming continues the same run: pass --use-checkpoint-args to take the checkpoint's "
                    "architecture or fix the flags, or pass --finetune to start a new run from its weights")
        raise CheckpointError(f"{ckpt} was saved with a different architecture: " + "; ".join(diffs) + ". " + how)


def _check_scheduler(args, scheduler, saved: dict, ckpt: str, log):
    """Megatron-LM's rule: a schedule flag that differs from the checkpoint's is an error unless the run says which
    one to use (--override-opt_param-scheduler: the flags; --use-checkpoint-opt_param-scheduler: the checkpoint)."""
    gbs = args.global_batch_size
    steps = lambda v: f"{v} samples ({v / gbs:g} iterations at --global-batch-size {gbs})"  # noqa: E731
    fields = [("max_lr", "--lr", str), ("min_lr", "--min-lr", str), ("lr_decay_style", "--lr-decay-style", str),
              ("lr_warmup_steps", "--lr-warmup-iters", steps), ("start_wd", "--weight-decay", str)]
    # lengths that a constant schedule never reads (a longer run at constant lr/wd is no change of schedule)
    if not (scheduler.lr_decay_style == saved.get("lr_decay_style") == "constant"):
        fields.append(("lr_decay_steps", "--lr-decay-iters (default: --train-iters)", steps))
    if not (scheduler.wd_incr_style == saved.get("wd_incr_style") == "constant"):
        fields.append(("wd_incr_steps", "--train-iters", steps))
    diffs = [f"{flag}: {show(getattr(scheduler, key))} here, {show(saved[key])} in the checkpoint"
             for key, flag, show in fields if key in saved and getattr(scheduler, key) != saved[key]]
    override = getattr(args, "override_opt_param_scheduler", False)
    use_checkpoint = getattr(args, "use_checkpoint_opt_param_scheduler", False)
    scheduler.override_opt_param_scheduler = override
    scheduler.use_checkpoint_opt_param_scheduler = not override  # no difference left that it could hide
    if not diffs:
        return
    if override:
        log("--override-opt_param-scheduler: the learning-rate schedule follows the flags, not the checkpoint: "
            + "; ".join(diffs))
    elif use_checkpoint:
        log("--use-checkpoint-opt_param-scheduler: the learning-rate schedule follows the checkpoint, not the "
            "flags: " + "; ".join(diffs))
    else:
        raise CheckpointError(f"the learning-rate schedule of {ckpt} differs from the flags: " + "; ".join(diffs)
                              + ". Pass --override-opt_param-scheduler to use the flags or "
                              "--use-checkpoint-opt_param-scheduler to keep the checkpoint's (as Megatron-LM)")


def _allocate_optimizer_state(optimizer):
    """Give a fresh distributed optimizer its state tensors before a load overwrites them.

    Without apex/TE, Megatron-Core 0.16.1's DistributedOptimizer.state_dict() requires the torch optimizer's
    state to exist (it reads the common 'step'), which a never-stepped optimizer does not have. Megatron-Core's
    own dummy initialisation takes one zero-gradient step; the load that follows replaces weights and state.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and len(opt.optimizer.state) == 0:
            opt._init_optimizer_states_with_dummy_values()


def load_checkpoint(args: argparse.Namespace, model, optimizer, scheduler, log=print) -> tuple[int, dict]:
    """Load the latest checkpoint under args.load into model (and optimizer, scheduler, RNG unless told not to).

    Returns (iteration to resume from, common state). A directory without a tracker means "nothing saved yet":
    training starts from scratch, as on the first run of a job that always passes --load.
    """
    root = args.load
    iteration = read_tracker(root)
    if iteration is None:
        log(f"no checkpoint found under {root} ({TRACKER} missing): starting from scratch")
        return 0, {}
    ckpt = checkpoint_dir(root, iteration)
    _verify_on_all_ranks(ckpt, checksums=not getattr(args, "skip_checkpoint_checksums", False))
    try:
        common = dist_checkpointing.load_common_state_dict(ckpt)
    except Exception as e:  # torch.load's errors do not say which checkpoint
        raise CheckpointError(f"cannot read the common state of {ckpt}: {e}") from e
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt} has format version {common.get('format_version')}, expected {FORMAT_VERSION}")
    release = bool(common.get("release"))
    _check_architecture(args, common, ckpt, weights_only=args.finetune or release)
    _check_metadata(ckpt)
    if release:
        log(f"{ckpt} is a converted checkpoint ({common.get('converted_from')}): loading weights only")
    attach = _mtp_attach(args, common, ckpt, log)
    weights_only = args.finetune or release
    # fresh MTP layers have no optimizer state; the trunk's would not line up with the new parameter set
    load_optim = not (weights_only or args.no_load_optim or attach) and optimizer is not None
    if load_optim and common["args"].get("no_save_optim"):
        raise CheckpointError(f"{ckpt} was saved without optimizer state; pass --no-load-optim or --finetune")
    if load_optim and common.get("optimizer_parts") != _optimizer_parts(optimizer):
        raise CheckpointError(
            f"{ckpt} holds optimizer state for {common.get('optimizer_parts')} chained optimizer(s) (saved with "
            f"--expert-model-parallel-size {common['layout']['expert_model_parallel_size']}), this run has "
            f"{_optimizer_parts(optimizer)}: Megatron-Core cannot map optimizer state between EP = 1 and EP > 1. "
            "Pass --no-load-optim to load the weights only, or keep EP on the same side of 1")
    same_layout = common.get("layout") == _layout(args)
    load_rng = not (weights_only or args.no_load_rng) and same_layout
    if not same_layout and not release:
        log(f"loading {ckpt} saved under {common.get('layout')} into {_layout(args)}: resharding, RNG state not "
            "restored")
    sharding = common.get("optim_sharding_type", "fully_reshardable")  # what older checkpoints were written in
    resharded = _model_shards(common.get("layout")) != _model_shards(_layout(args))
    if load_optim and sharding == "dp_reshardable" and resharded:
        raise CheckpointError(
            f"{ckpt} holds dp_reshardable optimizer state (the default): only the data-parallel size may change, "
            f"but it was saved under {common.get('layout')} and this run is {_layout(args)}. Pass --no-load-optim "
            "to load the weights only, or save it again under its own layout with "
            "--dist-ckpt-optim-fully-reshardable to reshard the optimizer state too")
    if load_optim:
        _allocate_optimizer_state(optimizer)
    state = _sharded_state_dict(args, model, optimizer, with_optimizer=load_optim, with_rng=load_rng, loading=True,
                                sharding_type=sharding)
    if attach:
        state["model"] = {k: v for k, v in state["model"].items() if not k.startswith("mtp.")}
    state["model"] = drop_absent_extra_state(state["model"], ckpt)  # written by the other backend
    try:
        loaded = dist_checkpointing.load(state, ckpt, **_strategies(ckpt, args, loading=True))
    except Exception as e:
        raise CheckpointError(f"cannot load {ckpt}: {type(e).__name__}: {e}") from e
    missing, unexpected = _unwrap(model[0]).load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not (attach and k.startswith("mtp.")) and not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    flag_lrs = [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups] if load_optim else []
    if load_optim:
        with torch.no_grad():  # Megatron-Core 0.16.1 copies dp_reshardable state into leaf views outside no_grad
            optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 master copies follow the loaded weights
    if scheduler is not None and common.get("opt_param_scheduler") and not weights_only:
        _check_scheduler(args, scheduler, common["opt_param_scheduler"], ckpt, log)
        scheduler.load_state_dict(common["opt_param_scheduler"])
        # The optimizer's parameter groups carry their own max/min lr (what get_lr reads): restored from the
        # checkpoint with the optimizer state, else the flags'. Make them follow the schedule chosen above.
        if scheduler.override_opt_param_scheduler and flag_lrs:
            for group, (max_lr, min_lr) in zip(optimizer.param_groups, flag_lrs):
                group["max_lr"], group["min_lr"] = max_lr, min_lr
        elif not scheduler.override_opt_param_scheduler and optimizer is not None and not load_optim:
            for group in optimizer.param_groups:
                if group.get("max_lr") == args.lr:
                    group["max_lr"] = scheduler.max_lr
                if group.get("min_lr") == args.min_lr:
                    group["min_lr"] = scheduler.min_lr
        scheduler.step(increment=0)
    if load_rng:
        rng = loaded["rng_state"]
        _set_rng_state(rng.data if isinstance(rng, ShardedObject) else rng)
    start = 0 if weights_only else iteration
    log(f"loaded {ckpt} (iteration {iteration}{', weights only' if weights_only else ''})")
    return start, common


def load_weights(args: argparse.Namespace, model, path: str, log=print):
    """Weights only from the latest checkpoint under `path` (serving, weight publication); unlike --load, a
    missing checkpoint is an error rather than a fresh start."""
    if read_tracker(path) is None:
        raise CheckpointError(f"no checkpoint under {path} ({TRACKER} missing)")
    weights_args = argparse.Namespace(**{**vars(args), "load": path, "finetune": True})
    load_checkpoint(weights_args, model, None, None, log=log)
