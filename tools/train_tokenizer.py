"""Train a byte-level BPE tokenizer (Kimi's pre-tokeniser and chat/tool special tokens) on a JSONL corpus.

    python tools/train_tokenizer.py --input data/stdlib.jsonl --vocab-size 4096 --output data/tokenizer [--tiktoken]

Writes OUTPUT/tokenizer.json and tokenizer_config.json (load with --tokenizer-type HFTokenizer --tokenizer-model
OUTPUT); with --tiktoken also OUTPUT/tiktoken.model, Kimi's file format (--tokenizer-type TikTokenizer), with the
same special ids.
"""

import argparse
import json
import os
import sys
import warnings
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")

from megatron_ext.data import bpe  # noqa: E402
from megatron_ext.data.tokenizers import CHAT_SPECIAL_TOKENS, build_tokenizer  # noqa: E402


def iter_texts(path: str, key: str, max_bytes, bad: list):
    total = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[key]
                if not isinstance(text, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError, IndexError):
                bad.append(number)
                continue
            yield text
            total += len(text)
            if max_bytes is not None and total >= max_bytes:
                return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL corpus (tools/build_corpus.py)")
    parser.add_argument("--json-key", default="text", help="field holding the text")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help=f"total ids including the {len(CHAT_SPECIAL_TOKENS)} special tokens")
    parser.add_argument("--min-frequency", type=int, default=2, help="merges must occur at least this often")
    parser.add_argument("--max-chars", type=int, default=None, help="train on at most this many characters")
    parser.add_argument("--output", required=True, help="directory to write the tokenizer to")
    parser.add_argument("--tiktoken", action="store_true", help="also write tiktoken.model (Kimi's format)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.input):
        print(f"error: --input {args.input} does not exist", file=sys.stderr)
        return 2
    stale = os.path.join(args.output, "tiktoken.model")
    if not args.tiktoken and os.path.exists(stale):
        print(f"error: {stale} is left from an earlier run and would disagree with the new tokenizer.json; add "
              "--tiktoken to rewrite it, remove it, or choose another --output", file=sys.stderr)
        return 2
    bad: list[int] = []
    t0 = time.perf_counter()
    try:
        tok = bpe.train_bpe(iter_texts(args.input, args.json_key, args.max_chars, bad), args.vocab_size,
                            args.min_frequency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bpe.save(tok, args.output, tiktoken=args.tiktoken)
    loaded = build_tokenizer("HFTokenizer", args.output)
    print(f"wrote {args.output}/tokenizer.json{' and tiktoken.model' if args.tiktoken else ''}: "
          f"{loaded.vocab_size} ids ({len(loaded.special_tokens)} special; eod {loaded.eod}, pad {loaded.pad}) "
          f"in {time.perf_counter() - t0:.1f} s")
    if loaded.vocab_size < args.vocab_size:
        print(f"note: the corpus supported only {loaded.vocab_size} of --vocab-size {args.vocab_size} ids")
    if bad:
        print(f"skipped {len(bad)} malformed lines (first: {bad[:10]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
