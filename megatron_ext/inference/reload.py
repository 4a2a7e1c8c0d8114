"""Reloading served weights from a checkpoint without ever serving a broken model (issue 11 item 3).

A reload runs on every rank of the serving job at once (ModelParallelServing announces it). Each rank:

1. validates the checkpoint before touching anything: tracker, manifest, common state, the recorded architecture
   against the served one (differing fields named), the `.metadata` file readable, and every weight's global
   shape there equal to the served model's;
2. keeps a host copy of its current weights (parameters and persistent buffers), then loads in place;
3. agrees with the other ranks (one all-gather of each rank's outcome): if any rank failed, every rank restores
   its copy, and the error names each failing rank and its reason.

The host copy costs one rank's weights of host memory for the duration of the reload (about 32 GB per rank for
Kimi K2.5 over 64 GPUs); no accelerator memory is needed for it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_ext.inference.engine import model_weights


class ReloadError(RuntimeError):
    """A reload that did not happen; the served weights are those from before it. `status`: 422 when the
    checkpoint is unusable (validation), 500 when loading failed."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class _Invalid(Exception):
    """A checkpoint that fails validation (nothing was touched)."""


def _sharded_tensors(state, out: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for value in (state.values() if isinstance(state, dict) else state if isinstance(state, list) else ()):
        if isinstance(value, ShardedTensor):
            out[value.key] = tuple(value.global_shape)
        elif isinstance(value, (dict, list)):
            _sharded_tensors(value, out)
    return out


class CheckpointReload:
    """`reload(path)` for ModelService: validated, restored on failure, agreed over every rank of the job."""

    def __init__(self, args, model: torch.nn.Module, log: Callable[..., None] = lambda *a, **k: None):
        self.args, self.model, self.log = args, getattr(model, "module", model), log

    def validate(self, path: str) -> str:
        """The checkpoint directory to load, after checks that read but change nothing."""
        from megatron.core import dist_checkpointing
        from torch.distributed.checkpoint import FileSystemReader

        from megatron_ext.training.checkpointing import (FORMAT_VERSION, CheckpointError, checkpoint_dir,
                                                         read_tracker, verify_checkpoint)

        try:
            tag = read_tracker(path)
            if tag is None:
                raise _Invalid(f"no checkpoint under {path} (latest_checkpointed_iteration.txt missing)")
            ckpt = checkpoint_dir(path, tag)
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            raise _Invalid(str(e)) from None
        try:
            common = dist_checkpointing.load_common_state_dict(ckpt)
        except BaseException as e:  # noqa: B036 - torch's checkpoint errors are BaseExceptions
            _reraise_interrupts(e)
            raise _Invalid(f"cannot read the common state of {ckpt}: {type(e).__name__}: {e}") from None
        if common.get("format_version") != FORMAT_VERSION:
            raise _Invalid(f"{ckpt} has format version {common.get('format_version')}, expected {FORMAT_VERSION}")
        saved = (common.get("args") or {}).get("arch")
        served = dataclasses.asdict(self.args.arch) if dataclasses.is_dataclass(self.args.arch) else None
        if saved is not None and served is not None:
            differ = [f"{k}: checkpoint {saved.get(k)!r}, served {served.get(k)!r}" for k in sorted(set(saved) | set(served))
                      if saved.get(k) != served.get(k)]
            if differ:
                raise _Invalid(f"{ckpt} holds another architecture than the served model ({'; '.join(differ[:4])}"
                               f"{'; ...' if len(differ) > 4 else ''}): serve it with its own arguments")
        try:
            metadata = FileSystemReader(ckpt).read_metadata()
        except BaseException as e:  # noqa: B036
            _reraise_interrupts(e)
            raise _Invalid(f"{os.path.join(ckpt, '.metadata')} is corrupt or unreadable: {type(e).__name__}: {e}") from None
        stored = {k: tuple(getattr(m, "size", ())) for k, m in metadata.state_dict_metadata.items()}
        wanted = _sharded_tensors(self.model.sharded_state_dict(), {})
        missing = sorted(k for k in wanted if k not in stored)
        wrong = [f"{k}: checkpoint {stored[k]}, served {wanted[k]}" for k in sorted(wanted)
                 if k in stored and stored[k] != wanted[k]]
        if missing or wrong:
            raise _Invalid(f"{ckpt} does not fit the served model: " + "; ".join(
                ([f"missing {missing[:3]}"] if missing else []) + wrong[:3]))
        return ckpt

    def load(self, path: str):
        from megatron_ext.training.checkpointing import load_weights

        load_weights(self.args, [self.model], path, log=self.log)

    def __call__(self, path: str):
        error, invalid, backup = None, False, None
        weights = model_weights(self.model)
        try:
            self.validate(path)
            backup = {name: t.detach().to("cpu", copy=True) for name, t in weights.items()}
            self.load(path)
        except BaseException as e:  # noqa: B036 - whatever failed, the old weights must come back
            _reraise_interrupts(e)
            invalid = isinstance(e, _Invalid)
            error = str(e) if invalid else f"{type(e).__name__}: {e}"
        outcomes = _agree((error, invalid))
        failed = [(rank, msg, bad) for rank, (msg, bad) in enumerate(outcomes) if msg is not None]
        if not failed:
            return
        if backup is not None:
            with torch.no_grad():
                for name, t in weights.items():
                    t.copy_(backup[name])
        where = (lambda rank: f"rank {rank}: ") if len(outcomes) > 1 else (lambda rank: "")
        raise ReloadError("; ".join(where(rank) + msg for rank, msg, _ in failed) + " (previous weights kept)",
                          status=422 if all(bad for _, _, bad in failed) else 500)


def _reraise_interrupts(e: BaseException):
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise e


def _agree(outcome) -> list:
    """Every rank's outcome, on every rank (the serving job's ranks all reload together)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [outcome]
    gathered: list[Optional[tuple]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return gathered
