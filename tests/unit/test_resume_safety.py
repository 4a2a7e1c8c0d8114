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


def test_a_first_save_killed_before_its_tracker_resumes(two_saves, tmp_path, capsys):
    """A kill between a first save's rename (iter_N/ complete, manifest in it) and its tracker write leaves no
    tracker. The re-run of a resuming command continues from that checkpoint; a fresh start is still refused."""
    import shutil

    save = str(tmp_path / "ckpt")
    os.makedirs(save)
    shutil.copytree(checkpoint_dir(two_saves, 2), checkpoint_dir(save, 2))
    os.makedirs(checkpoint_dir(save, 3) + ".tmp")  # what a later, unfinished save leaves: never a candidate
    assert not os.path.exists(os.path.join(save, TRACKER)) and read_tracker(save) == 2
    capsys.readouterr()
    assert entry.main(TINY + ["--train-iters", "4", "--load", save, "--save", save]) == 0
    out = capsys.readouterr().out
    assert f"loaded {checkpoint_dir(save, 2)} (iteration 2)" in out
    assert read_tracker(save) == 4 and open(os.path.join(save, TRACKER)).read().strip() == "4"
    code = entry.main(TINY + ["--train-iters", "2", "--save", save])
    assert code == 2 and "already holds checkpoints at iterations 2, 4" in capsys.readouterr().err


def test_iteration_directories_without_tracker_or_manifest_are_named(tmp_path, capsys):
    """Not ours (no manifest) and no tracker: nothing to resume from; the refusal says so, not '--finetune'."""
    save = str(tmp_path / "ckpt")
    os.makedirs(checkpoint_dir(save, 5))
    assert read_tracker(save) is None
    code = entry.main(TINY + ["--train-iters", "2", "--load", save, "--save", save])
    err = capsys.readouterr().err
    assert code == 2 and "--finetune" not in err
    assert f"no {TRACKER} and no complete checkpoint (iter_N/ with {MANIFEST})" in err
    assert "--override-save" in err


@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "move-aside"])
def test_a_checkpoint_saved_again_replaces_the_old_one_by_renames(tmp_path, monkeypatch, atomic):
    """Re-saving iteration N swaps the new iter_N/ in for the old one in one atomic rename where the file system
    can (so iter_N/ never goes missing), else moves the old one aside first; the tracker never names a
    half-deleted directory, and a leftover of a kill in between (iter_N.old/) is neither a checkpoint nor kept."""
    from megatron_ext.training import checkpointing

    if not atomic:
        monkeypatch.setattr(checkpointing, "_exchange", lambda a, b: False)
    else:
        real_replace = checkpointing.os.replace

        def replace(src, dst):  # with the exchange, iter_N/ itself is never renamed away
            assert os.path.abspath(src) != os.path.abspath(final), "iter_N/ moved aside: not swapped atomically"
            return real_replace(src, dst)

        monkeypatch.setattr(checkpointing.os, "replace", replace)

    root = str(tmp_path / "ckpt")
    final = checkpoint_dir(root, 3)

    def write(tag):
        tmp = final + ".tmp"
        os.makedirs(tmp)
        with open(os.path.join(tmp, "data"), "w") as f:
            f.write(tag)
        checkpointing.publish(root, tmp, final, 3)

    write("first")
    os.makedirs(final + ".old")  # what a kill after the move-aside left from an earlier replacement
    assert checkpointing.saved_iterations(root) == [3] and read_tracker(root) == 3
    removed = []
    real_rmtree = checkpointing.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # the old checkpoint is never deleted where the tracker points
        removed.append((path, os.path.exists(os.path.join(path, "data")) and open(os.path.join(path, "data")).read()))
        assert os.path.abspath(path) != os.path.abspath(final)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpointing.shutil, "rmtree", rmtree)
    write("second")
    assert open(os.path.join(final, "data")).read() == "second"
    assert ("first" in [content for _, content in removed]) and not os.path.exists(final + ".old")
    assert sorted(os.listdir(root)) == ["iter_0000003", TRACKER]
