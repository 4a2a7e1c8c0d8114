"""--overlap-param-gather leaves the last step's all-gather to the next forward; a save right after the step must
still write every rank's updated shard (issue 27 item 6)."""

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.distributed.harness import run_entry

BASE = ["--model", "tiny", "--mock-data", "--num-experts", "0", "--micro-batch-size", "2", "--global-batch-size",
        "4", "--lr", "1e-2", "--seq-length", "32", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--lr-decay-style", "constant", "--train-iters", "2", "--save-interval", "1"]


def _weights(ckpt, tmp_path, name):
    out = tmp_path / f"{name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    flat = torch.load(out, weights_only=False)
    return {k: v for k, v in flat.items() if not k.startswith(("optimizer", "rng")) and "_extra_state" not in k
            and isinstance(v, torch.Tensor) and v.is_floating_point()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    run_entry(BASE + ["--save", str(root / "plain")], world=2)
    run_entry(BASE + ["--overlap-param-gather", "--save", str(root / "overlap")], world=2)
    return root


@pytest.mark.parametrize("iteration", [1, 2])
def test_checkpoint_with_overlapped_param_gather_equals_the_one_without(checkpoints, iteration):
    tag = f"iter_{iteration:07d}"
    plain = _weights(checkpoints / "plain" / tag, checkpoints, f"plain{iteration}")
    overlap = _weights(checkpoints / "overlap" / tag, checkpoints, f"overlap{iteration}")
    assert plain.keys() == overlap.keys() and len(plain) > 20
    differ = [k for k in plain if not torch.equal(plain[k], overlap[k])]
    assert not differ, f"{len(differ)} of {len(plain)} tensors differ, e.g. {differ[:4]}"
