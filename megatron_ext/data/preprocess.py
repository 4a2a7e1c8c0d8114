"""JSONL -> Megatron indexed dataset (.bin/.idx), in parallel, all or nothing.

The input is cut at line boundaries into byte ranges; each worker process reads, parses and tokenises its ranges
itself and writes a shard with Megatron-Core's `IndexedDatasetBuilder`, and the shards are concatenated in input
order at the end. The parent only plans, shows progress and merges, so throughput scales with workers instead of
being capped by a parent that feeds them lines. Outputs appear under their final names only once complete: a
failure or Ctrl-C leaves no partial .bin/.idx behind (and an older complete pair untouched).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

from megatron_ext.data import punkt
from megatron_ext.data.indexed import DataError, verify_indexed_dataset
from megatron_ext.data.tokenizers import build_tokenizer, normalize_tokenizer_type

_PROGRESS_EVERY_DOCS = 64
_CHUNK_BYTES = 4 << 20
_REPORTED_LINES = 10
# Longest text handed to the tokenizer at once. A fast tokenizer keeps ~1 KB of bookkeeping per token (offsets,
# token strings, word ids), so a 50 MB one-line document cost ~10 GB; longer texts are encoded in pieces cut at
# pre-tokenisation boundaries (see `encode_bounded`), which gives the same ids.
MAX_ENCODE_CHARS = 1 << 20


@dataclass
class PreprocessConfig:
    input: str
    output_prefix: str
    tokenizer_model: str
    tokenizer_type: Optional[str] = None
    json_keys: Sequence[str] = ("text",)
    workers: int = 1
    append_eod: bool = False
    split_sentences: bool = False
    on_error: str = "fail"  # or "skip"
    punkt_sample_chars: int = punkt.DEFAULT_SAMPLE_CHARS
    chunk_bytes: int = _CHUNK_BYTES
    max_encode_chars: int = MAX_ENCODE_CHARS


@dataclass
class PreprocessResult:
    outputs: dict  # json key -> output prefix
    documents: int = 0
    empty_documents: int = 0
    blank_lines: int = 0
    bad_lines: int = 0
    bad_line_examples: list = field(default_factory=list)  # [(line number, reason)], the first few
    tokens: dict = field(default_factory=dict)  # json key -> tokens written
    input_bytes: int = 0
    seconds: float = 0.0
    punkt_trained: Optional[bool] = None

    @property
    def docs_per_second(self) -> float:
        return self.documents / self.seconds if self.seconds else 0.0

    @property
    def mb_per_second(self) -> float:
        return self.input_bytes / 1e6 / self.seconds if self.seconds else 0.0


def output_prefixes(output_prefix: str, json_keys: Sequence[str], split_sentences: bool) -> dict:
    """Megatron-LM's naming: PREFIX_{key}_document (or _sentence), the prefix --data-path then takes."""
    level = "sentence" if split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in json_keys}


