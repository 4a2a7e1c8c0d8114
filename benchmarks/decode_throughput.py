"""Decode speed of the inference engine.

(a) Our latent-cache greedy decoding on the Megatron model ÷ `transformers` `generate` (KV cache on) on the same
    weights: a random DeepSeek-V3-shaped model is saved by transformers, imported with our converter, and both
    decode the same prompt for the same number of tokens (goal >= 2x).
(b) MTP speculative decoding ÷ plain decoding, greedy, with the acceptance rate, on a tiny model whose MTP layer
    has been trained (pretrain_composer.py on the mock arithmetic-progression data, MTP loss on) — a stand-in until
    the stdlib-corpus self-distilled model exists (goals >= 1.8x and >= 0.85).

    python benchmarks/decode_throughput.py [--tokens 64] [--repeats 3] [--train-iters 1000] [--hidden 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import megatron_ext  # noqa: E402,F401
import pretrain_composer as entry  # noqa: E402
from megatron_ext.arguments import parse_args  # noqa: E402
from megatron_ext.convert.streaming import import_hf  # noqa: E402
from megatron_ext.data.mock import mock_sample  # noqa: E402
from megatron_ext.inference.engine import InferenceEngine, SamplingParams  # noqa: E402
from megatron_ext.inference.speculative import SpeculationStats, generate_speculative  # noqa: E402
from megatron_ext.training.checkpointing import load_weights  # noqa: E402
from megatron_ext.training.initialize import destroy, initialize_distributed  # noqa: E402
from megatron_ext.training.step import build_model  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def versus_transformers(tokens: int, repeats: int, workdir: str, hidden: int, layers: int, experts: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    heads = hidden // 32
    cfg = DeepseekV3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden,
                           moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=experts,
                           num_experts_per_tok=4, n_group=1, topk_group=1, kv_lora_rank=hidden // 4,
                           q_lora_rank=hidden // 2, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                           first_k_dense_replace=1, max_position_embeddings=1024, num_mtp_layers=0)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    hf_dir, save = os.path.join(workdir, "hf"), os.path.join(workdir, "mg")
    hf.save_pretrained(hf_dir)
    import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    args = parse_args(["--model", "tiny", "--mock-data", "--use-checkpoint-args", "--load", save], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    load_weights(args, model, save, log=lambda *a, **k: None)
    engine = InferenceEngine(model[0])
    prompt = torch.randint(0, 8192, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    ours = timed(lambda: engine.generate([prompt], params), repeats)
    ids = torch.tensor([prompt])
    theirs = timed(lambda: hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                       use_cache=True), repeats)
    same = engine.generate([prompt], params)[0].token_ids == hf.generate(
        ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)[0, len(prompt):].tolist()
    destroy()
    return tokens / ours, tokens / theirs, same


def speculative(tokens: int, repeats: int, train_iters: int, workdir: str):
    save = os.path.join(workdir, "trained")
    assert entry.main(["--model", "tiny", "--mock-data", "--train-iters", str(train_iters), "--micro-batch-size", "8",
                       "--global-batch-size", "16", "--lr", "1e-2", "--lr-warmup-iters", "10", "--min-lr", "1e-3",
                       "--log-interval", str(train_iters), "--save", save]) == 0
    args = parse_args(["--model", "tiny", "--mock-data", "--load", save], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    load_weights(args, model, save, log=lambda *a, **k: None)
    engine = InferenceEngine(model[0])
    prompts = [mock_sample(10_000_000 + i, 16, args.vocab_size, args.seed).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    plain = timed(lambda: [engine.generate([p], params) for p in prompts], repeats)
    stats = SpeculationStats()
    spec = timed(lambda: [generate_speculative(engine, p, params, stats) for p in prompts], repeats)
    lossless = all(generate_speculative(engine, p, params).token_ids == engine.generate([p], params)[0].token_ids
                   for p in prompts)
    destroy()
    return plain / spec, stats, lossless


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--train-iters", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=512, help="(a): model width")
    p.add_argument("--layers", type=int, default=6, help="(a): decoder layers")
    p.add_argument("--experts", type=int, default=32, help="(a): routed experts")
    opts = p.parse_args()
    torch.set_num_threads(2)
    workdir = tempfile.mkdtemp(prefix="decode_bench_")
    try:
        ours, theirs, same = versus_transformers(opts.tokens, opts.repeats, workdir, opts.hidden, opts.layers,
                                                 opts.experts)
        print(f"(a) greedy decode, hidden {opts.hidden}, {opts.layers} layers, {opts.experts} experts top-4, batch 1, "
              f"prompt 32, {opts.tokens} new tokens: ours {ours:.1f} tok/s, "
              f"transformers generate {theirs:.1f} tok/s -> {ours / theirs:.2f}x (goal >= 2); same tokens: {same}")
        speedup, stats, lossless = speculative(opts.tokens, opts.repeats, opts.train_iters, workdir)
        print(f"(b) MTP speculative vs plain, greedy: {speedup:.2f}x (goal >= 1.8), acceptance "
              f"{stats.acceptance_rate:.3f} (goal >= 0.85), {stats.tokens_per_forward:.2f} tokens per main forward, "
              f"lossless: {lossless}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
