"""The three continued-pretraining stages on real code, with the loss plotted against tokens on a log axis.

    python benchmarks/stages_loss.py [--out runs/stages] [--pretrain-iters 600] [--extend-iters 60] [--sft-iters 60]

Uses `make demo`'s data (runs/demo/data: the standard-library corpus, its 4096-id tokenizer, the indexed dataset
and the SFT conversations; built if missing) and the flag files in examples/tiny/: pretrain at 256 tokens
(2 ranks, DP2), extend to 1024 tokens with YaRN under context parallelism 2 (MTP attached, self-distilled), SFT.
Writes docs/stages_loss.png and prints the figures docs/benchmarks.md records:
  - the pretraining loss against log(tokens): least-squares slope and R^2 of the validation losses (after the first
    evaluation) and of the training losses' second half, to see whether the loss falls log-linearly as the
    Composer 2 report observes on its code base;
  - the short-context cost of YaRN: loss on 256-token windows of held-out documents (the validation and test
    splits of the pretraining flag file's --split, never trained on) of the pretrained weights with plain RoPE,
    under the extension's YaRN before any extension training (with and without YaRN's attention temperature:
    --mscale 0 --mscale-all-dim 0), and after the extension stage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATA = os.path.join(ROOT, "runs", "demo", "data")


def sh(cmd: list[str]):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def ensure_data(py: str):
    tok = os.path.join(DATA, "tokenizer")
    if not os.path.exists(os.path.join(DATA, "stdlib_text_document.idx")):
        sh([py, "tools/build_corpus.py", "--output", os.path.join(DATA, "stdlib.jsonl")])
        sh([py, "tools/train_tokenizer.py", "--input", os.path.join(DATA, "stdlib.jsonl"), "--vocab-size", "4096",
            "--output", tok])
        sh([py, "tools/preprocess_data.py", "--input", os.path.join(DATA, "stdlib.jsonl"), "--output-prefix",
            os.path.join(DATA, "stdlib"), "--tokenizer-type", "HFTokenizer", "--tokenizer-model", tok,
            "--workers", "2", "--append-eod"])
    if not os.path.exists(os.path.join(DATA, "sft.jsonl")):
        sh([py, "tools/build_sft_data.py", "--input", os.path.join(DATA, "stdlib.jsonl"),
            "--output", os.path.join(DATA, "sft.jsonl")])


def held_out_windows(split: str, windows: int = 16, seq: int = 256):
    """`windows` rows of seq + 1 tokens from the documents that `--split` puts in the validation and test splits
    (Megatron-Core's builder takes the training split's documents first, as megatron_ext.data.gpt.split_ranges
    rounds them), in batches of 4 (tokens, labels)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.data.gpt import parse_split, split_ranges

    ds = IndexedDataset(os.path.join(DATA, "stdlib_text_document"))
    train_end = split_ranges(len(ds), parse_split(split))[0][1]
    need, parts, doc = windows * (seq + 1), [], train_end
    while sum(len(p) for p in parts) < need and doc < len(ds):
        parts.append(np.asarray(ds[doc], dtype=np.int64))
        doc += 1
    del ds
    ids = torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.int64)
    if ids.numel() < need:
        raise SystemExit(f"the held-out documents (after the first {train_end} of --split {split}) hold "
                         f"{ids.numel()} tokens, fewer than {windows} windows of {seq + 1}")
    rows = ids[:need].view(windows, seq + 1)
    return [(rows[i:i + 4, :-1], rows[i:i + 4, 1:]) for i in range(0, windows, 4)], (train_end, doc)


def short_context_loss(flags: list[str], path: str, batches) -> float:
    """Mean per-token loss of the weights under `path`, built with `flags`, on the held-out windows."""
    from megatron_ext.training.lm import window_loss

    return window_loss(flags, path, batches)


