"""The flag files under examples/ parse and validate for the layouts they are written for."""

import glob
import os

import pytest

from megatron_ext.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = {"kimi-k2.5": 64, "tiny": 2}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "*", "*.args"))),
                         ids=lambda p: os.path.relpath(p, os.path.join(ROOT, "examples")))
def test_flag_file_parses(path):
    family = os.path.basename(os.path.dirname(path))
    args = parse_args([f"@{path}", "--dry-run"], world_size=WORLD[family])
    stage = os.path.basename(path).split("-")[0].split(".")[0]
    assert args.stage == stage
    if family == "kimi-k2.5":
        assert args.arch.num_experts == 384 and args.expert_model_parallel_size == 8
        assert args.context_parallel_size >= 2


def test_flags_after_a_file_override_it():
    path = os.path.join(ROOT, "examples", "tiny", "pretrain.args")
    args = parse_args([f"@{path}", "--dry-run", "--train-iters", "7"], world_size=1)
    assert args.train_iters == 7 and args.seq_length == 256
