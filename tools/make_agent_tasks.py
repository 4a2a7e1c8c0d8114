"""Write a generated family of small agentic repository tasks and their oracle scripts (docs/agentic-tasks.md).

    python tools/make_agent_tasks.py --out runs/agent_tasks --seed 0 --train 500 --heldout 100
    python tools/run_eval.py --tasks runs/agent_tasks/train.jsonl --agent script:runs/agent_tasks/oracle \
        --out runs/eval/agent_tasks_oracle

writes DIR/train.jsonl and DIR/heldout.jsonl (the task format of megatron_ext/env/tasks.py), DIR/tasks/<id>/repo
and DIR/tasks/<id>/hidden, and DIR/oracle/<id>.json (one ACTIONS.json per task for run_eval's script: agent).
Held-out programs (by the shape of the composition, constants abstracted) never appear in training, whatever
the seed; the same seed writes byte-identical files. DIR/tasks and DIR/oracle are replaced.

    python tools/make_agent_tasks.py --out runs/agent_tasks --seed 0 --train 500 --heldout 100 \
        --corpus runs/agent_tasks/corpus.jsonl --corpus-tasks 20000

also writes a code-pretraining corpus ({"text": ...} lines for tools/preprocess_data.py): further training-split
tasks, each as its instruction, its files and its module before and after the fix; no held-out program appears.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.atomic import atomic_output  # noqa: E402
from megatron_ext.env.agent_tasks import (HELDOUT_FRACTION, KINDS, AgentTaskError, corpus_document,  # noqa: E402
                                          generate, generate_corpus, write_family)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for train.jsonl, heldout.jsonl, tasks/ and oracle/")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=500, help="training tasks")
    p.add_argument("--heldout", type=int, default=100, help="held-out tasks")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                   help="task kinds, taken in turn within each split")
    p.add_argument("--max-depth", type=int, default=3, help="most primitives a program composes")
    p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION,
                   help="share of composition shapes held out (by hash; the same for every seed)")
    p.add_argument("--corpus", default=None, help="also write a code-pretraining corpus here (.jsonl)")
    p.add_argument("--corpus-tasks", type=int, default=0, help="training-split tasks in --corpus")
    a = p.parse_args(argv)
    if a.train < 0 or a.heldout < 0 or a.corpus_tasks < 0:
        p.error("--train, --heldout and --corpus-tasks must be >= 0")
    if bool(a.corpus) != bool(a.corpus_tasks):
        p.error("--corpus and --corpus-tasks go together")
    if not 1 <= a.max_depth <= 4:
        p.error(f"--max-depth must lie in 1..4 (files stay short), got {a.max_depth}")
    if a.heldout and a.max_depth < 2:
        p.error("--heldout > 0 needs --max-depth >= 2: held-out programs are new compositions of primitives")
    if not 0 < a.heldout_fraction < 1:
        p.error(f"--heldout-fraction must lie strictly between 0 and 1, got {a.heldout_fraction}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out {a.out} exists and is not a directory")
    start = time.monotonic()
    try:
        family = generate(a.seed, a.train, a.heldout, tuple(a.kinds), a.max_depth, a.heldout_fraction)
    except AgentTaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        sizes = write_family(a.out, family)
    except OSError as e:
        print(f"error: --out {a.out}: cannot write ({e.strerror}: {e.filename})", file=sys.stderr)
        return 2
    if a.corpus:
        try:
            corpus = generate_corpus(a.seed, a.corpus_tasks, tuple(a.kinds), a.max_depth, a.heldout_fraction)
        except AgentTaskError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with atomic_output(a.corpus) as f:
            for task in corpus:
                f.write(json.dumps({"text": corpus_document(task)}) + "\n")
        print(f"wrote {len(corpus)} corpus documents to {a.corpus} "
              f"({len({t.program.shape for t in corpus})} program shapes)")
    elapsed = time.monotonic() - start
    for split, tasks in family.items():
        shapes = {t.program.shape for t in tasks}
        print(f"wrote {len(tasks)} {split} tasks to {os.path.join(a.out, split + '.jsonl')} "
              f"({len(shapes)} program shapes)")
    parts = [f"{role} {min(v)}..{max(v)} (median {sorted(v)[len(v) // 2]})" for role, v in sizes.items() if v]
    print(f"characters: {', '.join(parts)}; generated and written in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
