"""The grader's pytest runner and result reporter, run inside the grading sandbox (see grading.py).

Standalone on purpose (stdlib and pytest only): the host copies this file into a folder outside the workspace,
bound read-only, and starts it with ``python -I`` so neither the working directory nor PYTHONPATH can put a module
of the agent's ahead of pytest. The workspace goes on sys.path only after pytest and its plugins are imported,
the way ``python -m pytest`` would have put it first. Results go to a report folder made fresh on the host for
this one run: the agent never saw it, and every report carries a nonce the runner reads (and deletes) before any
of the agent's code is imported.

    python -I runner.py REPORT_DIR MODE(run|collect|baseline) WORKSPACE PATH_ENTRIES(':'-separated) -- PYTEST ARGS

collect lists the tests (leaving out those their own skip marks skip), baseline runs them and lists them the same
way (the untouched repository's outcomes: which expected tests fail before any change), run runs them.
"""

import json
import os
import sys


class Recorder:
    """Per-test outcomes from pytest's own reports (never from printed text)."""

    def __init__(self, collect: bool):
        self.collect = collect
        self.outcomes = {}
        self.collected = []
        self.errors = []

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(report.nodeid)

    def pytest_collection_finish(self, session):
        for item in session.items:
            if self.collect and _skipped_by_marks(item):
                continue
            self.collected.append(item.nodeid)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            if report.outcome == "skipped" and hasattr(report, "wasxfail"):
                outcome = "xfailed"
            elif report.when == "call" and report.outcome == "passed" and hasattr(report, "wasxfail"):
                outcome = "xpassed"
            else:
                outcome = report.outcome
            previous = self.outcomes.get(report.nodeid)
            if previous in (None, "passed", "xfailed"):  # a failed teardown turns a passed test into a failure
                self.outcomes[report.nodeid] = outcome


def _skipped_by_marks(item) -> bool:
    """The test's own skip/skipif marks skip it here (on the untouched repository: not an expected test)."""
    try:
        from _pytest.skipping import evaluate_skip_marks
        return evaluate_skip_marks(item) is not None
    except Exception:
        return False


def main() -> int:
    split = sys.argv.index("--")
    report_dir, mode, workspace, entries = sys.argv[1:split]
    args = sys.argv[split + 1:]
    nonce_path = os.path.join(report_dir, "nonce")
    with open(nonce_path) as f:
        nonce = f.read().strip()
    os.unlink(nonce_path)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    os.environ.pop("PYTEST_ADDOPTS", None)
    os.environ.pop("PYTEST_PLUGINS", None)
    import pytest  # noqa: E402  (before the workspace is on sys.path)
    paths = [workspace] + [os.path.join(workspace, p) for p in entries.split(":") if p]
    for path in reversed(paths):
        sys.path.insert(0, path)
    if paths[1:]:  # for subprocesses the tests start, as the task command gave it
        os.environ["PYTHONPATH"] = ":".join(paths[1:])
    if mode not in ("run", "collect", "baseline"):
        raise SystemExit(f"unknown mode {mode!r}")
    recorder = Recorder(collect=mode != "run")
    code = pytest.main(args + (["--collect-only"] if mode == "collect" else []), plugins=[recorder])
    report = {"nonce": nonce, "exit_code": int(code), "outcomes": recorder.outcomes,
              "collected": recorder.collected, "collection_errors": recorder.errors}
    with open(os.path.join(report_dir, "report.json"), "w") as f:
        json.dump(report, f)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
