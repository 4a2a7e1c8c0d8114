"""Write digit-task prompt files for RL (JSONL, one task with a unique id per line).

    python tools/make_rl_prompts.py --out data/rl --train 2000 --heldout 200 --seed 0
writes data/rl/train.jsonl and data/rl/heldout.jsonl (held-out inputs never occur in the training pool).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.rl.env import DEFAULT_OPS, OPS, digit_tasks, split_size, write_prompts  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    p.add_argument("--train", type=int, default=2000, help="training prompts")
    p.add_argument("--heldout", type=int, default=200, help="held-out prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", nargs="+", default=DEFAULT_OPS, choices=list(OPS))
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-len", type=int, default=6)
    a = p.parse_args(argv)
    if not 1 <= a.min_len <= a.max_len:
        p.error("--min-len must be >= 1 and <= --max-len")
    for split, count in (("train", a.train), ("heldout", a.heldout)):
        space = split_size(split, a.ops, a.min_len, a.max_len)
        if count > space:
            p.error(f"--{split} {count} asks for more prompts than the {space} distinct (op, input) pairs of the "
                    f"{split} split (--ops {' '.join(a.ops)}, --min-len {a.min_len}, --max-len {a.max_len}): raise "
                    f"--max-len, add --ops or lower --{split}")
    os.makedirs(a.out, exist_ok=True)
    for split, count in (("train", a.train), ("heldout", a.heldout)):
        path = os.path.join(a.out, f"{split}.jsonl")
        tasks = digit_tasks(split, count, a.seed, a.ops, a.min_len, a.max_len)
        write_prompts(path, tasks)
        distinct = len({(t["op"], t["input"]) for t in tasks})
        print(f"wrote {count} {split} prompts to {path} ({distinct} distinct (op, input) pairs"
              + (f"; {count - distinct} repeat an earlier one" if distinct < count else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
