"""Peak resident memory of one batched prefill: many long prompts admitted together, as RL's rollouts admit a
turn's conversations (docs/benchmarks.md, "More distinct tasks per update").

    python benchmarks/prefill_memory.py                      # 64 prompts x 1,400 tokens, attention in pieces
    python benchmarks/prefill_memory.py --whole-attention    # one attention call over the whole batch (before)
    python benchmarks/prefill_memory.py --attention absorbed # the latent-space path (short chunks; models whose
                                                             # kv-lora rank makes absorbing always pay)
    python benchmarks/prefill_memory.py --next-turn 100      # then each conversation's next turn (its tokens
                                                             # + 100 new ones), continuing its finished row's
                                                             # cache (the engine's prefix store, as RL's turns)
    python benchmarks/prefill_memory.py --next-turn 100 --no-prefix-store   # the next turn prefilled whole

The model is the agentic-learning benchmark's (`--model tiny` with its latent ranks; random weights: memory and
time do not depend on them). Prints the process's peak resident memory before and after a greedy generation of
`--new-tokens` tokens, its wall time, and a digest of the tokens (the same with and without pieces). Run each
setting in its own process: the peak is the process's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = ["--model", "tiny", "--mtp-num-layers", "0", "--q-lora-rank", "64", "--kv-lora-rank", "64",
         "--qk-pos-emb-head-dim", "16", "--rotary-scaling-factor", "1"]


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64, help="prompts admitted together")
    p.add_argument("--tokens", type=int, default=1400, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=2)
    p.add_argument("--whole-attention", action="store_true",
                   help="no score budget: one attention call over every row (the engine before the pieces)")
    p.add_argument("--attention", choices=("auto", "absorbed", "expanded"), default="auto",
                   help="the engine's attention path for every step: its own choice by chunk length (auto; this "
                        "model's prefill is expanded), or one of the two forced")
    p.add_argument("--next-turn", type=int, default=0, metavar="N",
                   help="also time a second turn: each prompt, its sampled tokens and N new tokens (a tool's "
                        "output), --new-tokens sampled again")
    p.add_argument("--no-prefix-store", action="store_true",
                   help="with --next-turn: prefill the second turn whole instead of continuing the first turn's cache")
    a = p.parse_args(argv)
    if a.next_turn < 0:
        p.error("--next-turn is a number of tokens")
    if a.no_prefix_store and not a.next_turn:
        p.error("--no-prefix-store compares a second turn: give --next-turn N too")
    if a.prompts < 1 or a.tokens < 2 or a.new_tokens < 1:
        p.error("--prompts and --new-tokens must be positive and --tokens at least 2")

    import torch

    from megatron_ext.arguments import parse_args
    from megatron_ext.inference import engine as engine_module
    from megatron_ext.inference.engine import InferenceEngine, SamplingParams
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    if a.whole_attention:
        engine_module._ATTENTION_MAX_SCORE_BYTES = 1 << 62
    length = a.tokens + 2 * a.new_tokens + a.next_turn
    args = parse_args(MODEL + ["--mock-data", "--seq-length", str(length), "--max-position-embeddings",
                               str(length)], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)[0].eval()
        engine = InferenceEngine(model)
        if a.attention != "auto":
            engine.absorb_max_tokens = 1 << 30 if a.attention == "absorbed" else 0
        if a.next_turn and not a.no_prefix_store:
            engine.enable_prefix_store(1 << 14)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 1000, (a.tokens,), generator=g).tolist() for _ in range(a.prompts)]
        before, start = peak_gb(), time.perf_counter()
        out = engine.generate(prompts, SamplingParams(max_tokens=a.new_tokens, temperature=0.0))
        seconds = time.perf_counter() - start
        digest = hashlib.sha256(repr([o.token_ids for o in out]).encode()).hexdigest()[:12]
        budget = engine_module._ATTENTION_MAX_SCORE_BYTES >> 20
        how = "whole" if a.whole_attention else f"in pieces of at most {budget} MiB of scores"
        path = "" if a.attention == "auto" else f" ({a.attention})"
        print(f"{a.prompts} prompts x {a.tokens} tokens, attention{path} {how}: peak resident memory {before:.2f} GB "
              f"before, {peak_gb():.2f} GB after; {seconds:.1f} s; tokens {digest}")
        if a.next_turn:
            turn = [p + o.token_ids + torch.randint(0, 1000, (a.next_turn,), generator=g).tolist()
                    for p, o in zip(prompts, out)]
            prefilled, start = engine.prefill_tokens, time.perf_counter()
            again = engine.generate(turn, SamplingParams(max_tokens=a.new_tokens, temperature=0.0))
            seconds = time.perf_counter() - start
            digest = hashlib.sha256(repr([o.token_ids for o in again]).encode()).hexdigest()[:12]
            how = "prefilled whole" if a.no_prefix_store else "continuing the first turn's cache"
            print(f"next turn, {a.next_turn} new tokens each, {how}: {engine.prefill_tokens - prefilled} tokens "
                  f"prefilled; {seconds:.1f} s; peak resident memory {peak_gb():.2f} GB; tokens {digest}")
    finally:
        destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
