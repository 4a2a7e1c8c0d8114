r"""Built-in task suites mined from real code: pinned PyPI sdists with tests, fetched once and mined offline.

    python -m megatron_ext.eval.suites materialize pypi-small     # prints the suite's tasks.jsonl
    python -m megatron_ext.eval.suites stats pypi-small           # Markdown table (docs/eval-suites.md)
    python tools/run_eval.py --tasks builtin:pypi-small --agent ... # the harness materializes it the same way

Each package is pinned by version and sha256. `materialize(name)` fetches each sdist (from $MEGATRON_EXT_SDIST_DIR
when it holds the file, else `pip download --no-deps --no-binary :all:` with a --require-hashes requirements
file), checks its sha256, and mines it with feature deletion (megatron_ext/env/mining.py: every task verified:
its test command fails on the agent's starting code and passes on the reference). Results are cached under
$MEGATRON_EXT_CACHE/suites (default ~/.cache/megatron_ext/suites) or `cache_dir`, keyed by the pins, the mining
settings and the mining code itself, so later calls are offline and instant; a lock file serialises concurrent
builders. The same inputs give the same tasks (mining is deterministic). With $MEGATRON_EXT_OFFLINE=1, or when
pip cannot reach an index, an sdist that is neither cached nor in $MEGATRON_EXT_SDIST_DIR is an error that names
the file and both ways to provide it.

The packages were chosen because their sdists ship pytest suites that pass offline with only pytest, run in
seconds, and yield several verified tasks each (checked 2026-12-01; rejected: parse 1.22.4 (pytest-cov in
addopts), iso8601 2.1.0 (needs hypothesis), jmespath 1.1.0 and idna 3.20 (no test passes as shipped)).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

CURSORBENCH = {"median_changed_lines": 181, "median_instruction_chars": 390}  # REFERENCE.md


class SuiteError(RuntimeError):
    """A suite that cannot be built; the message names the package or file and the fix."""


@dataclass(frozen=True)
class Sdist:
    name: str
    version: str
    sha256: str
    filename: str          # as PyPI names it
    max_tasks: int = 8     # tasks mined from it (the first ones in the miner's deterministic order)


@dataclass(frozen=True)
class Suite:
    description: str
    packages: tuple[tuple[Sdist, int], ...]   # (sdist, tasks taken: its first N mined tasks)


INFLECTION = Sdist("inflection", "0.5.1", "1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
                   "inflection-0.5.1.tar.gz")
CACHETOOLS = Sdist("cachetools", "8.0.2", "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0",
                   "cachetools-8.0.2.tar.gz")
TOOLZ = Sdist("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
              "toolz-1.2.0.tar.gz")
SIX = Sdist("six", "1.17.0", "ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81",
            "six-1.17.0.tar.gz")

SUITES: dict[str, Suite] = {
    "pypi-small": Suite("feature deletion in four small pure-Python libraries (string inflection, caches, "
                        "functional utilities, py2/3 compatibility)",
                        ((INFLECTION, 8), (CACHETOOLS, 8), (TOOLZ, 8), (SIX, 8))),
    "pypi-demo": Suite("the first three inflection tasks: quick to build, for make demo", ((INFLECTION, 3),)),
}


def cache_root(cache_dir: Optional[str] = None) -> str:
    if cache_dir:
        return os.path.abspath(cache_dir)
    base = os.environ.get("MEGATRON_EXT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_ext")
    return os.path.join(base, "suites")


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def _locked(root: str):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(sdist: Sdist, root: str, sdist_dir: Optional[str] = None, log=print) -> str:
    """The verified sdist's path in the cache: already there, copied from sdist_dir / $MEGATRON_EXT_SDIST_DIR,
    or downloaded by pip with --require-hashes."""
    target = os.path.join(root, "sdists", sdist.filename)
    if os.path.isfile(target) and sha256_file(target) == sdist.sha256:
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    local_dir = sdist_dir or os.environ.get("MEGATRON_EXT_SDIST_DIR")
    with tempfile.TemporaryDirectory(prefix="sdist-", dir=os.path.dirname(target)) as tmp:
        got = os.path.join(tmp, sdist.filename)
        if local_dir and os.path.isfile(os.path.join(local_dir, sdist.filename)):
            shutil.copyfile(os.path.join(local_dir, sdist.filename), got)
        elif os.environ.get("MEGATRON_EXT_OFFLINE") == "1":
            raise SuiteError(_missing(sdist, local_dir, "MEGATRON_EXT_OFFLINE=1 forbids downloading"))
        else:
            log(f"downloading {sdist.filename} (pip, sha256 pinned)")
            _pip_download(sdist, tmp, local_dir)
        digest = sha256_file(got)
        if digest != sdist.sha256:
            raise SuiteError(f"{sdist.filename}: sha256 {digest} does not match the pinned {sdist.sha256}; "
                             "the file is not the pinned release: remove it and fetch it again")
        os.replace(got, target)
    return target


def _pip_download(sdist: Sdist, dest: str, local_dir: Optional[str]):
    requirements = os.path.join(dest, "requirements.txt")
    with open(requirements, "w") as f:
        f.write(f"{sdist.name}=={sdist.version} --hash=sha256:{sdist.sha256}\n")
    run = subprocess.run(check=False, args=[sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                          "--require-hashes", "-r", requirements, "-d", dest, "--retries", "1", "--timeout", "30",
                          "--quiet"], capture_output=True, text=True)
    os.remove(requirements)
    if run.returncode != 0 or not os.path.isfile(os.path.join(dest, sdist.filename)):
        raise SuiteError(_missing(sdist, local_dir, "pip download failed (offline?): "
                                  + (run.stderr.strip().splitlines() or ["no output"])[-1][:300]))


def _missing(sdist: Sdist, local_dir: Optional[str], why: str) -> str:
    return (f"{sdist.filename} ({sdist.name}=={sdist.version}) is not cached and {why}. Provide it: put the file "
            f"(sha256 {sdist.sha256}) in a folder named by $MEGATRON_EXT_SDIST_DIR"
            f"{f' (now {local_dir})' if local_dir else ''}, or run once with network access: pip download "
            f"--no-deps --no-binary :all: {sdist.name}=={sdist.version}")


def _mining_key(sdist: Sdist) -> str:
    """Pins, mining settings and the mining code: any change re-mines."""
    from megatron_ext.env import mining

    text = json.dumps({"sdist": asdict(sdist), "mining": sha256_file(mining.__file__)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mine_package(sdist: Sdist, root: str, sdist_dir: Optional[str] = None, log=print) -> str:
    """The cached tasks.jsonl of one package (mined on first use)."""
    from megatron_ext.atomic import atomic_output
    from megatron_ext.env.mining import MineConfig, Miner, write_tasks

    folder = os.path.join(root, "mined", f"{sdist.name}-{sdist.version}-{_mining_key(sdist)}")
    tasks_path = os.path.join(folder, "tasks.jsonl")
    if os.path.isfile(tasks_path):
        return tasks_path
    path = fetch(sdist, root, sdist_dir, log)
    log(f"mining {sdist.filename} (up to {sdist.max_tasks} tasks; each verified in a sandbox, about a minute)")
    shutil.rmtree(folder, ignore_errors=True)  # a build that died half-way
    os.makedirs(folder)
    miner = Miner(MineConfig(max_tasks=sdist.max_tasks), log=log)
    tasks, skipped = miner.mine(path, os.path.join(folder, "tasks.d"), name=f"{sdist.name}-{sdist.version}",
                                task_base=folder)
    if not tasks:
        raise SuiteError(f"{sdist.filename}: no task could be mined ({skipped[:3]}); the package does not fit "
                         "this machine's Python or its tests need more than pytest")
    with atomic_output(os.path.join(folder, "skipped.json")) as f:
        json.dump([list(s) for s in skipped], f, indent=0)
    write_tasks(tasks_path + ".tmp", tasks)
    os.replace(tasks_path + ".tmp", tasks_path)  # last: its presence means the package is complete
    return tasks_path


def materialize(name: str, cache_dir: Optional[str] = None, sdist_dir: Optional[str] = None,
                suites: Optional[dict[str, Suite]] = None, log=print) -> str:
    """Path of the built-in suite `name`'s tasks.jsonl, built once (fetch, verify, mine) and cached."""
    from megatron_ext.atomic import atomic_output

    suites = SUITES if suites is None else suites
    if name not in suites:
        raise SuiteError(f"no built-in suite {name!r}; built-in suites: {sorted(suites)}")
    suite, root = suites[name], cache_root(cache_dir)
    with _locked(root):
        lines = []
        for sdist, take in suite.packages:
            mined = mine_package(sdist, root, sdist_dir, log)
            rel = os.path.relpath(os.path.dirname(mined), os.path.join(root, "built"))
            for line in Path(mined).read_text().splitlines()[:take]:
                task = json.loads(line)
                task["repo"] = os.path.join(rel, task["repo"])
                task["hidden_tests"] = os.path.join(rel, task["hidden_tests"])
                lines.append(json.dumps(task, sort_keys=True))
        out = os.path.join(root, "built", f"{name}.jsonl")
        text = "".join(line + "\n" for line in lines)
        if not (os.path.isfile(out) and Path(out).read_text() == text):
            with atomic_output(out) as f:
                f.write(text)
    return out


