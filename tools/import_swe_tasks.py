"""Import SWE-bench-style instances as verified tasks graded by their FAIL_TO_PASS / PASS_TO_PASS test ids.

    python tools/import_swe_tasks.py INSTANCES.jsonl --repos DIR --out TASKS.jsonl [--wheel-dir WHEELS] [--offline]

INSTANCES: one JSON object a line (or a .json list) with instance_id, repo ("owner/name"), base_commit, patch,
test_patch, FAIL_TO_PASS, PASS_TO_PASS, problem_statement. DIR/owner__name must be a git clone holding base_commit
(only read: the commit is unpacked with git archive into a temporary folder). Each instance is verified with the
grader in the sandbox: FAIL_TO_PASS fail and PASS_TO_PASS pass on base_commit with the test patch's files laid
over, and all pass with the gold patch applied. Task folders go under OUT_STEM.d/, environments under --env-dir
(default OUT_STEM.d/envs). Skipped instances are printed with their reason and written to OUT_STEM.skipped.jsonl.
OUT is written atomically and only when some instance was imported (exit 1 otherwise, an existing OUT unchanged).
See megatron_ext/env/swe_import.py and docs/swe-tasks.md.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.atomic import atomic_output  # noqa: E402
from megatron_ext.env.environments import EnvConfig  # noqa: E402
from megatron_ext.env.mining import write_tasks  # noqa: E402
from megatron_ext.env.swe_import import ImportConfig, Importer, read_instances  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("instances", help="SWE-bench-style instances (.jsonl, or a .json list)")
    p.add_argument("--repos", required=True, help="folder of git clones named owner__name")
    p.add_argument("--out", required=True, help="the task suite to write (.jsonl)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit of one test run")
    p.add_argument("--env-dir", default=None, help="where environments are cached (default: OUT_STEM.d/envs)")
    p.add_argument("--wheel-dir", default=None, help="wheel cache: downloaded into, then installed from only")
    p.add_argument("--offline", action="store_true", help="install from --wheel-dir only, download nothing")
    p.add_argument("--no-env", action="store_true", help="no per-task environment: this interpreter's packages")
    args = p.parse_args(argv)
    if not args.out.endswith(".jsonl"):
        print("error: --out must name a .jsonl file", file=sys.stderr)
        return 2
    if args.offline and not args.wheel_dir:
        print("error: --offline needs --wheel-dir (the wheels to install from)", file=sys.stderr)
        return 2
    for flag, path in (("INSTANCES", args.instances), ("--repos", args.repos)):
        if not os.path.exists(path):
            print(f"error: {flag}: no such file or directory: {path}", file=sys.stderr)
            return 2
    try:
        instances = read_instances(args.instances)
    except (OSError, ValueError) as e:
        print(f"error: INSTANCES {args.instances}: {e}", file=sys.stderr)
        return 2
    base = os.path.dirname(os.path.abspath(args.out))
    stem = os.path.abspath(args.out)[: -len(".jsonl")]
    config = ImportConfig(timeout_s=args.timeout_s, env=None if args.no_env else EnvConfig(
        os.path.abspath(args.env_dir or os.path.join(stem + ".d", "envs")),
        wheel_dir=os.path.abspath(args.wheel_dir) if args.wheel_dir else None, offline=args.offline))
    config.sandbox.limits.wall_s = args.timeout_s
    importer = Importer(config, log=lambda m: print(m, file=sys.stderr))
    tasks, skipped = importer.import_all(instances, os.path.abspath(args.repos), stem + ".d", base)
    for what, reason in skipped:
        print(json.dumps({"skipped": what, "reason": reason}), file=sys.stderr)
    if skipped:
        with atomic_output(stem + ".skipped.jsonl") as f:
            for what, reason in skipped:
                f.write(json.dumps({"instance_id": what, "reason": reason}) + "\n")
    if not tasks:
        print(f"error: no instance could be imported ({len(skipped)} skipped, reasons above); {args.out} was not "
              "written" + (", the existing file is unchanged" if os.path.exists(args.out) else ""), file=sys.stderr)
        return 1
    write_tasks(args.out, tasks)
    print(f"{len(tasks)} tasks written to {args.out}; {len(skipped)} instances skipped"
          + (f" (reasons in {stem}.skipped.jsonl)" if skipped else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
