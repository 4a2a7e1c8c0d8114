"""Preprocessing throughput: documents per second with --workers 2 over --workers 1 (goal >= 1.8 on 2 cores).

Builds the standard-library corpus and a 4096-id tokenizer (or takes --corpus/--tokenizer), then runs
megatron_ext.data.preprocess (what tools/preprocess_data.py runs) alternately with 1 and 2 workers, so drifts
in machine speed hit both. docs/s is end to end: chunk planning, worker start, tokenisation, shard writing and
the final merge. Every run's output must be byte-identical.

On a shared machine other processes steal the second core at random; each run therefore measures the CPU time
the whole machine spent besides this benchmark (/proc/stat minus our own and our workers' rusage) and is repeated
when that exceeds --max-foreign of the machine's capacity.

    python benchmarks/preprocess_throughput.py [--rounds 3] [--max-files N] [--corpus FILE --tokenizer DIR]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import resource
import statistics
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")

from megatron_ext.data import bpe  # noqa: E402
from megatron_ext.data.corpus import build_corpus, stdlib_dir  # noqa: E402
from megatron_ext.data.preprocess import PreprocessConfig, preprocess  # noqa: E402


def _texts(path):
    import json

    with open(path, encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def _machine_busy_seconds() -> float:
    """CPU seconds all processes have used since boot (every core), or 0.0 where /proc/stat is missing."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def run(corpus: str, tokenizer: str, workers: int, out_dir: str):
    """(result, digest of the output, share of the machine's CPU capacity used by other processes)."""
    cfg = PreprocessConfig(input=corpus, output_prefix=os.path.join(out_dir, f"w{workers}"),
                           tokenizer_model=tokenizer, tokenizer_type="HFTokenizer", workers=workers, append_eod=True)
    busy0, own0 = _machine_busy_seconds(), _own_seconds()
    result = preprocess(cfg, progress_stream=io.StringIO())
    foreign = (_machine_busy_seconds() - busy0) - (_own_seconds() - own0)
    with open(result.outputs["text"] + ".bin", "rb") as f:
        digest = hash(f.read())
    return result, digest, max(foreign, 0.0) / (result.seconds * os.cpu_count())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating (1 worker, 2 workers) pairs")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files")
    p.add_argument("--corpus", default=None, help="JSONL corpus (default: build the stdlib corpus)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: train 4096 ids on the corpus)")
    p.add_argument("--max-foreign", type=float, default=0.05,
                   help="repeat a run when other processes used more than this share of the machine's CPUs")
    p.add_argument("--max-attempts", type=int, default=10, help="give up on a clean run after this many tries")
    opts = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = opts.corpus
        if corpus is None:
            corpus = os.path.join(tmp, "stdlib.jsonl")
            stats = build_corpus([stdlib_dir()], corpus, max_files=opts.max_files)
            print(f"corpus: {stdlib_dir()}: {stats.lines()[0]}")
        tokenizer = opts.tokenizer
        if tokenizer is None:
            tokenizer = os.path.join(tmp, "tokenizer")
            bpe.save(bpe.train_bpe(_texts(corpus), 4096), tokenizer)
        rates = {1: [], 2: []}
        digests = set()
        for r in range(opts.rounds):
            for workers in (1, 2):
                for attempt in range(opts.max_attempts):
                    result, digest, foreign = run(corpus, tokenizer, workers, tmp)
                    digests.add(digest)
                    note = f"other processes used {foreign:.1%} of the CPUs"
                    if foreign <= opts.max_foreign:
                        break
                    print(f"round {r + 1}: --workers {workers}: discarded, {note}", flush=True)
                else:
                    raise SystemExit(f"no clean run in {opts.max_attempts} attempts; the machine is too busy")
                rates[workers].append(result.docs_per_second)
                print(f"round {r + 1}: --workers {workers}: {result.documents} docs in {result.seconds:.2f} s = "
                      f"{result.docs_per_second:.1f} docs/s, {result.mb_per_second:.2f} MB/s ({note})", flush=True)
        assert len(digests) == 1, "outputs differ between runs"
        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
        print(f"median docs/s: --workers 1: {one:.1f}, --workers 2: {two:.1f}, ratio {two / one:.3f} (goal >= 1.8)")


if __name__ == "__main__":
    main()
