"""tools/preprocess_data.py: JSONL -> .bin/.idx that decodes back to the input, whatever the worker count;
bad lines named by number; no partial outputs; index integrity checks; Punkt trained offline."""

import io
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.data import preprocess as pp
from megatron_ext.data.indexed import DataError, verify_indexed_dataset
from megatron_ext.data.tokenizers import build_tokenizer
from tests.unit.data_fixtures import load_tool, read_texts, small_corpus, trained_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pre"))
    corpus = small_corpus(d)
    return d, corpus, trained_tokenizer(d, corpus)


def _run(corpus, tokenizer, prefix, **kw):
    kw.setdefault("append_eod", True)
    cfg = pp.PreprocessConfig(input=corpus, output_prefix=prefix, tokenizer_model=tokenizer,
                              tokenizer_type="HFTokenizer", **kw)
    return cfg, pp.preprocess(cfg, progress_stream=io.StringIO())


def _documents(prefix):
    ds = IndexedDataset(prefix)
    docs = ds.document_indices
    out = [[ds[int(s)].tolist() for s in range(docs[i], docs[i + 1])] for i in range(len(docs) - 1)]
    del ds
    return out


def test_round_trip_and_worker_count_does_not_change_the_bytes(inputs):
    d, corpus, tok_dir = inputs
    tok = build_tokenizer("HFTokenizer", tok_dir)
    texts = read_texts(corpus)
    # small chunks so that two workers really split the file
    _, one = _run(corpus, tok_dir, f"{d}/w1", workers=1, chunk_bytes=20_000)
    _, two = _run(corpus, tok_dir, f"{d}/w2", workers=2, chunk_bytes=20_000)
    p1, p2 = one.outputs["text"], two.outputs["text"]
    assert p1 == f"{d}/w1_text_document"
    for ext in (".bin", ".idx"):
        assert open(p1 + ext, "rb").read() == open(p2 + ext, "rb").read()
    summary = verify_indexed_dataset(p1)
    assert summary.documents == len(texts) == one.documents and summary.tokens == one.tokens["text"]
    assert summary.dtype == np.uint16  # a 1024-id vocabulary fits in two bytes
    docs = _documents(p1)
    for text, (ids,) in zip(texts, docs):
        assert ids[-1] == tok.eod and tok.decode(ids[:-1]) == text
    assert one.docs_per_second > 0 and one.mb_per_second > 0
    assert not [f for f in os.listdir(d) if ".shards." in f or f.endswith(".tmp")]


def _corrupt_input(d, corpus):
    lines = open(corpus).read().splitlines()
    bad = lines[:3] + ['{"text": "unterminated', "[1, 2]", '{"other": "x"}', '{"text": 7}', ""] + lines[3:]
    path = os.path.join(d, "bad.jsonl")
    with open(path, "w") as f:
        f.write("\n".join(bad) + "\n")
    return path, len(lines)


def test_malformed_lines_fail_by_number_and_leave_nothing(inputs):
    d, corpus, tok_dir = inputs
    bad, _ = _corrupt_input(d, corpus)
    with pytest.raises(DataError) as err:
        _run(bad, tok_dir, f"{d}/failed", workers=2, chunk_bytes=5_000)
    msg = str(err.value)
    assert "line 4: invalid JSON" in msg and "--on-error skip" in msg
    assert not [f for f in os.listdir(d) if f.startswith("failed")]


def test_skip_mode_counts_and_reports_line_numbers(inputs):
    d, corpus, tok_dir = inputs
    bad, good = _corrupt_input(d, corpus)
    cfg, result = _run(bad, tok_dir, f"{d}/skipped", workers=2, chunk_bytes=5_000, on_error="skip")
    assert result.documents == good and result.bad_lines == 4 and result.blank_lines == 1
    assert [n for n, _ in result.bad_line_examples] == [4, 5, 6, 7]
    reasons = dict(result.bad_line_examples)
    assert "invalid JSON" in reasons[4] and "JSON object" in reasons[5]
    assert "no 'text' field" in reasons[6] and "not a string" in reasons[7]
    assert any("skipped 4 malformed lines" in line for line in pp.summary(cfg, result))


def test_failure_during_merge_removes_partial_outputs(inputs, monkeypatch):
    d, corpus, tok_dir = inputs
    _run(corpus, tok_dir, f"{d}/keep")  # a complete older output must survive a failed rerun
    before = open(f"{d}/keep_text_document.bin", "rb").read()

    def explode(self, prefix):
        raise OSError("disk full")

    monkeypatch.setattr(pp.IndexedDatasetBuilder, "add_index", explode)
    with pytest.raises(OSError, match="disk full"):
        _run(corpus, tok_dir, f"{d}/keep", workers=2)
    assert open(f"{d}/keep_text_document.bin", "rb").read() == before
    assert not [f for f in os.listdir(d) if f.startswith("keep") and (".tmp" in f or ".shards." in f)]


