"""Mine repository tasks from git checkouts, directories or sdists with tests: feature deletion, and (--commits N)
reverting recent commits that changed code and tests.

    python tools/mine_tasks.py REPO_OR_SDIST... --out tasks/suite.jsonl [--max-tasks 10] [--commits 50]
    pip download --no-binary :all: --no-deps PKG==VERSION -d sdists && python tools/mine_tasks.py sdists/*.tar.gz \
        --out tasks/pkg.jsonl

Each accepted task was verified: its test command fails on the agent's starting code and passes on the reference. Task
folders (the agent's repository and the hidden tests) go to OUT's folder under OUT_STEM.d/; what was skipped is
printed with its reason. --seed shuffles the candidates (the same seed, the same tasks) and --max-per-file caps the
tasks one file gives, so a small --max-tasks still spreads over the package. Each source's test requirements (runtime
dependencies, test/dev extras, requirements files, tox deps, pytest plugins its addopts needs) go into a cached
virtual environment under --env-dir (default OUT_STEM.d/envs), which the tasks record and the sandbox runs them
with; --wheel-dir keeps the wheels for an --offline rebuild; --no-env uses this interpreter's packages. OUT is
written atomically and only when some task was mined: a run that finds none exits 1 and leaves an existing OUT as it
was. See megatron_ext/env/mining.py and docs/swe-tasks.md.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.env.environments import EnvConfig  # noqa: E402
from megatron_ext.env.mining import MineConfig, Miner, write_tasks  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="directories (git checkouts included) or sdist .tar.gz files")
    p.add_argument("--out", required=True, help="the task suite to write (.jsonl)")
    p.add_argument("--max-tasks", type=int, default=10, help="tasks per source")
    p.add_argument("--max-candidates", type=int, default=20, help="functions tried per source")
    p.add_argument("--max-per-file", type=int, default=None, help="tasks from one file, per source (default: no cap)")
    p.add_argument("--seed", type=int, default=None,
                   help="shuffle the candidates with this seed (default: file path, then line order)")
    p.add_argument("--min-body-lines", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit of one test-suite run")
    p.add_argument("--commits", type=int, default=0,
                   help="also mine 'revert a commit' tasks from the last N commits of each git checkout")
    p.add_argument("--env-dir", default=None, help="where per-source environments are cached "
                   "(default: OUT_STEM.d/envs)")
    p.add_argument("--wheel-dir", default=None, help="wheel cache: downloaded into, then installed from only")
    p.add_argument("--offline", action="store_true", help="install from --wheel-dir only, download nothing")
    p.add_argument("--no-env", action="store_true", help="no per-source environment: this interpreter's packages")
    args = p.parse_args(argv)
    if args.offline and not args.wheel_dir:
        print("error: --offline needs --wheel-dir (the wheels to install from)", file=sys.stderr)
        return 2
    if not args.out.endswith(".jsonl"):
        print("error: --out must name a .jsonl file", file=sys.stderr)
        return 2
    for flag, value in (("--max-tasks", args.max_tasks), ("--max-candidates", args.max_candidates),
                        ("--max-per-file", args.max_per_file)):
        if value is not None and value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    missing = [s for s in args.sources if not os.path.exists(s)]
    if missing:
        print(f"error: no such source(s): {missing}", file=sys.stderr)
        return 2
    base = os.path.dirname(os.path.abspath(args.out))
    assets = os.path.abspath(args.out)[: -len(".jsonl")] + ".d"
    os.makedirs(assets, exist_ok=True)
    config = MineConfig(min_body_lines=args.min_body_lines, max_candidates=args.max_candidates,
                        max_tasks=args.max_tasks, max_per_file=args.max_per_file, seed=args.seed,
                        timeout_s=args.timeout_s,
                        env=None if args.no_env else EnvConfig(
                            os.path.abspath(args.env_dir or os.path.join(assets, "envs")),
                            wheel_dir=os.path.abspath(args.wheel_dir) if args.wheel_dir else None,
                            offline=args.offline))
    config.sandbox.limits.wall_s = args.timeout_s
    miner = Miner(config, log=lambda m: print(m, file=sys.stderr))
    tasks, skipped = [], []
    for source in args.sources:
        found, why = miner.mine(source, assets, task_base=base)
        tasks += found
        skipped += why
        if args.commits and os.path.isdir(os.path.join(source, ".git")):
            found, why = miner.mine_commits(source, assets, args.commits, task_base=base)
            tasks += found
            skipped += why
    for what, reason in skipped:
        print(json.dumps({"skipped": what, "reason": reason}), file=sys.stderr)
    if not tasks:
        print(f"error: no task could be mined ({len(skipped)} skipped, reasons above); {args.out} was not written"
              + (", the existing file is unchanged" if os.path.exists(args.out) else ""), file=sys.stderr)
        return 1
    write_tasks(args.out, tasks)
    print(f"{len(tasks)} tasks written to {args.out}; {len(skipped)} candidates skipped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
