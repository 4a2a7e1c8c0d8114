"""Issue 25, items 1-4: a fresh run never overwrites a --save it does not continue, a resume compares every
architecture field, --clip-grad is validated."""

import dataclasses
import os

import pytest

import pretrain_composer as entry
from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.models.presets import ModelPreset
from megatron_ext.training.checkpointing import MANIFEST, TRACKER, checkpoint_dir, read_tracker

TINY = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32",
        "--lr-decay-style", "constant", "--log-interval", "1"]


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    """A --save directory holding iterations 2 and 4 (tracker at 4)."""
    save = str(tmp_path_factory.mktemp("run") / "ckpt")
    assert entry.main(TINY + ["--train-iters", "4", "--save", save, "--save-interval", "2"]) == 0
    assert read_tracker(save) == 4
    return save


def _manifests(save):
    return {i: open(os.path.join(checkpoint_dir(save, i), MANIFEST)).read() for i in (2, 4)}


def test_fresh_run_into_a_save_with_checkpoints_is_refused(two_saves, capsys):
    before = _manifests(two_saves)
    code = entry.main(TINY + ["--train-iters", "2", "--save", two_saves])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--save {two_saves} already holds checkpoints at iterations 2, 4" in err
    assert f"--load {two_saves}" in err and "--override-save" in err
    assert "Traceback" not in err
    assert read_tracker(two_saves) == 4 and _manifests(two_saves) == before


def test_override_save_starts_over_explicitly(tmp_path):
    save = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(save, "iter_0000003"))
    with open(os.path.join(save, TRACKER), "w") as f:
        f.write("3")
    assert entry.main(TINY + ["--train-iters", "2", "--save", save]) == 2
    assert entry.main(TINY + ["--train-iters", "2", "--save", save, "--override-save"]) == 0
    assert read_tracker(save) == 2


def test_training_after_an_import_into_the_save_does_not_replace_its_iterations(two_saves, tmp_path, capsys):
    """What `convert_checkpoint.py import --overwrite` leaves: the tracker at release/, the iter_* kept."""
    save = str(tmp_path / "ckpt")
    os.makedirs(save)
    os.symlink(checkpoint_dir(two_saves, 2), checkpoint_dir(save, 2))
    os.makedirs(os.path.join(save, "release"))
    with open(os.path.join(save, TRACKER), "w") as f:
        f.write("release")
    code = entry.main(TINY + ["--train-iters", "2", "--save", save, "--load", save])
    err = capsys.readouterr().err
    assert code == 2
    assert "holds training checkpoints at iteration 2 besides the converted checkpoint" in err
    assert "--override-save" in err and "Traceback" not in err
    assert os.path.islink(checkpoint_dir(save, 2))


def test_resume_with_a_changed_router_topk_is_refused(two_saves, capsys):
    code = entry.main(TINY + ["--train-iters", "6", "--load", two_saves, "--moe-router-topk", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert "--moe-router-topk 3 here, 2 in the checkpoint" in err
    assert "--finetune" in err and "Traceback" not in err


def test_every_architecture_field_has_a_flag_to_name():
    from megatron_ext.models.presets import field_flag

    flags = {f.name: field_flag(f.name) for f in dataclasses.fields(ModelPreset)}
    assert flags["moe_router_topk"] == "--moe-router-topk" and flags["mla_nope"] == "--mla-nope"
    assert all(flag.startswith("--") for flag in flags.values())


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_clip_grad_must_be_finite_and_not_negative(value):
    with pytest.raises(ArgumentError, match=r"--clip-grad must be a finite number >= 0.*0 switches clipping off"):
        parse_args(TINY + ["--clip-grad", value], world_size=1)
