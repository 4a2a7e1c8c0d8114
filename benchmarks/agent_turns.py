"""Which step of an agentic episode a checkpoint gets right: each assistant turn of oracle conversations under
teacher forcing (the oracle's earlier turns and the real tool results as context), scored as the greedy token at
every position of the turn.

    python benchmarks/agent_turns.py --load DIR/ckpt/sft --tokenizer-model DIR/tokenizer \
        --conversations DIR/heldout_oracle.jsonl --out DIR/eval/sft/turns.json

--conversations is tools/build_agent_sft.py's output (chat conversations with tool calls). Per tool (read_file,
edit_file, ...) it reports the turns whose every token is the model's greedy choice (``exact``: the turn would be
produced verbatim at temperature 0 from that context) and the token accuracy, plus the first few mispredicted
tokens of each tool with what the model predicted. A checkpoint that cannot copy from its context gets the
constant parts of a call right (the tool name, the JSON) and misses the path, names and code it should copy;
this tells that apart from a model that does not know the episode's steps at all, without sampling a single
episode. Runs on one process (CPU or the first GPU); prints one line per tool and writes --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def turn_runs(loss_mask: list) -> list[tuple[int, int]]:
    """[start, end) of each run of trained tokens: one run per assistant message."""
    runs, start = [], None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def score(model, tokenizer, conversations: list, device, examples: int = 3) -> dict:
    import torch

    from megatron_ext.data.sft import render_chat

    per_tool = defaultdict(lambda: {"turns": 0, "exact": 0, "tokens": 0, "correct": 0, "misses": []})
    for record in conversations:
        rendered = render_chat(tokenizer, record["messages"], record.get("tools"))
        ids = torch.tensor([rendered.ids], device=device)
        positions = torch.arange(ids.size(1), device=device).unsqueeze(0)
        with torch.no_grad():
            logits = model(ids, positions, None)
        predicted = logits[0].argmax(-1).tolist()  # predicted[i] is the guess for token i + 1
        tools = [(m.get("tool_calls") or [{"function": {"name": "(message)"}}])[0]["function"]["name"]
                 for m in record["messages"] if m["role"] == "assistant"]
        runs = turn_runs(rendered.loss_mask)
        if len(runs) != len(tools):
            raise ValueError(f"{record.get('id')}: {len(runs)} trained runs for {len(tools)} assistant turns")
        for tool, (start, end) in zip(tools, runs):
            s = per_tool[tool]
            hits = [predicted[i - 1] == rendered.ids[i] for i in range(start, end)]
            s["turns"] += 1
            s["exact"] += all(hits)
            s["tokens"] += len(hits)
            s["correct"] += sum(hits)
            if not all(hits) and len(s["misses"]) < examples:
                i = start + hits.index(False)
                context = tokenizer.detokenize(rendered.ids[max(start, i - 8):i])
                s["misses"].append({"task": record.get("id"), "context": context,
                                    "expected": tokenizer.detokenize([rendered.ids[i]]),
                                    "predicted": tokenizer.detokenize([predicted[i - 1]])})
    return {tool: {"turns": s["turns"], "exact_rate": s["exact"] / s["turns"],
                   "token_accuracy": s["correct"] / max(s["tokens"], 1), "first_misses": s["misses"]}
            for tool, s in per_tool.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="a checkpoint directory (its recorded arguments are used)")
    p.add_argument("--tokenizer-model", required=True)
    p.add_argument("--conversations", required=True, help="tools/build_agent_sft.py output (.jsonl)")
    p.add_argument("--out", default=None, help="write the result here (.json)")
    a = p.parse_args(argv)
    conversations = [json.loads(line) for line in open(a.conversations) if line.strip()]
    if not conversations:
        p.error(f"--conversations {a.conversations}: no conversation")

    from megatron_ext import platform
    from megatron_ext.arguments import parse_args
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.training.checkpointing import load_weights
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(["--load", a.load, "--use-checkpoint-args", "--tokenizer-model", a.tokenizer_model,
                       "--mock-data"], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)
        load_weights(args, model, a.load, log=lambda *x: None)
        model[0].eval()
        tokenizer = build_tokenizer(args.tokenizer_type, a.tokenizer_model)
        result = score(model[0], tokenizer, conversations, platform.device())
    finally:
        destroy()
    for tool, r in sorted(result.items()):
        miss = r["first_misses"][0] if r["first_misses"] else None
        print(f"{tool:12s} turns {r['turns']:4d}  exact {r['exact_rate']:.3f}  tokens {r['token_accuracy']:.3f}"
              + (f"  e.g. after {miss['context']!r}: {miss['expected']!r}, predicted {miss['predicted']!r}"
                 if miss else ""))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"checkpoint": a.load, "conversations": len(conversations), "per_tool": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
