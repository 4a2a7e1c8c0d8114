"""Peak memory of `tools/convert_checkpoint.py import` relative to the largest input shard.

Writes a synthetic multi-shard DeepSeek-V3-format checkpoint (random bf16 weights, one decoder layer per shard,
the routed experts being most of each shard, as in the real release), converts it in a fresh process, and
reports that process's peak RSS (which includes Python, torch and Megatron-Core themselves) divided by the
largest shard. Goal: <= 3. Also runs `export` and reports its peak RSS.

    python benchmarks/convert_rss.py [--workdir /tmp/convert_rss] [--layers 6] [--experts 32] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_checkpoint(path: str, layers: int, experts: int, hidden: int, vocab: int = 32000):
    heads, q_lora, kv_lora, nope, rope, v = 8, hidden // 4, hidden // 8, 64, 32, 64
    ffn, moe_ffn = 2 * hidden, hidden
    cfg = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": ffn, "moe_intermediate_size": moe_ffn,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
           "n_shared_experts": 1, "n_routed_experts": experts, "num_experts_per_tok": 4, "routed_scaling_factor": 2.5,
           "kv_lora_rank": kv_lora, "q_lora_rank": q_lora, "qk_rope_head_dim": rope, "v_head_dim": v,
           "qk_nope_head_dim": nope, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
           "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
           "torch_dtype": "bfloat16"}
    os.makedirs(path, exist_ok=True)
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shards = [{"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden),
               "lm_head.weight": w(vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": w(hidden), p + "post_attention_layernorm.weight": w(hidden),
             p + "self_attn.q_a_proj.weight": w(q_lora, hidden), p + "self_attn.q_a_layernorm.weight": w(q_lora),
             p + "self_attn.q_b_proj.weight": w(heads * (nope + rope), q_lora),
             p + "self_attn.kv_a_proj_with_mqa.weight": w(kv_lora + rope, hidden),
             p + "self_attn.kv_a_layernorm.weight": w(kv_lora),
             p + "self_attn.kv_b_proj.weight": w(heads * (nope + v), kv_lora),
             p + "self_attn.o_proj.weight": w(hidden, heads * v)}
        if i == 0:
            t.update({p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
                      p + "mlp.down_proj.weight": w(hidden, ffn)})
        else:
            t.update({p + "mlp.gate.weight": w(experts, hidden),
                      p + "mlp.gate.e_score_correction_bias": torch.zeros(experts)})
            for s in ("shared_experts.",) + tuple(f"experts.{j}." for j in range(experts)):
                t.update({p + f"mlp.{s}gate_proj.weight": w(moe_ffn, hidden),
                          p + f"mlp.{s}up_proj.weight": w(moe_ffn, hidden),
                          p + f"mlp.{s}down_proj.weight": w(hidden, moe_ffn)})
        shards.append(t)
    weight_map = {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(path, name))
        weight_map.update({n: name for n in tensors})
    json.dump({"weight_map": weight_map}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return max(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))


def run(cmd: list[str]) -> float:
    out = subprocess.run([sys.executable, "-W", "ignore", *cmd], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return float(re.search(r"peak RSS: ([0-9.]+) MiB", out.stdout).group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/convert_rss")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    opts = p.parse_args()
    shutil.rmtree(opts.workdir, ignore_errors=True)
    hf, mg, out = (os.path.join(opts.workdir, d) for d in ("hf", "mg", "exported"))
    largest = synthetic_checkpoint(hf, opts.layers, opts.experts, opts.hidden) / 2**20
    total = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf)) / 2**20
    baseline = run(["-c", "import megatron_ext, megatron.core.dist_checkpointing\n"
                          "from megatron_ext.convert.streaming import peak_rss_mib\n"
                          "print(f'peak RSS: {peak_rss_mib():.1f} MiB')"])
    imported = run(["tools/convert_checkpoint.py", "import", "--hf-dir", hf, "--save", mg])
    exported = run(["tools/convert_checkpoint.py", "export", "--load", mg, "--hf-dir", out,
                    "--max-shard-size-mb", str(int(largest))])
    print(f"checkpoint: {total:.0f} MiB in {opts.layers + 1} shards, largest {largest:.0f} MiB")
    print(f"process baseline after imports: {baseline:.0f} MiB")
    print(f"import peak RSS: {imported:.0f} MiB -> {imported / largest:.2f} x largest shard (goal <= 3)")
    print(f"export peak RSS: {exported:.0f} MiB -> {exported / largest:.2f} x largest shard")
    shutil.rmtree(opts.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
