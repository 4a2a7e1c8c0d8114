"""benchmarks/copy_probe.py's documents and bounds (the probe itself is a benchmark: docs/benchmarks.md)."""

import math
import os

import pytest

from tests.unit.data_fixtures import ROOT, load_tool, small_corpus, trained_tokenizer


def _probe():
    return load_tool("copy_probe", "benchmarks")


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


@pytest.mark.slow
def test_probe_trains_saves_and_measures_a_checkpoint(tmp_path):
    """The probe end to end at its smallest: a few steps with --save, then --measure of what it saved."""
    import json
    import subprocess
    import sys

    tokenizer_dir = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024)
    out, ckpt = tmp_path / "probe", tmp_path / "ckpt"
    common = ["--out", str(out), "--kind", "tokens", "--tokenizer-model", tokenizer_dir, "--documents", "400",
              "--ranks", "1"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    trained = subprocess.run([sys.executable, "benchmarks/copy_probe.py", *common, "--iters", "3", "--batch", "4",
                              "--log-interval", "1", "--save", str(ckpt)], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary["curve"]] == [1, 2, 3] and all(r["loss"] > 0 for r in summary["curve"])
    measured = subprocess.run([sys.executable, "benchmarks/copy_probe.py", *common, "--measure", str(ckpt),
                               "--measure-documents", "20"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
    assert measured.returncode == 0, measured.stderr[-2000:]
    m = json.loads((out / "measure_ckpt.json").read_text())
    assert m["documents"] == 20 and 0.0 <= m["top1"] <= 1.0 and 0.0 < m["p_copy"] < 1.0
    halves = [d.split(" | ")[0] for d in _probe().token_documents(420, 8, 1, tokenizer_dir, 400)[400:]]
    assert m["copied_tokens"] == sum(len(h.split(" ")) for h in halves)  # every word after the bar, one token each
