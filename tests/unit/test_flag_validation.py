"""Issue 11 item 9: bad flag values are refused with the flag named, before anything is built."""

import os

import pytest

from megatron_ext.arguments import ArgumentError, parse_args


def _parse(*flags):
    return parse_args(["--model", "tiny", "--mock-data", *flags], world_size=1)


@pytest.mark.parametrize("flags, message", [
    (["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    (["--seq-length", "-8"], "--seq-length must be >= 1, got -8"),
    (["--lr=-1e-3"], "--lr must be a finite number >= 0, got -0.001"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--min-lr", "inf"], "--min-lr must be a finite number >= 0, got inf"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], "exclude each other"),
])
def test_bad_values_name_the_flag(flags, message):
    with pytest.raises(ArgumentError) as e:
        _parse(*flags)
    assert message in str(e.value)


def test_missing_load_directory(tmp_path):
    missing = str(tmp_path / "chekpoints")
    with pytest.raises(ArgumentError, match=f"--load {missing} does not exist.*--load-optional"):
        _parse("--load", missing)
    assert _parse("--load", missing, "--load-optional").load == missing
    # the resumable-job idiom: --load and --save name the same (not yet created) directory
    assert _parse("--load", missing, "--save", missing + "/").load == missing
    with pytest.raises(ArgumentError, match="--load .* does not exist"):
        _parse("--load", missing, "--finetune")
    with pytest.raises(ArgumentError, match=f"--use-checkpoint-args: no checkpoint under {tmp_path}"):
        _parse("--load", str(tmp_path), "--use-checkpoint-args")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ArgumentError, match="is not a directory"):
        _parse("--load", str(a_file))
    assert os.listdir(tmp_path) == ["file"]
