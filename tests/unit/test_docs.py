"""The documentation is tested like code (issue 31): every shell block in README.md and docs/*.md is run or marked,
every `--flag` written after one of our entry points exists in that tool's --help, relative links resolve, each
guide is two clicks from the README, and the README quotes no figure that docs/benchmarks.md does not hold.

How a block author marks a shell block (fence info `bash`, `sh`, `shell` or `console`), one word after the language:

    ```bash run       run in the default suite (keep it to seconds)
    ```bash slow      run under `make test-all` only
    ```bash cluster   never run (GPUs, SLURM, network, a real checkpoint, placeholders such as CKPT)

A file's `run` blocks run in file order, each under `bash -e -o pipefail`, in one fresh directory that links the
repository's tools/, examples/, benchmarks/, megatron_ext/, docs/ and entry scripts (the slow test runs the file's
`run` and `slow` blocks together, in order), so blocks are written as a user types them in the repository root.
Output belongs in a plain ``` or ```text block. Flags are checked in every shell block, cluster ones included.
"""

import functools
import glob
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHELL_LANGS = {"bash", "sh", "shell", "console"}
MARKERS = ("run", "slow", "cluster")
# tiny settings for run/slow blocks: text -> text, applied in this order (keep it small and explicit)
SUBSTITUTIONS = {
    # docs/rl.md: fewer prompts and steps (the walk-through's figures come from benchmarks/rl_learning.py)
    "--train 3200 --heldout 200": "--train 128 --heldout 16",
    "--seed 1 --train 1920 --heldout 1": "--seed 1 --train 96 --heldout 1",
    "--train-iters 100 --lr 5e-3": "--train-iters 4 --lr 5e-3",
    "--train-iters 120 --lr 1e-3": "--train-iters 4 --lr 1e-3",
    "--save-interval 10 --rl-prompts": "--save-interval 2 --rl-prompts",
    "--rl-eval-interval 10 --rl-eval-samples 8": "--rl-eval-interval 2 --rl-eval-samples 2",
    "--train-iters 40 --lr 1e-3": "--train-iters 2 --lr 1e-3",
}
# what the temporary directory a file's blocks run in links from the repository
LINKED = ("tools", "examples", "benchmarks", "megatron_ext", "docs", "pretrain_composer.py", "rl_composer.py")
TOOL = re.compile(r"(?:^|/)((?:tools|benchmarks)/[\w-]+\.py|pretrain_composer\.py|rl_composer\.py)$")
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


def doc_files(root=ROOT) -> list[str]:
    """README.md and every docs/*.md, globbed so that guides added later are covered too."""
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


