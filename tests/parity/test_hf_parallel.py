"""An imported HF checkpoint gives transformers' loss under TP2 (+SP), EP2 and PP2 (gloo ranks)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.convert.streaming import import_hf
from megatron_ext.data.mock import mock_batch
from megatron_ext.training.initialize import destroy
from tests.distributed.harness import run_entry
from tests.parity.hf_fixtures import make_hf_model, save_hf
from tests.tb import scalars

SEQ, GBS, SEED = 32, 4, 11


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfpar")
    model = make_hf_model("qlora_groups", num_hidden_layers=4)  # even, for two pipeline stages
    hf_dir = save_hf(model, str(root / "hf"))
    save = str(root / "mg")
    import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    batch = mock_batch(range(GBS), SEQ, 256, SEED)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    ref = F.cross_entropy(logits.reshape(-1, 256).double(), batch["labels"].reshape(-1)).item()
    return save, ref, root


@pytest.mark.parametrize("name, world, flags", [
    ("tp2_sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("ep2", 2, ["--expert-model-parallel-size", "2"]),
    ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
])
def test_imported_loss_matches_transformers(name, world, flags, imported):
    save, ref, root = imported
    tb = str(root / f"tb_{name}")
    run_entry(["--use-checkpoint-args", "--load", save, "--mock-data", "--seed", str(SEED), "--train-iters", "1",
               "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size", str(GBS),
               "--tensorboard-dir", tb, *flags], world=world)
    got = scalars(tb)["lm loss"][1]
    assert math.isclose(got, ref, rel_tol=1e-4), (got, ref)
