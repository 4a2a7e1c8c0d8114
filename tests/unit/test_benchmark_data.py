"""benchmarks/stages_loss.py measures YaRN's short-context cost on documents the model never trained on."""

import importlib.util
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data.gpt import parse_split, split_ranges
from tests.unit.data_fixtures import preprocessed, small_corpus, trained_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stages_loss():
    spec = importlib.util.spec_from_file_location("stages_loss", os.path.join(ROOT, "benchmarks", "stages_loss.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_context_windows_come_from_the_held_out_splits(tmp_path, monkeypatch):
    corpus = small_corpus(str(tmp_path))
    prefix = preprocessed(str(tmp_path), corpus, trained_tokenizer(str(tmp_path), corpus), name="stdlib")
    bench = _stages_loss()
    monkeypatch.setattr(bench, "DATA", str(tmp_path))
    ds = IndexedDataset(prefix)
    split = "70,20,10"
    train_end = split_ranges(len(ds), parse_split(split))[0][1]
    assert 0 < train_end < len(ds)
    held_out = np.concatenate([ds[i] for i in range(train_end, len(ds))]).astype(np.int64)
    batches, (first, end) = bench.held_out_windows(split, windows=4, seq=32)
    assert first == train_end and train_end < end <= len(ds)
    rows = np.concatenate([np.concatenate([t.numpy(), l.numpy()[:, -1:]], axis=1) for t, l in batches])
    assert rows.shape == (4, 33)
    np.testing.assert_array_equal(rows.reshape(-1), held_out[:4 * 33])  # the held-out documents, in order
    for t, l in batches:
        np.testing.assert_array_equal(t.numpy()[:, 1:], l.numpy()[:, :-1])
    with pytest.raises(SystemExit, match="held-out documents"):
        bench.held_out_windows(split, windows=10 ** 4, seq=256)
