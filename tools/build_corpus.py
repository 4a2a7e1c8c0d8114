"""Walk source trees into a JSONL code corpus (text, path, language, license hint) for preprocess_data.py.

    python tools/build_corpus.py --output data/stdlib.jsonl                 # the running Python's standard library
    python tools/build_corpus.py --input DIR [DIR ...] --output FILE.jsonl [--extensions .py .c] [--max-bytes N]

Files are visited in sorted path order, exact duplicates (same bytes) are kept once, files outside
[--min-bytes, --max-bytes] or not UTF-8 text are skipped, so the same tree always gives the same corpus.
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")

from megatron_ext.data.corpus import DEFAULT_EXCLUDE, LANGUAGES, build_corpus, stdlib_dir  # noqa: E402


def _nothing_written(stats, args) -> str:
    """Which filter left nothing: the names (--input, --extensions, --exclude) or the sizes and contents."""
    if stats.files_seen == 0:
        return "no files matched; check --input, --extensions and --exclude"
    reasons = [f"{n} {why}" for n, why in ((stats.too_small, f"below --min-bytes {args.min_bytes}"),
                                           (stats.too_large, f"above --max-bytes {args.max_bytes}"),
                                           (stats.not_text, "not UTF-8 text"),
                                           (stats.duplicates, "exact duplicates")) if n]
    return (f"{stats.files_seen} files matched --input and --extensions but none was kept: " + ", ".join(reasons)
            + ("; lower --min-bytes" if stats.too_small else "") + ("; raise --max-bytes" if stats.too_large else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", default=None,
                        help="source trees or files (default: this Python's standard library, without "
                             "site-packages)")
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--extensions", nargs="+", default=sorted(LANGUAGES),
                        help="file name endings to keep (default: common code and doc formats)")
    parser.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE),
                        help="glob patterns of directory or file names (or relative paths) to skip")
    parser.add_argument("--min-bytes", type=int, default=64, help="skip smaller files")
    parser.add_argument("--max-bytes", type=int, default=1 << 20, help="skip larger files (generated code, data)")
    parser.add_argument("--max-files", type=int, default=None, help="stop after this many files (small corpora)")
    args = parser.parse_args(argv)
    roots = args.input or [stdlib_dir()]
    for root in roots:
        if not os.path.exists(root):
            print(f"error: --input {root} does not exist", file=sys.stderr)
            return 2
    if args.min_bytes < 0 or args.max_bytes < args.min_bytes:
        print(f"error: need 0 <= --min-bytes <= --max-bytes, got {args.min_bytes} and {args.max_bytes}",
              file=sys.stderr)
        return 2
    extensions = [e if e.startswith(".") else "." + e for e in args.extensions]
    stats = build_corpus(roots, args.output, extensions, args.exclude, args.min_bytes, args.max_bytes,
                         args.max_files)
    if stats.written == 0:
        print(f"error: {_nothing_written(stats, args)} ({args.output} was not written"
              + (", the existing file is unchanged)" if os.path.exists(args.output) else ")"), file=sys.stderr)
        print("  " + "\n  ".join(stats.lines()), file=sys.stderr)
        return 1
    print(f"{args.output}: " + "\n  ".join(stats.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