@dataclass
class Block:
    path: str
    line: int            # 1-based line of the opening fence
    lang: str
    words: list          # the info string's words after the language
    text: str

    @property
    def where(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"

    @property
    def shell(self) -> bool:
        return self.lang in SHELL_LANGS

    @property
    def marker(self):
        found = [w for w in self.words if w in MARKERS]
        return found[0] if len(found) == 1 else None


def blocks(path: str, text: str | None = None) -> list[Block]:
    """Fenced code blocks of a Markdown file, with the line of each opening fence."""
    lines = (open(path, encoding="utf-8").read() if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(2), m.group(3).strip()
        body, j = [], i + 1
        while j < len(lines):
            c = FENCE.match(lines[j])
            if c and c.group(2)[0] == fence[0] and len(c.group(2)) >= len(fence) and not c.group(3).strip():
                break
            body.append(lines[j])
            j += 1
        words = info.split()
        out.append(Block(path, i + 1, words[0].lower() if words else "", words[1:], "\n".join(body) + "\n"))
        i = j + 1
    return out


def marking_problems(bs: list[Block]) -> list[str]:
    problems = []
    for b in bs:
        if b.shell and b.marker is None:
            found = [w for w in b.words if w in MARKERS]
            what = "more than one doc-test marker" if found else "no doc-test marker"
            problems.append(f"{b.where}: shell block has {what}: write ```{b.lang} run, ```{b.lang} slow or "
                            f"```{b.lang} cluster on its fence line (tests/unit/test_docs.py)")
    return problems


def words(text: str):
    """(line, word) for each shell word, (line, None) for each command separator: a shell's quoting, backslash
    continuations and comments, enough to tell which flags follow which program (`tasks.jsonl#id` is no comment)."""
    word, word_line, quote, line, i, out = [], 1, None, 1, 0, []

    def flush():
        if word:
            yield word_line, "".join(word)
        word.clear()

    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"' and i + 1 < len(text):
                word.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = None
            else:
                word.append(c)
            line += c == "\n"
        elif c in "'\"":
            if not word:
                word_line = line
            quote = c
            word.append("")
        elif c == "\\" and i + 1 < len(text):
            if text[i + 1] == "\n":
                out.extend(flush())
                line += 1
            else:
                word.append(text[i + 1])
            i += 1
        elif c == "#" and not word:
            while i + 1 < len(text) and text[i + 1] != "\n":
                i += 1
        elif c in " \t\r":
            out.extend(flush())
        elif c in "\n;&|()<>":
            out.extend(flush())
            out.append((line, None))
            line += c == "\n"
        else:
            if not word:
                word_line = line
            word.append(c)
        i += 1
    out.extend(flush())
    return out


def commands(block: Block) -> list[tuple[int, str, list[str]]]:
    """(line, tool, arguments) for every command in a shell block whose program is one of our entry points."""
    out, current = [], None
    for line, word in words(block.text):
        if word is None:
            current = None
            continue
        m = TOOL.search(word)
        if current is None and m:
            current = (block.line + line, m.group(1), [])
            out.append(current)
        elif current is not None:
            current[2].append(word)
    return out


SUBCOMMAND = re.compile(r"^[a-z][\w-]*$")


@functools.lru_cache(maxsize=None)
def _help_texts(keys: tuple) -> dict:
    """The --help of each "tool" or "tool subcommand", all in one child process (the imports are paid once; ~4 s
    for every tool we have)."""
    script = textwrap.dedent("""
        import contextlib, io, json, runpy, sys, warnings
        warnings.simplefilter("ignore")
        out = {}
        for key in sys.argv[1:]:
            buf = io.StringIO()
            sys.argv = key.split() + ["--help"]
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
                    runpy.run_path(sys.argv[0], run_name="__main__")
            except SystemExit:
                pass
            except BaseException as e:
                buf.write(f"\\n(--help failed: {e!r})")
            out[key] = buf.getvalue()
        sys.stdout.write("\\n@@HELP@@" + json.dumps(out))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script, *keys], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "@@HELP@@" in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("@@HELP@@", 1)[1])


def _help_keys(tool: str, args: list) -> list[str]:
    return [tool] + ([f"{tool} {args[0]}"] if args and SUBCOMMAND.match(args[0]) else [])


@functools.lru_cache(maxsize=None)
def _all_help_keys() -> tuple:
    found = set()
    for path in doc_files():
        for b in blocks(path):
            if b.shell:
                for _, tool, args in commands(b):
                    if os.path.isfile(os.path.join(ROOT, tool)):
                        found.update(_help_keys(tool, args))
    return tuple(sorted(found))


def help_of(key: str) -> str:
    texts = _help_texts(_all_help_keys())
    return texts[key] if key in texts else _help_texts((key,))[key]


def flag_problems(bs: list[Block], help_of=help_of) -> list[str]:
    """A documented flag must be in the --help of the tool it follows (of its subcommand, for `tool sub --x`)."""
    problems = []
    for b in bs:
        if not b.shell:
            continue
        for line, tool, args in commands(b):
            where = f"{os.path.relpath(b.path, ROOT)}:{line}"
            if not os.path.isfile(os.path.join(ROOT, tool)):
                problems.append(f"{where}: {tool} does not exist")
                continue
            name, text = tool, help_of(tool)
            if args and SUBCOMMAND.match(args[0]):  # `tool import --x`, `run_eval.py nll --x`: the subcommand's help
                sub = help_of(f"{tool} {args[0]}")
                if sub.strip() and sub != text and "(--help failed" not in sub:
                    name, text = f"{tool} {args[0]}", sub
            for flag in (a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2):
                if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                    problems.append(f"{where}: `{flag}` is not an option of {name} (not in its --help)")
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    h = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks."""
    out, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or (m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence)
                                    and not m.group(3).strip())):
            fence = m.group(2) if fence is None else None
            continue
        if fence is None:
            out.append((n, line))
    return out


@functools.lru_cache(maxsize=None)
def anchors(path: str) -> frozenset:
    seen, out = {}, set()
    for _, line in _prose(open(path, encoding="utf-8").read()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def links(path: str) -> list[tuple[int, str]]:
    out = []
    for n, line in _prose(open(path, encoding="utf-8").read()):
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            out.append((n, m.group(1) or m.group(2)))
    return out


def link_problems(path: str) -> list[str]:
    problems = []
    for n, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        where = f"{os.path.relpath(path, ROOT)}:{n}"
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            problems.append(f"{where}: link to {target}: {os.path.relpath(dest, ROOT)} does not exist")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            problems.append(f"{where}: link to {target}: no heading with anchor #{anchor} in "
                            f"{os.path.relpath(dest, ROOT)}")
    return problems


# ---------------------------------------------------------------------------------------------------- the checks


def test_every_shell_block_is_marked():
    problems = [p for path in doc_files() for p in marking_problems(blocks(path))]
    assert not problems, "\n".join(problems)


def test_documented_flags_exist_in_the_tools_help():
    problems = [p for path in doc_files() for p in flag_problems(blocks(path))]
    assert not problems, "\n".join(problems)


def test_links_resolve():
    problems = [p for path in doc_files() for p in link_problems(path)]
    assert not problems, "\n".join(problems)


def test_every_guide_is_two_clicks_from_the_readme():
    readme = os.path.join(ROOT, "README.md")

    def linked(path):
        out = set()
        for _, target in links(path):
            file = target.partition("#")[0]
            if file and not re.match(r"^[a-z][a-z0-9+.-]*:", file):
                out.add(os.path.normpath(os.path.join(os.path.dirname(path), file)))
        return {p for p in out if p.endswith(".md") and os.path.isfile(p)}

    first = linked(readme)
    reached = first | {q for p in first for q in linked(p)}
    missing = [os.path.relpath(p, ROOT) for p in doc_files()[1:] if p not in reached]
    assert not missing, f"not reachable in two clicks from README.md: {missing}"


def test_readme_stays_a_front_page():
    """Issue 31: the README is the front door (<= ~150 lines); detail belongs in a guide."""
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into a guide under docs/"
    assert "## RL that learns to use tools" in lines


def test_readme_quotes_only_figures_that_docs_benchmarks_holds():
    """Figures live in docs/benchmarks.md with their command; the README may repeat one, never introduce one."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    bench = open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8").read()
    figures = set()
    for _, line in _prose(readme):
        line = re.sub(r"`[^`]*`|\([^)]*\.(?:md|png|py)[^)]*\)", "", line)
        figures.update(re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])x?", line))
    missing = sorted(f for f in figures if f.rstrip("x") not in bench)
    assert not missing, f"README.md quotes figures docs/benchmarks.md does not hold: {missing}"


# ------------------------------------------------------------------------------- the checks check what they say

SAMPLE = """# Guide

```bash cluster
python tools/run_eval.py --tasks SUITE --agent script:DIR \\
    --no-such-flag 3 --out RUN   # a comment --not-a-flag
torchrun --nproc-per-node 8 rl_composer.py --rl-rollout-workers 2 && python tools/gone.py --x
```

```bash
echo unmarked
```

```bash run slow
echo two markers
```

```text
python tools/run_eval.py --never-checked
```
"""


def test_the_checks_catch_a_missing_marker_and_a_removed_flag(tmp_path):
    path = tmp_path / "guide.md"
    bs = blocks(str(path), SAMPLE)
    assert [(b.line, b.lang, b.marker) for b in bs] == [(3, "bash", "cluster"), (9, "bash", None),
                                                        (13, "bash", None), (17, "text", None)]
    problems = marking_problems(bs)
    assert len(problems) == 2 and ":9: shell block has no doc-test marker" in problems[0]
    assert ":13: shell block has more than one doc-test marker" in problems[1]
    assert commands(bs[0]) == [(4, "tools/run_eval.py", ["--tasks", "SUITE", "--agent", "script:DIR",
                                                         "--no-such-flag", "3", "--out", "RUN"]),
                               (6, "rl_composer.py", ["--rl-rollout-workers", "2"]),
                               (6, "tools/gone.py", ["--x"])]
    fake_help = {"tools/run_eval.py": "  --tasks T  --agent A  --out DIR  --no-such-flag-x",
                 "rl_composer.py": "--rl-rollout-workers N"}
    problems = flag_problems(bs, help_of=fake_help.__getitem__)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "`--no-such-flag` is not an option of tools/run_eval.py (not in its --help)",
        "tools/gone.py does not exist"]
    assert problems[0].endswith(tuple(problems[0].split(":", 2)[2:])) and ":4: " in problems[0]


def test_the_link_check_catches_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Run `rl_composer.py` on Ray (issue 16)\n\n"
                                   "[ok](b.md#second-part) [ok](#run-rl_composerpy-on-ray-issue-16) "
                                   "[bad](b.md#nope) [bad](c.md) [web](https://x.org/#y) `[code](c.md)`\n")
    (tmp_path / "b.md").write_text("# B\n\n## Second part\n")
    problems = link_problems(str(tmp_path / "a.md"))
    assert len(problems) == 2, problems
    assert "no heading with anchor #nope in" in problems[0] and "c.md does not exist" in problems[1]


def test_the_help_cache_holds_every_documented_tool_and_subcommand():
    keys = _all_help_keys()
    assert {"pretrain_composer.py", "tools/run_eval.py", "tools/convert_checkpoint.py import"} <= set(keys)
    assert "--tensor-model-parallel-size" in help_of("pretrain_composer.py")
    assert "--tensor-model-parallel-size" in help_of("tools/convert_checkpoint.py import")


# ------------------------------------------------------------------------------------------- running the blocks


def _files_with(kind: str) -> list[str]:
    return [p for p in doc_files() if any(b.shell and b.marker == kind for b in blocks(p))]


def _run_blocks(path: str, kinds: tuple, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), work / name)
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, line in (("python", f'exec "{sys.executable}" "$@"'),
                       ("python3", f'exec "{sys.executable}" "$@"'),
                       ("torchrun", f'exec "{sys.executable}" -m torch.distributed.run "$@"')):
        (shims / name).write_text(f"#!/bin/sh\n{line}\n")
        (shims / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ran = 0
    for b in blocks(path):
        if not (b.shell and b.marker in kinds):
            continue
        script = b.text
        for old, new in SUBSTITUTIONS.items():
            script = script.replace(old, new)
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=work, env=env,
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, (f"{b.where}: the {b.marker} block exited {proc.returncode}\n"
                                      f"{script}\n--- output ---\n{(proc.stdout + proc.stderr)[-4000:]}")
        ran += 1
    assert ran


@pytest.mark.parametrize("path", _files_with("run"), ids=lambda p: os.path.relpath(p, ROOT))
def test_run_blocks(path, tmp_path):
    _run_blocks(path, ("run",), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", _files_with("slow"), ids=lambda p: os.path.relpath(p, ROOT))
def test_slow_blocks(path, tmp_path):
    _run_blocks(path, ("run", "slow"), tmp_path)
