"""Small real inputs for the data tests: a handful of standard-library modules and a tokenizer trained on them."""

import importlib.util
import io
import json
import os

from megatron_ext.data import bpe
from megatron_ext.data.corpus import build_corpus, stdlib_dir
from megatron_ext.data.preprocess import PreprocessConfig, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "csv.py", "heapq.py", "bisect.py", "string.py",
           "keyword.py", "colorsys.py", "fnmatch.py", "glob.py", "shlex.py")


def stdlib_files(names=MODULES):
    return [os.path.join(stdlib_dir(), n) for n in names]


def small_corpus(directory, names=MODULES) -> str:
    path = os.path.join(directory, "corpus.jsonl")
    if not os.path.exists(path):
        build_corpus(stdlib_files(names), path, min_bytes=1)
    return path


def read_texts(path, key="text"):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)[key] for line in f if line.strip()]


def trained_tokenizer(directory, corpus, vocab_size=1024, tiktoken=True) -> str:
    out = os.path.join(directory, "tokenizer")
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        bpe.save(bpe.train_bpe(read_texts(corpus), vocab_size), out, tiktoken=tiktoken)
    return out


def preprocessed(directory, corpus, tokenizer, name="corpus", **overrides) -> str:
    prefix = os.path.join(directory, name)
    cfg = PreprocessConfig(input=corpus, output_prefix=prefix, tokenizer_model=tokenizer,
                           tokenizer_type="HFTokenizer", append_eod=True, **overrides)
    result = preprocess(cfg, progress_stream=io.StringIO())
    return result.outputs["text"]


def load_tool(name: str, folder: str = "tools"):
    """A tools/ (or benchmarks/) script as a module, to call its main() or helpers in-process (no interpreter
    start-up per check)."""
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", os.path.join(ROOT, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
