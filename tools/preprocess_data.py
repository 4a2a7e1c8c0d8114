r"""Tokenise a JSONL corpus into a Megatron indexed dataset (.bin/.idx) for --data-path.

    python tools/preprocess_data.py --input data/stdlib.jsonl --output-prefix data/stdlib \
        --tokenizer-type HFTokenizer --tokenizer-model data/tokenizer --workers 2 --append-eod

writes data/stdlib_text_document.bin/.idx (one per --json-keys; _sentence instead of _document with
--split-sentences, which trains nltk's Punkt on the input and caches it as PREFIX_punkt.json). Malformed lines stop
the run with their line numbers (--on-error fail) or are counted and reported (--on-error skip); a failed run
leaves no partial output, and an input without documents is an error naming the file. Documents longer than
--max-encode-chars are tokenised in pieces cut where the pre-tokeniser splits anyway (same ids; memory stays
bounded: a 50 MB one-line document no longer needs ~10 GB).
"""

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")

from megatron_ext.data.indexed import DataError  # noqa: E402
from megatron_ext.data.preprocess import MAX_ENCODE_CHARS, PreprocessConfig, preprocess, summary  # noqa: E402
from megatron_ext.data.tokenizers import TOKENIZER_TYPES, TokenizerError  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="outputs are PREFIX_{key}_{document|sentence}")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenise, one dataset each")
    parser.add_argument("--tokenizer-type", default=None, choices=[*TOKENIZER_TYPES, "HuggingFaceTokenizer"],
                        help="file format (inferred from --tokenizer-model when omitted)")
    parser.add_argument("--tokenizer-model", required=True,
                        help="tokenizer.json / tiktoken.model, or the directory holding it")
    parser.add_argument("--workers", type=int, default=1, help="tokenising processes")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's eod")
    parser.add_argument("--split-sentences", action="store_true",
                        help="one sequence per sentence (nltk Punkt trained on this input, no download)")
    parser.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                        help="malformed lines: stop with their line number, or skip and report them")
    parser.add_argument("--max-encode-chars", type=int, default=MAX_ENCODE_CHARS,
                        help="longest text given to the tokenizer at once; longer documents are encoded in pieces")
    args = parser.parse_args(argv)
    if args.max_encode_chars < 1024:
        print(f"error: --max-encode-chars must be >= 1024, got {args.max_encode_chars}", file=sys.stderr)
        return 2
    cfg = PreprocessConfig(input=args.input, output_prefix=args.output_prefix, tokenizer_model=args.tokenizer_model,
                           tokenizer_type=args.tokenizer_type, json_keys=tuple(args.json_keys), workers=args.workers,
                           append_eod=args.append_eod, split_sentences=args.split_sentences,
                           on_error=args.on_error, max_encode_chars=args.max_encode_chars)
    try:
        result = preprocess(cfg)
    except (DataError, TokenizerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    print("\n".join(summary(cfg, result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
