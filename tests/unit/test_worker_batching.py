"""benchmarks/worker_batching.py in miniature: static and continuous batching over the same workload draw the
same tokens, and the continuous batcher runs more, smaller engine steps instead of per-turn batches."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_worker_batching_benchmark_compares_the_two_batchers_on_the_same_tokens():
    p = subprocess.run([sys.executable, "-W", "ignore", "benchmarks/worker_batching.py", "--requests", "3",
                        "--episodes", "2", "--turns", "2", "--rounds", "1", "--length-median", "6", "--max-length",
                        "24", "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = p.stdout
    assert "3 requests x 2 turns x 2 rows: 12 rows" in out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
            if line.startswith("| static ") or line.startswith("| continuous ")}
    assert set(rows) == {"static", "continuous"}
    assert all(float(cells[0]) > 0 for cells in rows.values())
    # static: one engine call per batch of turns (at most 2 turns x 3 requests); continuous: one per decode step
    assert int(rows["static"][3]) <= 6 < int(rows["continuous"][3])
    assert "the same tokens in both modes" in out
