"""Kimi Delta Attention benchmarks.

(a) Chunked (UT-transform) ÷ naive token-by-token recurrence of the gated delta rule, forward, at --tokens
    (default 4096) for one rank's heads (default 4 heads of 128: Kimi-Linear-48B's 32 heads over TP8); both are
    our PyTorch forms (`chunk_kda`, `recurrent_kda`), checked equal first. Goal >= 10x.
(b) Decode cache per sequence against context length, measured on the engine's caches (`cache.bytes()` of
    `InferenceEngine.new_cache`): the Kimi-Linear-48B layout (20 KDA + 7 MLA layers) against the same model with
    every layer MLA, bf16; the model is built on the meta device with 8 experts (the cache does not depend on the
    MLP). Then the real tiny hybrid: prefill + decode at each context, cache tensors as allocated.

Timings alternate between the two sides (one run of each per repeat, after a warm-up) and report medians.

    python benchmarks/kda.py [--only a|b] [--tokens 4096] [--heads 4] [--head-dim 128] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import megatron_ext  # noqa: E402,F401
from megatron_ext.models import kda  # noqa: E402


def bench_chunk(tokens: int, heads: int, head_dim: int, repeats: int):
    g = torch.Generator().manual_seed(0)
    q, k = (kda.l2norm(torch.randn(1, tokens, heads, head_dim, generator=g)) for _ in range(2))
    v = torch.randn(1, tokens, heads, head_dim, generator=g)
    gate = -torch.nn.functional.softplus(torch.randn(1, tokens, heads, head_dim, generator=g)) * 0.5
    beta = torch.rand(1, tokens, heads, generator=g)
    with torch.no_grad():
        chunk, _ = kda.chunk_kda(q, k, v, gate, beta)
        naive, _ = kda.recurrent_kda(q, k, v, gate, beta)
        err = ((chunk - naive).abs().max() / naive.abs().max()).item()
        times = {"chunked": [], "recurrent": []}
        for _ in range(repeats):
            for name, fn in (("chunked", kda.chunk_kda), ("recurrent", kda.recurrent_kda)):
                start = time.perf_counter()
                fn(q, k, v, gate, beta)
                times[name].append(time.perf_counter() - start)
    c, r = statistics.median(times["chunked"]), statistics.median(times["recurrent"])
    print(f"(a) {tokens} tokens, {heads} heads x {head_dim}, forward, median of {repeats}: chunked {c * 1e3:.1f} ms, "
          f"naive recurrence {r * 1e3:.1f} ms, ratio {r / c:.1f}x (goal >= 10x); max rel. difference {err:.1e}")


def _engine(preset: str, extra: list[str], meta: bool):
    from megatron_ext.arguments import parse_args
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.models.provider import model_provider
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.initialize import initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(["--model", preset, "--mock-data", "--transformer-impl", "local", *extra], world_size=1)
    initialize_distributed(args)
    if meta:
        with torch.device("meta"):
            model = model_provider(args)
    else:
        model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=1))[0].eval()
    return InferenceEngine(model), model


def _state_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for st in cache.states if st is not None for t in st)


def bench_memory(contexts: list[int]):
    from megatron_ext.training.initialize import destroy

    rows = {}
    for name, extra in (("kimi-linear-48b (20 KDA + 7 MLA)", []),
                        ("same, all MLA", ["--hybrid-layer-pattern", "M" * 27])):
        engine, _ = _engine("kimi-linear-48b", ["--num-experts", "8", "--bf16", *extra], meta=True)
        caches = [engine.new_cache(len(engine.layers), 1, n) for n in contexts]
        rows[name] = [c.bytes() for c in caches]
        if not name.startswith("same"):
            rows["of which KDA states"] = [_state_bytes(c) for c in caches]
        destroy()
    print("(b) decode cache per sequence, bf16 (engine.new_cache(...).bytes(), KDA states in fp32):")
    print("    context | " + " | ".join(rows))
    for i, n in enumerate(contexts):
        print(f"    {n:>7} | " + " | ".join(f"{rows[r][i] / 2**20:10.2f} MiB" for r in rows))
    kda_rows = rows["kimi-linear-48b (20 KDA + 7 MLA)"]
    mla_rows = rows["same, all MLA"]
    per_token = (kda_rows[-1] - kda_rows[0]) / (contexts[-1] - contexts[0])
    per_token_mla = (mla_rows[-1] - mla_rows[0]) / (contexts[-1] - contexts[0])
    print(f"    growth per token: hybrid {per_token:.0f} B (its 7 MLA layers), all-MLA {per_token_mla:.0f} B; "
          f"at {contexts[-1]} tokens the hybrid holds {kda_rows[-1] / mla_rows[-1]:.3f} of the all-MLA cache")

    # the real tiny hybrid: prefill then decode one token, caches as allocated, KDA share constant (contexts up
    # to 8192: a longer one-shot prefill's [s, s] attention scores would not fit this machine's memory)
    tiny_contexts = [n for n in contexts if n <= 8192]
    engine, _ = _engine("tiny-kimi-linear", ["--max-position-embeddings", str(max(tiny_contexts) + 8)], meta=False)
    print("    tiny-kimi-linear (3 KDA + 1 MLA layers, fp32), measured after a prefill and one decode step:")
    for n in tiny_contexts:
        cache = engine.new_cache(len(engine.layers), 1, n + 1)
        ids = torch.randint(0, 1000, (1, n))
        engine.forward(ids, torch.arange(n).unsqueeze(0), cache, torch.tensor([0]))
        engine.forward(ids[:, -1:], torch.tensor([[n]]), cache, torch.tensor([n]))
        kda_bytes = _state_bytes(cache)
        mla_bytes = sum(t.numel() * t.element_size() for t in cache.kv)
        print(f"      context {n:>6}: KDA states {kda_bytes:>8} B, MLA latents {mla_bytes:>9} B")
    destroy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["a", "b"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="1024,4096,16384,65536,262144")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.only in (None, "a"):
        bench_chunk(args.tokens, args.heads, args.head_dim, args.repeats)
    if args.only in (None, "b"):
        bench_memory([int(x) for x in args.contexts.split(",")])


if __name__ == "__main__":
    main()