def fit_loglinear(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of loss against ln(tokens) and R^2."""
    xs = [math.log(t) for t, _ in points]
    ys = [v for _, v in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    ss_res = sum((y - (my + slope * (x - mx))) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, 1 - ss_res / ss_tot


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "stages"))
    p.add_argument("--pretrain-iters", type=int, default=600)
    p.add_argument("--extend-iters", type=int, default=60)
    p.add_argument("--sft-iters", type=int, default=60)
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "stages_loss.png"))
    p.add_argument("--reuse", action="store_true", help="measure and plot the run already in --out")
    a = p.parse_args()
    py = sys.executable
    torchrun = [os.path.join(os.path.dirname(py), "torchrun"), "--nproc-per-node", "2", "pretrain_composer.py"]
    tokens = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", os.path.join(DATA, "tokenizer")]
    pretrain_data = ["--data-path", os.path.join(DATA, "stdlib_text_document"), *tokens]
    ensure_data(py)
    ck = {s: os.path.join(a.out, "ckpt", s) for s in ("pretrain", "extend", "sft")}
    tb = {s: os.path.join(a.out, "tb", s) for s in ck}
    if not a.reuse:
        shutil.rmtree(a.out, ignore_errors=True)
        sh(torchrun + ["@examples/tiny/pretrain.args", *pretrain_data, "--train-iters", str(a.pretrain_iters),
                       "--save", ck["pretrain"], "--load", ck["pretrain"], "--save-interval", str(a.pretrain_iters),
                       "--eval-interval", "25", "--tensorboard-dir", tb["pretrain"]])
        sh(torchrun + ["@examples/tiny/extend.args", *pretrain_data, "--train-iters", str(a.extend_iters),
                       "--load", ck["pretrain"], "--save", ck["extend"], "--save-interval", str(a.extend_iters),
                       "--tensorboard-dir", tb["extend"]])
        sh(torchrun + ["@examples/tiny/sft.args", "--data-path", os.path.join(DATA, "sft.jsonl"), *tokens,
                       "--train-iters", str(a.sft_iters), "--load", ck["extend"], "--save", ck["sft"],
                       "--save-interval", str(a.sft_iters), "--tensorboard-dir", tb["sft"]])

    from megatron_ext.arguments import parse_args
    from megatron_ext.training.tensorboard import scalars

    curves, offset, agreement = {}, 0, None
    for name in ("pretrain", "extend", "sft"):
        flags = parse_args([f"@examples/tiny/{name}.args", "--dry-run"], world_size=2)
        per_step = flags.global_batch_size * flags.seq_length  # tokens per step, as the flag files say
        s = scalars(tb[name])
        train = sorted(s["lm loss"].items())
        valid = sorted(s.get("lm loss validation", {}).items())
        curves[name] = ([(offset + it * per_step, v) for it, v in train], [(offset + it * per_step, v) for it, v in valid])
        offset += train[-1][0] * per_step
        if name == "sft" and "mtp_1 top1 agreement" in s:
            agreement = sorted(s["mtp_1 top1 agreement"].items())[-1][1]
    pre_train, pre_valid = curves["pretrain"]
    tail = pre_valid[1:]  # validation points after the first (still in the steep start)
    slope, r2 = fit_loglinear(tail)
    train_slope, train_r2 = fit_loglinear(pre_train[len(pre_train) // 2:])

    common = ["--model", "tiny", "--mock-data", "--micro-batch-size", "4"]
    split = parse_args(["@examples/tiny/pretrain.args", "--dry-run"], world_size=2).split
    windows, (first_doc, end_doc) = held_out_windows(split)
    extend = common + ["--stage", "extend", "--load", ck["pretrain"], "--seq-length", "1024"]
    plain = short_context_loss(common + ["--load", ck["pretrain"], "--use-checkpoint-args"], ck["pretrain"], windows)
    yarn = short_context_loss(extend, ck["pretrain"], windows)
    yarn_no_temperature = short_context_loss(extend + ["--mscale", "0", "--mscale-all-dim", "0"], ck["pretrain"],
                                             windows)
    extended = short_context_loss(common + ["--load", ck["extend"], "--use-checkpoint-args"], ck["extend"], windows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"pretrain": "tab:blue", "extend": "tab:orange", "sft": "tab:green"}
    for name, (train, valid) in curves.items():
        ax.plot([t for t, _ in train], [v for _, v in train], color=colours[name], alpha=0.6, label=f"{name} (train)")
        if valid:
            ax.plot([t for t, _ in valid], [v for _, v in valid], "o", color=colours[name], label=f"{name} (validation)")
    xs = [t for t, _ in tail]
    mx = sum(math.log(x) for x in xs) / len(xs)
    my = sum(v for _, v in tail) / len(tail)
    ax.plot(xs, [my + slope * (math.log(x) - mx) for x in xs], "k--",
            label=f"log-linear fit to pretrain validation: {slope:.3f} nats per e-fold, R² {r2:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("tokens trained (all stages, cumulative)")
    ax.set_ylabel("lm loss (nats/token)")
    ax.set_title("tiny K2.5 on the Python standard library: pretrain 256 -> extend 1024 (CP2, YaRN) -> SFT")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)
    result = {"pretrain_validation_loglinear_slope": slope, "pretrain_validation_loglinear_r2": r2,
              "pretrain_train_loss_second_half_slope": train_slope, "pretrain_train_loss_second_half_r2": train_r2,
              "pretrain_final_loss": pre_train[-1][1],
              "pretrain_final_validation": curves["pretrain"][1][-1][1] if curves["pretrain"][1] else None,
              "short_context_windows": f"16 x 256 tokens from held-out documents {first_doc}-{end_doc - 1} "
                                       f"(training split: documents 0-{first_doc - 1}, --split {split})",
              "short_context_loss_plain_rope": plain, "short_context_loss_yarn_before_extension": yarn,
              "short_context_loss_yarn_no_attention_temperature": yarn_no_temperature,
              "short_context_loss_after_extension": extended,
              "extend_final_validation": curves["extend"][1][-1][1] if curves["extend"][1] else None,
              "sft_final_validation": curves["sft"][1][-1][1] if curves["sft"][1] else None,
              "sft_mtp1_top1_agreement": agreement, "plot": os.path.relpath(a.plot, ROOT)}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
