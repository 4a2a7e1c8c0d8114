"""Same-budget architecture comparison on the standard-library corpus: the tiny K2.5 baseline, Attention Residuals
(full and block) and the Kimi Linear KDA hybrid, trained on the same tokens for the same steps.

    python benchmarks/arch_compare.py [--out runs/arch_compare] [--iters 200] [--seeds 1 2] \
        [--arms baseline attnres-full attnres-block kda-hybrid] [--reuse]

Every arm runs pretrain_composer.py on one rank with examples/tiny/pretrain.args (256-token sequences, 16 per step,
lr 1e-2 cosine, --split 98,1,1) on `make demo`'s data (runs/demo/data: the standard-library corpus and its
4096-id tokenizer; built if missing), with the same seed, so every arm sees the same batches in the same order.
Parameter budgets: AttnRes adds one hidden-size query per sublayer and one for the final norm (9 x 64 here); the
KDA arm is `--model tiny-kimi-linear` (KDA KDA KDA MLA, position-free MLA) with 3 KDA heads of 12 so that its
total parameter count is within 0.1 % of the baseline's (the preset's 4 x 16 is 3.5 % larger). The arm is skipped,
with a note, while that preset does not exist.

Measured per arm: the held-out loss (64 windows of 256 tokens from the documents that --split keeps out of
training: the validation and test splits), the validation-split loss logged during training (every
--eval-interval steps, the curves plotted) and the mean training loss over the last 10 % of steps. With several
--seeds: per-seed values, mean and standard deviation, and each arm's mean paired difference to the baseline (same
seed, same batches) with its standard error. Seeds can be run one invocation at a time into the same --out and
summarised together with --reuse --seeds ... . Writes docs/arch_compare.png and prints a JSON
summary (the figures docs/benchmarks.md records).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.stages_loss import DATA, ensure_data, held_out_windows  # noqa: E402

ARMS = {
    "baseline": ["--model", "tiny"],
    "attnres-full": ["--model", "tiny", "--attention-residuals", "full"],
    # 8 sublayers in 4 blocks of 2: one transformer layer per block
    "attnres-block": ["--model", "tiny", "--attention-residuals", "block", "--attn-res-block-size", "2"],
    "kda-hybrid": ["--model", "tiny-kimi-linear", "--kda-num-heads", "3", "--kda-head-dim", "12"],
}
NEEDS_PRESET = {"kda-hybrid": "tiny-kimi-linear"}
COLOURS = {"baseline": "tab:gray", "attnres-full": "tab:blue", "attnres-block": "tab:green",
           "kda-hybrid": "tab:red"}


def available(arm: str) -> bool:
    from megatron_ext.models.presets import PRESETS

    return NEEDS_PRESET.get(arm, "tiny") in PRESETS


def data_flags() -> list[str]:
    return ["--data-path", os.path.join(DATA, "stdlib_text_document"), "--tokenizer-type", "HFTokenizer",
            "--tokenizer-model", os.path.join(DATA, "tokenizer")]


def parameters(arm: str) -> int:
    from megatron_ext.arguments import parse_args
    from megatron_ext.models.presets import parameter_counts

    args = parse_args(["@examples/tiny/pretrain.args", *data_flags(), *ARMS[arm], "--dry-run"], world_size=1)
    return parameter_counts(args.arch.replace(vocab_size=args.padded_vocab_size))[0]


def train(arm: str, seed: int, out: str, iters: int, eval_interval: int) -> float:
    """Train one arm; returns seconds per iteration (wall clock, under whatever load the machine has)."""
    ckpt, tb = os.path.join(out, "ckpt"), os.path.join(out, "tb")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "pretrain_composer.py", "@examples/tiny/pretrain.args", *data_flags(), *ARMS[arm],
           "--seed", str(seed), "--train-iters", str(iters), "--eval-interval", str(eval_interval),
           "--eval-iters", "4", "--log-interval", "10", "--save", ckpt, "--load", ckpt, "--save-interval",
           str(iters), "--tensorboard-dir", tb]
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return (time.perf_counter() - start) / iters


def measure(arm: str, out: str, windows) -> dict:
    from megatron_ext.training.lm import window_loss
    from megatron_ext.training.tensorboard import scalars

    s = scalars(os.path.join(out, "tb"))
    train_curve = sorted(s["lm loss"].items())
    valid_curve = sorted(s.get("lm loss validation", {}).items())
    tail = train_curve[-max(1, len(train_curve) // 10):]
    ckpt = os.path.join(out, "ckpt")
    held_out = window_loss(["--model", ARMS[arm][1], "--mock-data", "--micro-batch-size", "4", "--load", ckpt,
                            "--use-checkpoint-args"], ckpt, windows)
    return {"held_out_loss": held_out, "final_validation_loss": valid_curve[-1][1] if valid_curve else None,
            "train_loss_last_10pct": sum(v for _, v in tail) / len(tail), "validation_curve": valid_curve}


def _std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "arch_compare"))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "arch_compare.png"))
    p.add_argument("--reuse", action="store_true", help="measure and plot the runs already in --out")
    a = p.parse_args()
    ensure_data(sys.executable)
    arms = [arm for arm in a.arms if available(arm)]
    skipped = {arm: f"preset {NEEDS_PRESET[arm]} not in this checkout" for arm in a.arms if arm not in arms}
    for arm, why in skipped.items():
        print(f"skipping {arm}: {why}", flush=True)
    from megatron_ext.arguments import parse_args

    split = parse_args(["@examples/tiny/pretrain.args", "--dry-run"], world_size=1).split
    windows, (first_doc, end_doc) = held_out_windows(split, windows=64)
    tokens_per_step = 16 * 256
    runs: dict[str, list[dict]] = {}
    for arm in arms:
        for seed in a.seeds:
            out = os.path.join(a.out, f"{arm}_seed{seed}")
            seconds = None if a.reuse else train(arm, seed, out, a.iters, a.eval_interval)
            runs.setdefault(arm, []).append({"seed": seed, "wall_seconds_per_iteration": seconds, **measure(arm, out,
                                                                                                    windows)})

    summary = {}
    for arm, rs in runs.items():
        held = [r["held_out_loss"] for r in rs]
        valid = [r["final_validation_loss"] for r in rs if r["final_validation_loss"] is not None]
        summary[arm] = {
            "parameters": parameters(arm), "flags": " ".join(ARMS[arm]), "seeds": [r["seed"] for r in rs],
            "held_out_loss_per_seed": held, "held_out_loss_mean": sum(held) / len(held),
            "held_out_loss_std": _std(held) if len(held) > 1 else None,
            "final_validation_loss_mean": sum(valid) / len(valid) if valid else None,
            "train_loss_last_10pct_mean": sum(r["train_loss_last_10pct"] for r in rs) / len(rs),
            "wall_seconds_per_iteration_incl_startup_and_eval": [r["wall_seconds_per_iteration"] for r in rs],
        }
    if "baseline" in summary:
        base = {r["seed"]: r["held_out_loss"] for r in runs["baseline"]}
        for arm, rs in runs.items():
            diffs = [r["held_out_loss"] - base[r["seed"]] for r in rs if r["seed"] in base]
            summary[arm]["held_out_vs_baseline_mean"] = sum(diffs) / len(diffs)
            # standard error of the mean paired difference (same seed: same batches in the same order)
            summary[arm]["held_out_vs_baseline_stderr"] = _std(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    for arm, rs in runs.items():
        for r in rs:  # each seed thin, the mean over seeds bold
            curve = r["validation_curve"]
            ax.plot([it * tokens_per_step for it, _ in curve], [v for _, v in curve], "-", lw=0.8,
                    color=COLOURS[arm], alpha=0.35)
        steps = sorted(set.intersection(*(set(it for it, _ in r["validation_curve"]) for r in rs)))
        mean = [sum(dict(r["validation_curve"])[it] for r in rs) / len(rs) for it in steps]
        ax.plot([it * tokens_per_step for it in steps], mean, "o-", ms=3, lw=2, color=COLOURS[arm], label=arm)
    ax.set_xscale("log")
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("validation-split loss (nats/token)")
    ax.set_title("validation during training (thin: seeds, bold: mean)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    names = list(summary)
    means = [summary[n]["held_out_loss_mean"] for n in names]
    bx.bar(names, means, color=[COLOURS[n] for n in names],
           yerr=[summary[n]["held_out_loss_std"] for n in names] if len(a.seeds) > 1 else None, capsize=4)
    lo, hi = min(means), max(means)
    bx.set_ylim(lo - max(0.05, 2 * (hi - lo)), hi + max(0.02, 0.5 * (hi - lo)))
    for i, n in enumerate(names):
        bx.text(i, lo - max(0.05, 2 * (hi - lo)) + 0.01, f"{means[i]:.3f}\n{summary[n]['parameters'] / 1e3:.1f}K",
                ha="center", va="bottom", fontsize=8, color="white")
    spread = ", mean ± std over seeds" if len(a.seeds) > 1 else ""
    bx.set_title(f"held-out loss after training{spread}", fontsize=9)
    bx.set_ylabel("nats/token")
    bx.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Same budget on the Python standard library: {a.iters} steps x {tokens_per_step} tokens, "
                 f"seeds {a.seeds}" + (f" (skipped: {', '.join(skipped)})" if skipped else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)
    print(json.dumps({"iters": a.iters, "tokens_per_arm": a.iters * tokens_per_step,
                      "held_out_windows": f"64 x 256 tokens from documents {first_doc}-{end_doc - 1} "
                                          f"(not trained on; --split {split})",
                      "skipped": skipped, "arms": summary, "plot": os.path.relpath(a.plot, ROOT)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
