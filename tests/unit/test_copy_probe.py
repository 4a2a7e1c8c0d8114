"""benchmarks/copy_probe.py's documents and bounds (the probe itself is a benchmark: docs/benchmarks.md)."""

import importlib.util
import math
import os

import pytest

from tests.unit.data_fixtures import ROOT, small_corpus, trained_tokenizer


def _probe():
    spec = importlib.util.spec_from_file_location("copy_probe", os.path.join(ROOT, "benchmarks", "copy_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_token_documents_repeat_one_token_words_at_varying_distances(tmp_path):
    from tokenizers import Tokenizer

    tokenizer_dir = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024)
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    probe = _probe()
    docs = probe.token_documents(300, 8, 3, tokenizer_dir, pool=40)
    lengths, words = set(), set()
    for d in docs:
        first, second = d.split(" | ")
        assert first == second
        ws = first.split(" ")
        lengths.add(len(ws))
        words.update(ws)
        assert len(tok.encode(" " + first).ids) == len(ws), first  # one token a word (after a space)
    assert lengths == set(range(4, 17))  # the copy's distance varies: no fixed offset copies
    assert 30 <= len(words) <= 40 and all(w.isascii() and w.isalpha() for w in words)
    assert probe.token_documents(300, 8, 3, tokenizer_dir, pool=40) == docs  # seeded


def test_token_bounds_count_the_draws():
    b = _probe().token_bounds(8, 400)  # L uniform over 4..16: mean 10, 22 predictions a document
    assert b["no_copy"] == pytest.approx(20 * math.log(400) / 22)
    assert b["perfect_copy"] == pytest.approx(b["no_copy"] / 2) and b["tokens_per_document"] == 22