def statistics_of(path: str) -> dict:
    """Per package and overall: task count, median changed lines of the reference solutions, median instruction
    characters (the two figures REFERENCE.md gives for CursorBench)."""
    tasks = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    groups: dict[str, list[dict]] = {}
    for t in tasks:
        groups.setdefault(t["metadata"].get("source", "?"), []).append(t)

    def figures(ts):
        return {"tasks": len(ts),
                "median_changed_lines": statistics.median(t["metadata"]["reference_diff_lines"] for t in ts),
                "median_instruction_chars": statistics.median(len(t["instruction"]) for t in ts)}

    return {"packages": {k: figures(v) for k, v in sorted(groups.items())}, "overall": figures(tasks),
            "cursorbench": CURSORBENCH}


def markdown(name: str, stats: dict) -> str:
    rows = [f"| {k} | {v['tasks']} | {v['median_changed_lines']:g} | {v['median_instruction_chars']:g} |"
            for k, v in stats["packages"].items()]
    o, c = stats["overall"], stats["cursorbench"]
    return "\n".join([f"| `{name}` package | tasks | median changed lines | median instruction chars |",
                      "|---|---:|---:|---:|", *rows,
                      f"| **all** | {o['tasks']} | {o['median_changed_lines']:g} | {o['median_instruction_chars']:g} |",
                      f"| CursorBench (report) | - | {c['median_changed_lines']} | {c['median_instruction_chars']} |"])


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("materialize", "stats", "list"))
    p.add_argument("name", nargs="?", help="suite name (see `list`)")
    p.add_argument("--cache-dir", default=None, help="default $MEGATRON_EXT_CACHE/suites or ~/.cache/megatron_ext/suites")
    p.add_argument("--sdist-dir", default=None, help="a folder holding the pinned sdists (default "
                                                     "$MEGATRON_EXT_SDIST_DIR); otherwise pip downloads them")
    args = p.parse_args(argv)
    if args.command == "list":
        for name, suite in SUITES.items():
            print(f"{name}: {suite.description}; " + ", ".join(f"{s.name}=={s.version} ({n} tasks)"
                                                                for s, n in suite.packages))
        return 0
    if not args.name:
        p.error(f"{args.command} needs a suite name: {sorted(SUITES)}")
    try:
        path = materialize(args.name, args.cache_dir, args.sdist_dir, log=lambda m: print(m, file=sys.stderr))
    except SuiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path if args.command == "materialize" else markdown(args.name, statistics_of(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
