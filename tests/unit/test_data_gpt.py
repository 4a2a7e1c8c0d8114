"""Pretraining data through Megatron-Core's builder: blending proportions, splits, sample order, resume,
and bad data caught before training."""

import argparse
import os

import numpy as np
import pytest

import pretrain_composer as entry
from megatron_ext.data.batches import microbatch_indices
from megatron_ext.data.gpt import (DatasetSource, build_gpt_datasets, parse_data_path, parse_split,
                                   split_ranges)
from megatron_ext.data.indexed import DataError
from megatron_ext.data.mock import mock_batch, mock_microbatches
from megatron_ext.data.tokenizers import build_tokenizer
from tests.tb import scalars
from tests.unit.data_fixtures import preprocessed, small_corpus, trained_tokenizer


OTHER_MODULES = ("argparse.py", "locale.py", "calendar.py", "difflib.py", "enum.py", "gettext.py", "netrc.py",
                 "pprint.py", "queue.py", "sched.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gpt"))
    corpus = small_corpus(d)
    tok = trained_tokenizer(d, corpus)
    a = preprocessed(d, corpus, tok, "a")
    b = preprocessed(d, small_corpus(os.path.join(d, "b"), OTHER_MODULES), tok, "b")
    return d, tok, a, b


def _args(d, tok, data_path, train_samples, **kw):
    ns = dict(data_path=data_path, split="98,1,1", seed=1234, seq_length=32, data_cache_path=os.path.join(d, "cache"),
              train_iters=train_samples // 16, global_batch_size=16, eval_iters=1, tokenizer_type="HFTokenizer",
              tokenizer_model=tok)
    ns.update(kw)
    return argparse.Namespace(**ns)


def test_blending_proportions_within_one_percent(data):
    d, tok, a, b = data
    # no cache path: Megatron-Core's BlendedDataset only caches inside an initialised process group
    args = _args(d, tok, ["0.7", a, "0.3", b], 10_000, split="80,10,10", data_cache_path=None)
    train, valid, test = build_gpt_datasets(args, build_tokenizer("HFTokenizer", tok))
    assert len(train) >= 10_000
    share = np.bincount(np.asarray(train.dataset_index[:10_000]), minlength=2) / 10_000
    assert abs(share[0] - 0.7) < 0.01 and abs(share[1] - 0.3) < 0.01
    samples = [train[i] for i in range(0, 10_000, 997)]
    assert {int(s["dataset_id"]) for s in samples} == {0, 1}
    batch = DatasetSource(train, "train")(range(3))
    assert batch["tokens"].shape == (3, 32) and batch["labels"].shape == (3, 32)
    assert bool((batch["tokens"][:, 1:] == batch["labels"][:, :-1]).all())  # labels are the next tokens
    assert valid is not None and test is not None


def test_split_and_data_path_parsing():
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    for bad in (["0.7", "a", "b"], ["a", "0.3"], ["0", "a"]):
        with pytest.raises(ValueError, match="--data-path"):
            parse_data_path(bad)
    assert parse_split("98,1,1") == pytest.approx([0.98, 0.01, 0.01])
    assert parse_split("1") == [1.0, 0.0, 0.0] and parse_split("2/1/1") == [0.5, 0.25, 0.25]
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)
    assert split_ranges(100, parse_split("98,1,1")) == [(0, 98), (98, 99), (99, 100)]


def test_sample_order_is_one_function_for_every_source():
    """Rank r of a DP group takes the slots Megatron gives it; the union over ranks is the global batch, and
    iteration i never depends on earlier iterations (what makes resume and resharding exact)."""
    gbs, mbs = 16, 2
    for dp in (1, 2, 4):
        seen = sorted(i for r in range(dp) for rng in microbatch_indices(3, gbs, mbs, r, dp) for i in rng)
        assert seen == list(range(48, 64))
    assert [list(r) for r in microbatch_indices(1, 8, 2, 1, 2)] == [[10, 11], [14, 15]]
    batches = list(mock_microbatches(1, 8, 2, 1, 2, 16, 100, 7))
    assert all((b["tokens"] == mock_batch(r, 16, 100, 7)["tokens"]).all()
               for b, r in zip(batches, microbatch_indices(1, 8, 2, 1, 2)))


def test_empty_or_broken_data_fails_before_training(data, tmp_path, capsys):
    d, tok, a, _ = data
    with pytest.raises(DataError, match="rounds to none"):
        build_gpt_datasets(_args(d, tok, [a], 64, split="99.99,0.01,0"), build_tokenizer("HFTokenizer", tok))
    for ext in (".bin", ".idx"):
        with open(a + ext, "rb") as src, open(str(tmp_path / "cut") + ext, "wb") as dst:
            dst.write(src.read())
    with open(str(tmp_path / "cut.bin"), "r+b") as f:
        f.truncate(1000)
    base = ["--model", "tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--tokenizer-model", tok, "--train-iters", "2"]
    code = entry.main(base + ["--data-path", str(tmp_path / "cut")])
    err = capsys.readouterr().err
    assert code == 1 and "cut.bin is truncated" in err
    small = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=600)
    code = entry.main(base[:-4] + ["--tokenizer-model", small, "--train-iters", "2", "--data-path", a])
    err = capsys.readouterr().err
    assert code == 1 and "a_text_document.bin contains token id" in err and "another tokenizer" in err
    code = entry.main(base[:-2] + ["--train-iters", "2"])
    assert code == 2 and "--data-path" in capsys.readouterr().err


def test_pretraining_on_real_data_resumes_bit_exactly(data, tmp_path):
    d, tok, a, b = data
    flags = ["--model", "tiny", "--data-path", "0.5", a, "0.5", b, "--split", "90,10,0", "--tokenizer-model", tok,
             "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
             "--train-iters", "6", "--eval-interval", "3", "--eval-iters", "1", "--data-cache-path",
             str(tmp_path / "cache")]
    full_tb, part_tb, save = str(tmp_path / "full"), str(tmp_path / "part"), str(tmp_path / "ckpt")
    assert entry.main(flags + ["--tensorboard-dir", full_tb]) == 0
    assert entry.main(flags + ["--save", save, "--save-interval", "3", "--exit-interval", "3"]) == 0
    assert entry.main(flags + ["--load", save, "--tensorboard-dir", part_tb]) == 0
    full, part = scalars(full_tb), scalars(part_tb)
    assert full["lm loss"][6] < full["lm loss"][1]
    for step in (4, 5, 6):
        assert part["lm loss"][step] == full["lm loss"][step]
    assert part["lm loss validation"][6] == full["lm loss validation"][6]
