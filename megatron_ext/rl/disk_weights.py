"""Weight publication to disk: each version a Megatron checkpoint directory (model only) that remote inference
servers reload by path (tools/serve.py `/v1/reload`, SGLang-style `/update_weights_from_disk`).

    ROOT/iter_0000007/   the weights of version 7 (written to a .tmp directory, published atomically)
    ROOT/latest_checkpointed_iteration.txt   the newest complete version

Every trainer rank writes its shards (a collective, like a checkpoint save); older versions than the newest
`keep` are removed, so a server reloading the tracker's version never reads a half-written directory.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import time

import torch.distributed as dist

from megatron_ext.training.checkpointing import checkpoint_dir, save_checkpoint


class DiskWeights:
    def __init__(self, args: argparse.Namespace, root: str, keep: int = 2):
        self.args = copy.copy(args)
        self.args.save = root
        self.args.no_save_optim = True
        self.root, self.keep = root, keep
        self.versions: list[int] = []

    def publish(self, model, version: int) -> dict[str, float]:
        """Write version `version` of `model` (every rank calls this); returns seconds and bytes written."""
        t0 = time.perf_counter()
        save_checkpoint(self.args, version, model, None, None, extra={"weights_version": version})
        self.versions.append(version)
        path = checkpoint_dir(self.root, version)
        size = 0
        if dist.get_rank() == 0:
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            for old in self.versions[:-self.keep]:
                shutil.rmtree(checkpoint_dir(self.root, old), ignore_errors=True)
        self.versions = self.versions[-self.keep:]
        return {"publish disk seconds": time.perf_counter() - t0, "publish disk bytes": float(size)}

    def path(self, version: int) -> str:
        return checkpoint_dir(self.root, version)
