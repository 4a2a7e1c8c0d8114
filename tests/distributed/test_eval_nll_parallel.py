"""Codebase NLL with the model split over two tensor-parallel gloo ranks equals the one-rank figures (every rank
scores the same windows on its shard; rank 0 writes the report)."""

import json
import os

import pytest
import torch.multiprocessing as mp

from tests.distributed.harness import _free_port, join
from tests.parity.test_eval_nll import CONTEXT, STRIDE, build_inputs


def _worker(rank: int, world: int, port: int, argv: list[str]):
    join(rank, world, port)
    from megatron_ext.eval import nll

    assert nll.main(argv) == 0


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("nll_tp"))


@pytest.mark.slow
def test_tp2_equals_one_rank(inputs, tmp_path):
    argv = ["--load", inputs["ckpt"], "--tokenizer-model", inputs["tok"], "--repo", inputs["repo"],
            "--context-length", str(CONTEXT), "--stride", str(STRIDE), "--nll-chunk", "16", "--quiet"]
    one, two = str(tmp_path / "tp1.json"), str(tmp_path / "tp2.json")
    mp.spawn(_worker, args=(1, _free_port(), argv + ["--out", one]), nprocs=1, join=True)
    mp.spawn(_worker, args=(2, _free_port(), argv + ["--out", two, "--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel",
                                                     # keeps the padded vocabulary the checkpoint's (384)
                                                     "--make-vocab-size-divisible-by", "64"]), nprocs=2, join=True)
    a, b = json.load(open(one)), json.load(open(two))
    assert sorted(a["files"]) == sorted(b["files"]) == ["pkg/mod.py", "pkg/small.py"]
    for rel in a["files"]:
        assert b["files"][rel]["tokens"] == a["files"][rel]["tokens"]
        assert b["files"][rel]["nll_nats"] == pytest.approx(a["files"][rel]["nll_nats"], rel=1e-5)
    assert not os.path.exists(two + ".rank1")
