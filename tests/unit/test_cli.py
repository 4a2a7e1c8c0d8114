"""What the entry script says: --help, --dry-run, and a log line for every checkpoint saved."""

import os
import re

import pytest

import pretrain_composer as entry
from megatron_ext.arguments import _ARCH_FLAGS, build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def help_text(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    return build_parser(description=entry.__doc__).format_help()


def test_help_shows_each_default_once_and_only_real_ones(help_text):
    assert "(default: None)" not in help_text and "(default: False)" not in help_text
    flat = " ".join(help_text.split())  # argparse wraps help text
    assert flat.count("(default:") == len(re.findall(r"\(default: [^)(]*\)", flat))  # none doubled or nested
    # + --untie-embeddings-and-output-weights, --mla-nope
    assert flat.count("(default: from --model)") == len(_ARCH_FLAGS) + 2
    assert "(default: from --model) (default" not in flat
    assert "--seed SEED random seed (default: 1234)" in flat
    assert "--lr-decay-style" in flat and re.search(r"--clip-grad CLIP_GRAD .*\(default: 1\.0\)", flat)


def test_help_keeps_the_usage_examples_as_lines(help_text):
    lines = help_text.splitlines()
    examples = [line for line in entry.__doc__.splitlines() if line.strip()]
    assert len(examples) >= 6
    for line in examples:
        assert line in lines, line


def test_dry_run_prints_the_resolved_configuration(capsys):
    assert entry.main(["--model", "tiny", "--dry-run", "--num-layers", "3", "--seq-length", "96"]) == 0
    out = capsys.readouterr().out
    arguments = out[out.index("--- arguments ---"): out.index("end of arguments")]
    architecture = out[out.index("--- architecture ---"): out.index("end of architecture")]
    assert re.search(r"\n  tensor_model_parallel_size \.+ 1\n", arguments)
    assert re.search(r"\n  num_layers \.+ 3\n", architecture) and re.search(r"\n  seq_length \.+ 96\n", architecture)
    assert re.search(r"\n  kv_lora_rank \.+ \d+\n", architecture)  # from the preset, not given as a flag
    assert re.search(r"\ntotal parameters: \d+\nactive parameters per token: \d+\n"
                     r"active parameters per token without the input embedding: \d+\n$", out)


def test_flag_file_dry_run_names_world_size(monkeypatch, capsys):
    flags = [f"@{ROOT}/examples/kimi-k2.5/pretrain-32k.args", "--dry-run"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert entry.main(flags) == 2
    assert "WORLD_SIZE=512" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "512")
    assert entry.main(flags) == 0
    assert "world_size ...................................... 512" in capsys.readouterr().out


def test_every_checkpoint_saved_is_logged(tmp_path, capsys):
    save = str(tmp_path / "ckpt")
    assert entry.main(["--model", "tiny", "--mock-data", "--train-iters", "3", "--save", save, "--save-interval", "2",
                       "--log-interval", "10"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("saved checkpoint")]
    assert [re.sub(r" \(\d+\.\d s\)$", "", line) for line in lines] == [
        f"saved checkpoint at iteration 2 to {save}/iter_0000002",
        f"saved checkpoint at iteration 3 to {save}/iter_0000003"]
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
