"""Learning check for RL: a tiny model, briefly warmed up by SFT on digit tasks, then GRPO; held-out success.

    python benchmarks/rl_learning.py --out runs/rl_learning            # about 5 minutes on 2 CPU cores
    # the first configuration (copy/reverse of 2-4 digits: memorised, held-out flat; docs/benchmarks.md):
    python benchmarks/rl_learning.py --out runs/rl_copy --ops copy reverse --min-len 2 --max-len 4 \
        --sft-iters 800 --rl-iters 80 --rl-lr 2e-3 --heldout 100

Default tasks: name the max, min, first or last digit of a 5-8 digit string (one-digit answers, 10^5-10^8 inputs
per op: nothing to memorise), after a deliberately short warm-up (100 steps) that leaves the policy uncertain.

Steps: write prompt files (tools/make_rl_prompts.py; the SFT and RL prompts are disjoint, the held-out split never
occurs in either); supervised warm-up (`rl_composer.py --rl-sft-warmup`, one rank); RL from that checkpoint
(`torchrun --nproc-per-node 2 rl_composer.py --load SFT --finetune`), evaluating held-out success (mean over K
samples per prompt) and pass@K every few steps with 95% Wilson intervals; greedy held-out accuracy of the
warm-up and of the RL result (the level that sharpening alone reaches; above it, RL improved the rule itself).
Writes the curve to docs/rl_learning.png (unless --plot '') and prints a markdown summary for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.lifetime import run_tied  # noqa: E402
from megatron_ext.rl.env import OPS, SEQUENCE_OPS, digit_tasks, write_prompts  # noqa: E402

MODEL = ["--model", "tiny", "--vocab-size", "32", "--seq-length", "64", "--micro-batch-size", "8"]


def run(cmd, log_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        code = run_tied(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({code}); see {log_path}")


def sft_start(ckpt: str, iters: int):
    """None when `ckpt` holds the finished SFT warm-up (its latest save is iteration `iters`); else the flags that
    start it: its own save when a signal or kill left one part way (the re-run would otherwise take a half-trained
    SFT as done, or be refused for overwriting it), or none for a fresh start."""
    from megatron_ext.training.checkpointing import CheckpointError, read_tracker

    try:
        tag = read_tracker(ckpt)  # a kill between a save's rename and its tracker: the complete iter_N/ counts
    except CheckpointError:
        tag = None
    if tag == iters:
        return None
    return ["--load", ckpt] if isinstance(tag, int) else []


def evals(log_dir):
    return [json.loads(line) for line in open(os.path.join(log_dir, "eval.jsonl"))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/rl_learning")
    p.add_argument("--sft-iters", type=int, default=100)
    p.add_argument("--sft-lr", type=float, default=5e-3)
    p.add_argument("--min-len", type=int, default=5)
    p.add_argument("--max-len", type=int, default=8)
    p.add_argument("--ops", nargs="+", default=["max", "min", "first", "last"], choices=list(OPS),
                   help="digit operations of the task family")
    p.add_argument("--rl-iters", type=int, default=120)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--heldout", type=int, default=200)
    p.add_argument("--rl-lr", type=float, default=1e-3)
    p.add_argument("--model-flags", default="", help="extra architecture flags, e.g. '--hidden-size 128'")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "rl_learning.png"))
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    answer_len = a.max_len if set(a.ops) & set(SEQUENCE_OPS) else 1
    model = MODEL + a.model_flags.split() + ["--grpo-max-response-length", str(answer_len + 2)]  # answer, <eos>, spare
    # prompts: digit tasks of 2-4 digits; SFT and RL take disjoint slices of the training stream
    n_sft, n_rl = a.sft_iters * 32, a.rl_iters * a.prompts_per_step
    train = digit_tasks("train", n_sft + n_rl, seed=1, ops=a.ops, min_len=a.min_len, max_len=a.max_len)
    files = {name: os.path.join(a.out, f"{name}.jsonl") for name in ("sft", "rl", "heldout")}
    write_prompts(files["sft"], train[:n_sft])
    write_prompts(files["rl"], train[n_sft:])
    write_prompts(files["heldout"], digit_tasks("heldout", a.heldout, seed=1, ops=a.ops, min_len=a.min_len,
                                                max_len=a.max_len))
    sft_ckpt, sft_logs = os.path.join(a.out, "sft"), os.path.join(a.out, "sft_logs")
    rl_ckpt, rl_logs = os.path.join(a.out, "rl"), os.path.join(a.out, "rl_logs")
    evaluation = ["--rl-eval-prompts", files["heldout"], "--rl-eval-samples", str(a.eval_samples)]
    start = sft_start(sft_ckpt, a.sft_iters)
    if start is not None:
        run([sys.executable, "-W", "ignore", "rl_composer.py", *model, *start, "--rl-prompts", files["sft"],
             "--rl-sft-warmup",
             "--grpo-prompts-per-step", "32", "--train-iters", str(a.sft_iters), "--lr", str(a.sft_lr),
             "--lr-decay-style", "constant", "--grpo-kl-beta", "0", "--save", sft_ckpt, "--rl-log-dir", sft_logs,
             *evaluation, "--rl-eval-interval", str(a.sft_iters), "--log-interval", "50"],
            os.path.join(a.out, "sft.log"))
    # greedy held-out accuracy: RL at temperature 1 can raise the sampled mean towards it by sharpening alone;
    # a rise of the greedy accuracy itself is learning beyond sharpening
    def greedy(ckpt, name):
        logs = os.path.join(a.out, name)
        if not os.path.exists(os.path.join(logs, "eval.jsonl")):
            run([sys.executable, "-W", "ignore", "rl_composer.py", *model, "--load", ckpt, "--finetune",
                 "--rl-prompts", files["rl"], "--rl-log-dir", logs, "--train-iters", "0", "--lr", str(a.rl_lr),
                 "--rl-eval-prompts", files["heldout"], "--rl-eval-samples", "1", "--rl-eval-temperature", "0",
                 "--rl-eval-interval", "1"], os.path.join(a.out, name + ".log"))
        return evals(logs)[0]

    greedy_before = greedy(sft_ckpt, "sft_greedy_logs")
    run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "rl_composer.py", *model, "--load", sft_ckpt, "--finetune", "--save", rl_ckpt, "--rl-prompts", files["rl"],
         "--rl-log-dir", rl_logs, "--train-iters", str(a.rl_iters), "--lr", str(a.rl_lr), "--lr-decay-style",
         "constant", "--grpo-group-size", str(a.group_size), "--grpo-prompts-per-step", str(a.prompts_per_step),
         "--rl-reward-weights", "exact=1,char_accuracy=0.5", *evaluation, "--rl-eval-interval", str(a.eval_interval),
         "--log-interval", "1"], os.path.join(a.out, "rl.log"))
    curve = evals(rl_logs)
    greedy_after = greedy(rl_ckpt, "rl_greedy_logs")
    print(f"| RL step | held-out success (95% CI) | pass@{a.eval_samples} (95% CI) |")
    print("|---|---|---|")
    for e in curve:
        s, sc, k, kc = e["heldout success"], e["heldout success ci"], e["heldout pass@k"], e["heldout pass@k ci"]
        print(f"| {e['iteration']} | {s:.3f} [{sc[0]:.3f}, {sc[1]:.3f}] | {k:.3f} [{kc[0]:.3f}, {kc[1]:.3f}] |")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [e["iteration"] for e in curve]
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("heldout success", "mean success"), ("heldout pass@k", f"pass@{a.eval_samples}")):
            values = [e[key] for e in curve]
            lo = [e[key + " ci"][0] for e in curve]
            hi = [e[key + " ci"][1] for e in curve]
            ax.plot(steps, values, marker="o", label=label)
            ax.fill_between(steps, lo, hi, alpha=0.2)
        for g, x, marker in ((greedy_before, steps[0], "s"), (greedy_after, steps[-1], "D")):
            gc = g["heldout success ci"]
            y = g["heldout success"]
            ax.errorbar([x], [y], yerr=[[y - gc[0]], [gc[1] - y]],
                        fmt=marker, color="black", capsize=3, label="greedy" if x == steps[0] else None)
        ax.set_xlabel(f"RL step ({a.prompts_per_step} prompts x {a.group_size} samples)")
        ax.set_ylabel(f"held-out success ({a.heldout} prompts)")
        ax.set_title(f"GRPO on digit tasks ({' '.join(a.ops)}, {a.min_len}-{a.max_len} digits) after a brief SFT\n"
                     f"tiny K2.5, 2 CPU ranks; held-out: mean and pass@{a.eval_samples} at T=1, greedy", fontsize=9)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"plot: {a.plot}")
    first, last = curve[0], curve[-1]
    for name, g in (("warm-up", greedy_before), ("after RL", greedy_after)):
        gc = g["heldout success ci"]
        print(f"{name} greedy held-out success {g['heldout success']:.3f} [{gc[0]:.3f}, {gc[1]:.3f}]")
    print(f"held-out success {first['heldout success']:.3f} -> {last['heldout success']:.3f}, "
          f"pass@{a.eval_samples} {first['heldout pass@k']:.3f} -> {last['heldout pass@k']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
