"""Coding conversations for the SFT stage from a code corpus: "implement this function" -> its source.

    python tools/build_sft_data.py --input data/stdlib.jsonl --output data/sft.jsonl [--max-chars 1500]

Every top-level Python function of the corpus (tools/build_corpus.py JSONL) with a docstring becomes one
conversation: the user asks for the function by module, signature and the docstring's first paragraph; the
assistant answers with the function's source in a fenced block. Deterministic: corpus order, one line each.
"""

import argparse
import ast
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.atomic import Discard, atomic_output  # noqa: E402


def conversations(text: str, path: str, max_chars: int):
    """(user, assistant) pairs for the documented top-level functions of one Python source file."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    lines = text.splitlines()
    parts = os.path.splitext(path)[0].split(os.sep)
    if parts and parts[0].startswith("python3"):  # the standard library's own directory name
        parts = parts[1:]
    module = ".".join(parts)
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        source = "\n".join(lines[node.lineno - 1 - len(node.decorator_list):node.end_lineno])
        if len(source) > max_chars:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        signature = f"{node.name}({ast.unparse(node.args)})"
        user = f"In `{module}`, implement `{signature}`: {summary}"
        yield user, f"```python\n{source}\n```"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="corpus JSONL (text, path) from tools/build_corpus.py")
    parser.add_argument("--output", required=True, help="chat JSONL to write (one {'messages': [...]} per line)")
    parser.add_argument("--max-chars", type=int, default=1500, help="skip functions with longer source")
    args = parser.parse_args(argv)
    if not os.path.exists(args.input):
        print(f"error: --input {args.input} does not exist", file=sys.stderr)
        return 2
    count, problem = 0, None
    with open(args.input, encoding="utf-8") as f, atomic_output(args.output) as out:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                problem = f"{args.input}:{number}: not JSON ({e})"
                raise Discard
            if not record.get("path", "").endswith(".py"):
                continue
            for user, assistant in conversations(record["text"], record["path"], args.max_chars):
                out.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                   {"role": "assistant", "content": assistant}]}) + "\n")
                count += 1
        if count == 0:
            problem = (f"{args.input} gave no conversations (no documented top-level Python functions of at most "
                       f"--max-chars {args.max_chars} characters)")
            raise Discard
    if problem:
        print(f"error: {problem}; {args.output} was not written", file=sys.stderr)
        return 1
    print(f"{count} conversations -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
