"""MTP acceptance over an RL run with speculative rollouts (--rl-speculative): does it hold up as the policy moves?

    python benchmarks/rl_speculative.py --out runs/rl_speculative        # about 15 minutes on 2 busy CPU cores

Steps: a supervised warm-up of the tiny model on digit sequence tasks (copy / reverse / sort of 3-6 digits, answers
of 4-7 tokens, so a rollout has several draft rounds), during which the MTP layer learns by self-distillation; then
two GRPO runs from that checkpoint with --rl-speculative, identical except that the control freezes the MTP layer
(--mtp-loss-scaling-factor 0: no distillation gradient). The trainer logs the step's acceptance (accepted / proposed
drafts, over every rollout of the step) as 'mtp acceptance'; this prints it in windows of --window steps for both
runs, with the reward, as a markdown table for docs/benchmarks.md, and writes the per-step values to
OUT/acceptance.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.rl_learning import MODEL, run, sft_start  # noqa: E402
from megatron_ext.rl.env import digit_tasks, write_prompts  # noqa: E402


def per_step(log_path) -> list[dict]:
    """{'step', 'mtp acceptance', 'mtp tokens per forward', 'reward mean'} of every logged iteration."""
    out = []
    for line in open(log_path):
        m = re.search(r" iteration\s+(\d+)/", line)
        if not m or "mtp acceptance" not in line:
            continue
        row = {"step": int(m.group(1))}
        for key in ("mtp acceptance", "mtp tokens per forward", "reward mean"):
            row[key] = float(re.search(re.escape(key) + r": ([-+0-9.eE]+)", line).group(1))
        out.append(row)
    return out


def decode_speed(sft: str, prompts: list[dict], group_size: int, max_tokens: int, repeats: int = 3) -> dict:
    """Seconds to generate one RL step's rollouts (prompts x group_size samples at temperature 1) on the warm-up
    checkpoint: plain batched decoding, MTP speculation one sample at a time, batched MTP speculation."""
    import statistics
    import time

    import torch

    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.engine import InferenceEngine, SamplingParams
    from megatron_ext.inference.speculative import SpeculationStats, generate_speculative
    from megatron_ext.inference.speculative_batch import generate_speculative_groups
    from megatron_ext.rl.env import VOCAB, prompt_tokens
    from megatron_ext.training.checkpointing import load_weights
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    torch.set_num_threads(1)
    args = parse_args(MODEL + ["--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    load_weights(args, model, sft, log=lambda *a, **k: None)
    engine = InferenceEngine(model[0])
    ids = [prompt_tokens(t) for t in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop_token_ids=(VOCAB.eos,))
    stats = {"one at a time": SpeculationStats(), "batched": SpeculationStats()}
    runs = {"plain batched": lambda: engine.generate_groups(ids, group_size, params),
            "speculative, one sample at a time": lambda: [
                generate_speculative(engine, p, SamplingParams(**{**vars(params), "seed": 1 + j}),
                                     stats["one at a time"])
                for p in ids for j in range(group_size)],
            "speculative, batched": lambda: generate_speculative_groups(engine, ids, group_size, params,
                                                                        stats["batched"])}
    out = {}
    for name, fn in runs.items():
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t)
        flat = result if name == "speculative, one sample at a time" else [c for g in result for c in g]
        out[name] = {"seconds": statistics.median(times), "tokens": sum(len(c.token_ids) for c in flat)}
    out["acceptance"] = stats["batched"].acceptance_rate
    destroy()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/rl_speculative")
    p.add_argument("--sft-iters", type=int, default=300)
    p.add_argument("--sft-lr", type=float, default=5e-3)
    p.add_argument("--rl-iters", type=int, default=40)
    p.add_argument("--rl-lr", type=float, default=2e-3)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--window", type=int, default=10)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    ops, min_len, max_len = ["copy", "reverse", "sort"], 3, 6
    model = MODEL + ["--grpo-max-response-length", str(max_len + 2)]
    n_sft, n_rl = a.sft_iters * 32, a.rl_iters * a.prompts_per_step
    train = digit_tasks("train", n_sft + n_rl, seed=3, ops=ops, min_len=min_len, max_len=max_len)
    files = {name: os.path.join(a.out, f"{name}.jsonl") for name in ("sft", "rl")}
    write_prompts(files["sft"], train[:n_sft])
    write_prompts(files["rl"], train[n_sft:])
    sft = os.path.join(a.out, "sft")
    start = sft_start(sft, a.sft_iters)
    if start is not None:
        run([sys.executable, "-W", "ignore", "rl_composer.py", *model, *start, "--rl-prompts", files["sft"],
             "--rl-sft-warmup",
             "--grpo-prompts-per-step", "32", "--train-iters", str(a.sft_iters), "--lr", str(a.sft_lr),
             "--lr-decay-style", "constant", "--grpo-kl-beta", "0", "--save", sft, "--log-interval", "50"],
            os.path.join(a.out, "sft.log"))
    runs = {"MTP distilled during RL (the recipe)": [], "MTP frozen (control)": ["--mtp-loss-scaling-factor", "0"]}
    results = {}
    for k, (name, extra) in enumerate(runs.items()):
        log = os.path.join(a.out, f"rl{k}.log")
        if not os.path.exists(log) or not per_step(log) or per_step(log)[-1]["step"] < a.rl_iters:
            run([sys.executable, "-W", "ignore", "rl_composer.py", *model, *extra, "--load", sft, "--finetune",
                 "--rl-prompts", files["rl"], "--train-iters", str(a.rl_iters), "--lr", str(a.rl_lr),
                 "--lr-decay-style", "constant", "--grpo-group-size", str(a.group_size), "--grpo-prompts-per-step",
                 str(a.prompts_per_step), "--rl-reward-weights", "exact=1,char_accuracy=0.5", "--rl-speculative",
                 "--log-interval", "1"], log)
        results[name] = per_step(log)
    with open(os.path.join(a.out, "acceptance.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"| RL steps | {' | '.join(f'{n}: acceptance / reward' for n in results)} |")
    print("|---|" + "---|" * len(results))
    for lo in range(0, a.rl_iters, a.window):
        cells = []
        for rows in results.values():
            w = [r for r in rows if lo < r["step"] <= lo + a.window]
            cells.append(f"{sum(r['mtp acceptance'] for r in w) / len(w):.3f} / "
                         f"{sum(r['reward mean'] for r in w) / len(w):.3f}" if w else "-")
        print(f"| {lo + 1}-{lo + a.window} | {' | '.join(cells)} |")
    for name, rows in results.items():
        tpf = sum(r["mtp tokens per forward"] for r in rows) / len(rows)
        print(f"{name}: acceptance step 1 {rows[0]['mtp acceptance']:.3f}, last {rows[-1]['mtp acceptance']:.3f}; "
              f"mean tokens per main forward {tpf:.2f}")
    speed = decode_speed(sft, train[n_sft:n_sft + a.prompts_per_step], a.group_size, max_len + 2)
    print(f"one RL step's rollouts ({a.prompts_per_step} prompts x {a.group_size} samples, T=1) on the warm-up "
          f"checkpoint, median of 3 (MTP acceptance {speed.pop('acceptance'):.3f}):")
    for name, v in speed.items():
        print(f"  {name}: {v['seconds']:.3f} s, {v['tokens'] / v['seconds']:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