def _prose(n_docs=60, seed=0):
    """Varied sentences in which 'e.g.' and 'Dr.' recur mid-sentence: enough for Punkt to learn them."""
    rng = random.Random(seed)
    words = ("alpha beta gamma delta river stone cloud paper window garden silver morning letter engine bridge "
             "market summer winter forest ocean").split()

    def sentence():
        w = [rng.choice(words) for _ in range(rng.randint(4, 10))]
        if rng.random() < 0.3:
            w.insert(2, "e.g.")
        if rng.random() < 0.2:
            w.insert(0, "Dr. Smith")
        text = " ".join(w)
        return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])

    return [" ".join(sentence() for _ in range(rng.randint(3, 8))) for _ in range(n_docs)]


def test_split_sentences_with_punkt_trained_offline(inputs, monkeypatch):
    import nltk

    def no_download(*args, **kwargs):
        raise AssertionError("nothing may be downloaded")

    monkeypatch.setattr(nltk, "download", no_download)
    d, _, tok_dir = inputs
    probe = "The engine stopped near the bridge. It was cold, e.g. in the morning. Dr. Smith agreed!\n\nThen it left."
    docs = _prose() + [probe, "One sentence only"]
    prose = os.path.join(d, "prose.jsonl")
    with open(prose, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    cfg, result = _run(prose, tok_dir, f"{d}/sent", split_sentences=True, workers=2)
    assert result.punkt_trained is True and os.path.isfile(f"{d}/sent_punkt.json")
    prefix = result.outputs["text"]
    assert prefix.endswith("_text_sentence")
    tok = build_tokenizer("HFTokenizer", tok_dir)
    got = _documents(prefix)
    assert len(got) == len(docs)
    # the learned abbreviations do not end sentences; real sentence ends do
    assert [tok.decode(s) for s in got[-2]][:3] == ["The engine stopped near the bridge. ",
                                                   "It was cold, e.g. in the morning. ", "Dr. Smith agreed!\n\n"]
    assert len(got[-2]) == 4 and len(got[-1]) == 1
    for text, sentences in zip(docs, got):
        assert sentences[-1][-1] == tok.eod
        assert tok.decode([i for s in sentences for i in s][:-1]) == text  # pieces concatenate to the document
    _, again = _run(prose, tok_dir, f"{d}/sent", split_sentences=True)
    assert again.punkt_trained is False  # cached next to the output and reused


def _copy(prefix, to):
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as src, open(to + ext, "wb") as dst:
            dst.write(src.read())


def test_index_integrity_errors_name_the_file(inputs):
    d, corpus, tok_dir = inputs
    _, result = _run(corpus, tok_dir, f"{d}/intact")
    good = result.outputs["text"]
    _copy(good, f"{d}/trunc")
    with open(f"{d}/trunc.bin", "r+b") as f:
        f.truncate(os.path.getsize(f"{d}/trunc.bin") - 2)
    with pytest.raises(DataError, match=r"trunc\.bin is truncated"):
        verify_indexed_dataset(f"{d}/trunc")
    _copy(good, f"{d}/mismatch")  # an index from another dataset next to this .bin
    _, other = _run(corpus, tok_dir, f"{d}/other", append_eod=False)
    with open(other.outputs["text"] + ".idx", "rb") as src, open(f"{d}/mismatch.idx", "wb") as dst:
        dst.write(src.read())
    with pytest.raises(DataError, match=r"mismatch\.bin is longer than its index.*do not belong together"):
        verify_indexed_dataset(f"{d}/mismatch")
    _copy(good, f"{d}/shortidx")
    with open(f"{d}/shortidx.idx", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match=r"shortidx\.idx is truncated"):
        verify_indexed_dataset(f"{d}/shortidx")
    with open(f"{d}/shortidx.idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    with pytest.raises(DataError, match="not a Megatron index"):
        verify_indexed_dataset(f"{d}/shortidx")
    with pytest.raises(DataError, match=r"missing\.idx does not exist"):
        verify_indexed_dataset(f"{d}/missing")


def test_plan_chunks_start_at_line_starts(inputs):
    _, corpus, _ = inputs
    data = open(corpus, "rb").read()
    chunks = pp.plan_chunks(corpus, 10_000, 4)
    assert chunks[0][:1] == (0,) and chunks[-1][1] == len(data)
    for (s, e, line), (s2, _, _) in zip(chunks, chunks[1:] + [(len(data), None, None)]):
        assert e == s2 and (s == 0 or data[s - 1:s] == b"\n")
        assert line == data[:s].count(b"\n") + 1


def test_cli(inputs, capsys):
    d, corpus, tok_dir = inputs
    proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
                           f"{d}/cli", "--tokenizer-type", "HFTokenizer", "--tokenizer-model", tok_dir,
                           "--workers", "2", "--append-eod"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"--data-path {d}/cli_text_document" in proc.stdout and "docs/s" in proc.stdout
    # the final progress line gives counts only: the run's one throughput figure is the summary's
    assert "tokenised; merging" in proc.stderr and "docs/s" not in proc.stderr
    assert proc.stdout.count("docs/s") == 1
    tool = load_tool("preprocess_data")
    assert tool.main(["--input", f"{d}/nope.jsonl", "--output-prefix", f"{d}/x", "--tokenizer-model", tok_dir]) == 1
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    assert tool.main(["--input", corpus, "--output-prefix", f"{d}/x", "--tokenizer-model", f"{d}/nope"]) == 1
    assert "does not exist" in capsys.readouterr().err