def plan_chunks(path: str, chunk_bytes: int, min_chunks: int) -> list[tuple[int, int, int]]:
    """(start byte, end byte, number of the first line) per chunk; every chunk starts at a line start."""
    size = os.path.getsize(path)
    count = max(min_chunks, -(-size // chunk_bytes), 1)
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, count):
            target = max(k * size // count, cuts[-1])
            f.seek(target)
            f.readline()  # finish the line that contains the target
            pos = f.tell()
            if cuts[-1] < pos < size:
                cuts.append(pos)
        cuts.append(size)
        chunks, line = [], 1
        for start, end in zip(cuts, cuts[1:]):
            chunks.append((start, end, line))
            f.seek(start)
            line += f.read(end - start).count(b"\n")
    return chunks


def _cut(text: str, start: int, limit: int) -> int:
    """Where to end the piece that starts at `start`: after a newline followed by a non-space (every GPT-style
    pre-tokeniser, Kimi's included, ends a pre-token there), else before a space that follows a non-space and
    starts a word, else (half a `limit` without either, e.g. base64) at `limit` itself."""
    end = start + limit
    if end >= len(text):
        return len(text)
    low = start + limit // 2
    pos = end
    while (pos := text.rfind("\n", low, pos)) >= 0:
        if not text[pos + 1].isspace():
            return pos + 1
    pos = end
    while (pos := text.rfind(" ", low + 1, pos)) >= 0:
        if not text[pos - 1].isspace() and text[pos + 1].isalnum():
            return pos
    return end


def encode_bounded(tok, text: str, limit: int = MAX_ENCODE_CHARS):
    """tok.encode(text), with the tokenizer never given more than `limit` characters at once (bounded memory).
    A text longer than `limit` gives an int32 array (4 bytes a token instead of a Python int's ~36)."""
    if len(text) <= limit:
        return tok.encode(text)
    parts, start = [], 0
    while start < len(text):
        end = _cut(text, start, limit)
        parts.append(np.asarray(tok.encode(text[start:end]), dtype=np.int32))
        start = end
    return np.concatenate(parts)


# ---- worker side ------------------------------------------------------------------------------------------
_W: dict = {}


def _init_worker(cfg: PreprocessConfig, punkt_params: Optional[dict], counters):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and tears the pool down
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    _W.update(cfg=cfg, tokenizer=tokenizer, counters=counters, dtype=DType.optimal_dtype(tokenizer.vocab_size),
              splitter=punkt.splitter(punkt.params_from_json(punkt_params)) if punkt_params else None)


def _bump(docs: int, nbytes: int):
    docs_counter, bytes_counter = _W["counters"]
    with docs_counter.get_lock():
        docs_counter.value += docs
    with bytes_counter.get_lock():
        bytes_counter.value += nbytes


def _parse(line: bytes, keys: Sequence[str]):
    """The document's texts by key, or the reason the line is unusable."""
    try:
        doc = json.loads(line)
    except UnicodeDecodeError:
        return None, "not valid UTF-8"
    except ValueError as e:
        return None, f"invalid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})"
    if not isinstance(doc, dict):
        return None, f"expected a JSON object, got {type(doc).__name__}"
    texts = []
    for key in keys:
        if key not in doc:
            return None, f"no {key!r} field (--json-keys {' '.join(keys)})"
        if not isinstance(doc[key], str):
            return None, f"field {key!r} is {type(doc[key]).__name__}, not a string"
        texts.append(doc[key])
    return texts, None


def _process_chunk(task) -> dict:
    index, start, end, first_line, shard_dir = task
    cfg: PreprocessConfig = _W["cfg"]
    tok, splitter, dtype = _W["tokenizer"], _W["splitter"], _W["dtype"]
    shards = {key: os.path.join(shard_dir, f"{index:06d}_{key}") for key in cfg.json_keys}
    builders = {key: IndexedDatasetBuilder(get_bin_path(p), dtype=dtype) for key, p in shards.items()}
    out = {"index": index, "shards": shards, "documents": 0, "empty": 0, "blank": 0, "bad": 0, "examples": [],
           "tokens": {key: 0 for key in cfg.json_keys}}
    with open(cfg.input, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    lines = data.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the chunk ends with a newline
    pending_docs = pending_bytes = 0
    for offset, line in enumerate(lines):
        pending_bytes += len(line) + 1
        if not line.strip():
            out["blank"] += 1
            continue
        texts, problem = _parse(line, cfg.json_keys)
        if problem is not None:
            out["bad"] += 1
            if len(out["examples"]) < _REPORTED_LINES:
                out["examples"].append((first_line + offset, problem))
            if cfg.on_error == "fail":
                break
            continue
        encoded = []
        for text in texts:
            pieces = punkt.split_sentences(splitter, text) if splitter is not None else [text]
            seqs = [ids for ids in (encode_bounded(tok, p, cfg.max_encode_chars) for p in pieces) if len(ids)]
            if cfg.append_eod:
                if seqs:
                    seqs[-1] = np.append(seqs[-1], tok.eod) if isinstance(seqs[-1], np.ndarray) else \
                        seqs[-1] + [tok.eod]
                elif text:
                    seqs = [[tok.eod]]
            encoded.append(seqs)
        if not all(encoded):  # an empty text under any key: skip the document so keys stay aligned
            out["empty"] += 1
            continue
        for key, seqs in zip(cfg.json_keys, encoded):
            if any(isinstance(seq, np.ndarray) for seq in seqs):
                flat = np.concatenate([np.asarray(seq, dtype=np.int64) for seq in seqs])
            else:
                flat = [i for seq in seqs for i in seq]
            builders[key].add_document(flat, [len(seq) for seq in seqs])
            out["tokens"][key] += len(flat)
        out["documents"] += 1
        pending_docs += 1
        if pending_docs >= _PROGRESS_EVERY_DOCS:
            _bump(pending_docs, pending_bytes)
            pending_docs = pending_bytes = 0
    _bump(pending_docs, pending_bytes)
    for key, builder in builders.items():
        builder.finalize(get_idx_path(shards[key]))
    return out


# ---- parent side ------------------------------------------------------------------------------------------
class Progress:
    """One status line: documents, share of the input read, docs/s and MB/s (a line per 10 s when not a tty)."""

    def __init__(self, total_bytes: int, stream=None, label: str = "preprocess"):
        self.total, self.stream, self.label = total_bytes, stream or sys.stderr, label
        self.t0 = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_print = self.t0

    def line(self, docs: int, nbytes: int) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        share = 100.0 * nbytes / self.total if self.total else 100.0
        return (f"{self.label}: {docs:,} docs, {nbytes / 1e6:.1f} MB ({share:5.1f}%) | {docs / dt:,.1f} docs/s | "
                f"{nbytes / 1e6 / dt:.2f} MB/s | {dt:.1f} s")

    def update(self, docs: int, nbytes: int):
        now = time.perf_counter()
        if self.tty and now - self.last_print >= 0.2:
            self.stream.write("\r" + self.line(docs, nbytes))
            self.stream.flush()
            self.last_print = now
        elif not self.tty and now - self.last_print >= 10.0:
            self.stream.write(self.line(docs, nbytes) + "\n")
            self.stream.flush()
            self.last_print = now

    def finish(self, docs: int, nbytes: int):
        """The last progress line, without rates: the run's one throughput figure is summary()'s, which counts
        the whole run (sentence-splitter training and the merge included)."""
        share = 100.0 * nbytes / self.total if self.total else 100.0
        self.stream.write(("\r" if self.tty else "") + f"{self.label}: {docs:,} docs, {nbytes / 1e6:.1f} MB "
                          f"({share:5.1f}%) tokenised; merging shards\n")
        self.stream.flush()


def _punkt_params(cfg: PreprocessConfig) -> tuple[dict, bool]:
    def texts():
        with open(cfg.input, "rb") as f:
            for line in f:
                parsed, problem = _parse(line, cfg.json_keys[:1]) if line.strip() else (None, "blank")
                if problem is None:
                    yield parsed[0]

    sample = punkt.sample_text(texts(), cfg.punkt_sample_chars)
    params, trained = punkt.load_or_train(f"{cfg.output_prefix}_punkt.json", sample)
    return punkt.params_to_json(params), trained


def _describe_bad_lines(cfg: PreprocessConfig, result: PreprocessResult) -> str:
    shown = "; ".join(f"line {n}: {why}" for n, why in result.bad_line_examples)
    more = result.bad_lines - len(result.bad_line_examples)
    return f"{cfg.input}: {shown}" + (f"; and {more} more" if more > 0 else "")


def preprocess(cfg: PreprocessConfig, log=print, progress_stream=None) -> PreprocessResult:
    if cfg.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.on_error not in ("fail", "skip"):
        raise ValueError(f"--on-error must be 'fail' or 'skip', got {cfg.on_error!r}")
    if not os.path.isfile(cfg.input):
        raise DataError(f"input {cfg.input} does not exist")
    cfg.tokenizer_type = normalize_tokenizer_type(cfg.tokenizer_type, cfg.tokenizer_model)
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)  # fail here, not in every worker
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    result = PreprocessResult(outputs=output_prefixes(cfg.output_prefix, cfg.json_keys, cfg.split_sentences))
    out_dir = os.path.dirname(os.path.abspath(cfg.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    punkt_params = None
    if cfg.split_sentences:
        punkt_params, result.punkt_trained = _punkt_params(cfg)
    shard_dir = tempfile.mkdtemp(prefix=os.path.basename(cfg.output_prefix) + ".shards.", dir=out_dir)
    finals = [p for prefix in result.outputs.values() for p in (get_bin_path(prefix), get_idx_path(prefix))]
    temps = [p + ".tmp" for p in finals]
    renamed = []
    try:
        chunks = plan_chunks(cfg.input, cfg.chunk_bytes, 4 * cfg.workers)
        result.input_bytes = chunks[-1][1] if chunks else 0
        tasks = [(i, s, e, line, shard_dir) for i, (s, e, line) in enumerate(chunks)]
        ctx = mp.get_context("fork")
        counters = (ctx.Value("q", 0), ctx.Value("q", 0))
        progress = Progress(result.input_bytes, progress_stream)
        outs = []
        with ctx.Pool(cfg.workers, initializer=_init_worker, initargs=(cfg, punkt_params, counters)) as pool:
            results = pool.imap(_process_chunk, tasks)
            while len(outs) < len(tasks):
                try:
                    out = results.next(timeout=0.25)
                except mp.TimeoutError:
                    progress.update(counters[0].value, counters[1].value)
                    continue
                outs.append(out)
                _accumulate(result, out)
                if out["bad"] and cfg.on_error == "fail":
                    # imap yields in input order, so this is the first malformed line of the file
                    raise DataError(f"{_describe_bad_lines(cfg, result)}; fix the input or pass --on-error skip")
        progress.finish(counters[0].value, result.input_bytes)
        if result.documents == 0:
            raise DataError(f"{cfg.input}: no documents to write ({_contents(result)}); check the file and "
                            f"--json-keys {' '.join(cfg.json_keys)}")
        for key, prefix in result.outputs.items():
            builder = IndexedDatasetBuilder(get_bin_path(prefix) + ".tmp", dtype=dtype)
            for out in outs:
                builder.add_index(out["shards"][key])
            builder.finalize(get_idx_path(prefix) + ".tmp")
        for tmp, final in zip(temps, finals):
            os.replace(tmp, final)
            renamed.append(final)
        for prefix in result.outputs.values():
            verify_indexed_dataset(prefix)
    except BaseException:
        for path in temps + renamed:
            if os.path.exists(path):
                os.remove(path)
        raise
    finally:
        shutil.rmtree(shard_dir, ignore_errors=True)
    result.seconds = time.perf_counter() - t0
    return result


def _contents(result: PreprocessResult) -> str:
    if not result.input_bytes:
        return "the file is empty"
    parts = [f"{n} {what}" for n, what in ((result.blank_lines, "blank lines"),
                                             (result.empty_documents, "documents with empty text"),
                                             (result.bad_lines, "malformed lines skipped")) if n]
    return ", ".join(parts) or "nothing usable"


def _accumulate(result: PreprocessResult, out: dict):
    result.documents += out["documents"]
    result.empty_documents += out["empty"]
    result.blank_lines += out["blank"]
    result.bad_lines += out["bad"]
    room = _REPORTED_LINES - len(result.bad_line_examples)
    result.bad_line_examples += out["examples"][:max(room, 0)]
    for key, n in out["tokens"].items():
        result.tokens[key] = result.tokens.get(key, 0) + n


def summary(cfg: PreprocessConfig, result: PreprocessResult) -> list[str]:
    lines = []
    for key, prefix in result.outputs.items():
        lines.append(f"wrote {prefix}.bin/.idx: {result.documents:,} documents, {result.tokens.get(key, 0):,} "
                     f"tokens  (--data-path {prefix})")
    lines.append(f"{result.documents:,} documents in {result.seconds:.2f} s with {cfg.workers} worker(s): "
                 f"{result.docs_per_second:,.1f} docs/s, {result.mb_per_second:.2f} MB/s")
    if result.empty_documents or result.blank_lines:
        lines.append(f"skipped {result.empty_documents} empty documents and {result.blank_lines} blank lines")
    if result.bad_lines:
        lines.append(f"skipped {result.bad_lines} malformed lines: {_describe_bad_lines(cfg, result)}")
    if result.punkt_trained is not None:
        lines.append(f"sentence splitter: Punkt {'trained on the input' if result.punkt_trained else 'from cache'} "
                     f"({cfg.output_prefix}_punkt.json)")
    return lines
