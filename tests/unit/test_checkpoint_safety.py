"""Issue 11: checkpoint integrity (CRC-32 manifest, .metadata), resume checks (schedule, architecture)."""

import json
import os
import shutil

import pytest

import pretrain_composer as entry
from megatron_ext.training import checkpointing
from megatron_ext.training.checkpointing import CHECKSUM_SIDECAR, MANIFEST, checkpoint_dir, file_crc32, read_tracker
from tests.tb import scalars

TINY = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "32",
        "--lr-decay-style", "linear", "--log-interval", "1"]


def run(tmp_path, name, *flags):
    tb = str(tmp_path / f"tb_{name}")
    code = entry.main(TINY + ["--tensorboard-dir", tb, *flags])
    return code, scalars(tb) if os.path.isdir(tb) else {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-iteration checkpoint (lr 3e-3, 6 iterations of linear decay), with the files the manifest step read."""
    tmp_path = tmp_path_factory.mktemp("saved")
    save = str(tmp_path / "ckpt")
    read_back = []
    original = checkpointing.file_crc32

    def recording(path):
        read_back.append(os.path.basename(path))
        return original(path)

    checkpointing.file_crc32 = recording
    try:
        code, _ = run(tmp_path, "a", "--lr", "3e-3", "--train-iters", "6", "--exit-interval", "2", "--save", save)
    finally:
        checkpointing.file_crc32 = original
    assert code == 0 and read_tracker(save) == 2
    return save, read_back


def _copy(saved, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], dst)
    return dst


def test_manifest_records_checksums_computed_while_writing(saved):
    save, read_back = saved
    ckpt = checkpoint_dir(save, 2)
    files = json.load(open(os.path.join(ckpt, MANIFEST)))["files"]
    data_files = [rel for rel in files if rel.endswith(".distcp")]
    assert data_files, files
    for rel, entry_ in files.items():
        path = os.path.join(ckpt, rel)
        assert entry_["size"] == os.path.getsize(path)
        assert entry_["crc32"] == f"{file_crc32(path):08x}", rel
    # the data files' CRCs came from the bytes as written: the manifest step read only the small files
    assert not set(data_files) & set(read_back), read_back
    assert ".metadata" in read_back and "common.pt" in read_back
    assert not [n for n in os.listdir(ckpt) if n.endswith(CHECKSUM_SIDECAR)]


def test_same_size_corruption_of_a_data_file_is_named(saved, tmp_path, capsys):
    save = _copy(saved, tmp_path)
    victim = os.path.join(checkpoint_dir(save, 2), "__0_1.distcp")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:  # flip bytes in the middle: the size stays, the sizes-only check passed this
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    code, _ = run(tmp_path, "b", "--lr", "3e-3", "--train-iters", "6", "--load", save)
    assert code == 1
    err = capsys.readouterr().err
    assert victim in err and "CRC-32" in err and "corrupt" in err
    with pytest.raises(checkpointing.CheckpointError, match="__0_1.distcp is corrupt"):
        checkpointing.verify_checkpoint(checkpoint_dir(save, 2), checksums=True)
    # the check is shared out: the rank that does not own this file does not read it
    files = sorted(checkpointing.read_manifest(checkpoint_dir(save, 2)))
    owner = files.index("__0_1.distcp") % 2
    checkpointing.verify_checkpoint(checkpoint_dir(save, 2), checksums=True, rank=1 - owner, world=2)


def test_corrupt_metadata_is_named_when_checksums_are_skipped(saved, tmp_path, capsys):
    save = _copy(saved, tmp_path)
    metadata = os.path.join(checkpoint_dir(save, 2), ".metadata")
    size = os.path.getsize(metadata)
    with open(metadata, "r+b") as f:
        f.write(b"\x00" * size)
    code, _ = run(tmp_path, "b", "--lr", "3e-3", "--train-iters", "6", "--load", save, "--skip-checkpoint-checksums")
    assert code == 1
    err = capsys.readouterr().err
    assert f"checkpoint file {metadata} is corrupt" in err
    assert "AssertionError" not in err


def test_changed_schedule_is_refused_naming_the_values(saved, tmp_path, capsys):
    save = saved[0]
    code, _ = run(tmp_path, "b", "--lr", "1e-3", "--train-iters", "6", "--load", save)
    assert code == 1
    err = capsys.readouterr().err
    assert "--lr: 0.001 here, 0.003 in the checkpoint" in err
    assert "--override-opt_param-scheduler" in err and "--use-checkpoint-opt_param-scheduler" in err
    code, _ = run(tmp_path, "c", "--lr", "3e-3", "--train-iters", "10", "--load", save)
    assert code == 1
    err = capsys.readouterr().err
    assert "--lr-decay-iters (default: --train-iters): 40 samples (10 iterations" in err
    assert "24 samples (6 iterations" in err


def test_schedule_override_and_checkpoint_flags_pick_the_schedule(saved, tmp_path):
    save = saved[0]
    # linear decay from the peak over 6 iterations (24 samples); iteration 3 starts at 8 consumed samples
    code, flags = run(tmp_path, "flags", "--lr", "1e-3", "--train-iters", "3", "--lr-decay-iters", "6", "--load",
                      save, "--override-opt_param-scheduler")
    assert code == 0
    code, ckpt = run(tmp_path, "ckpt", "--lr", "1e-3", "--train-iters", "3", "--lr-decay-iters", "6", "--load", save,
                     "--use-checkpoint-opt_param-scheduler")
    assert code == 0
    code, no_optim = run(tmp_path, "no_optim", "--lr", "1e-3", "--train-iters", "3", "--lr-decay-iters", "6",
                         "--load", save, "--use-checkpoint-opt_param-scheduler", "--no-load-optim")
    assert code == 0
    assert flags["learning-rate"][3] == pytest.approx(1e-3 * (1 - 12 / 24))
    assert ckpt["learning-rate"][3] == pytest.approx(3e-3 * (1 - 12 / 24))
    assert no_optim["learning-rate"][3] == pytest.approx(3e-3 * (1 - 12 / 24))
    code, same = run(tmp_path, "same", "--lr", "3e-3", "--train-iters", "6", "--exit-interval", "3", "--load", save)
    assert code == 0 and same["learning-rate"][3] == pytest.approx(3e-3 * (1 - 12 / 24))


def test_different_architecture_names_the_field(saved, tmp_path, capsys):
    code, _ = run(tmp_path, "b", "--lr", "3e-3", "--train-iters", "6", "--load", saved[0], "--hidden-size", "96")
    assert code == 1
    err = capsys.readouterr().err
    assert "different architecture" in err and "--hidden-size 96 here" in err
    assert "--use-checkpoint-args" in err
    assert "KeyError" not in err and "Traceback" not in err


def test_missing_load_directory_is_an_error_unless_optional(tmp_path, capsys):
    missing = str(tmp_path / "typo")
    code, _ = run(tmp_path, "b", "--train-iters", "1", "--load", missing)
    assert code == 2
    err = capsys.readouterr().err
    assert f"--load {missing} does not exist" in err and "--load-optional" in err
    code, _ = run(tmp_path, "c", "--train-iters", "1", "--load", missing, "--load-optional")
    assert code == 0 and not os.path.exists(missing)
