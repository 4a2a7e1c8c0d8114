"""Can a model of this size learn to copy from its context, and how many tokens does it take? In-context copying
(an induction head: find the earlier occurrence of the current token, predict what followed it) is what an agent
needs to put a path or a name from the instruction into a tool call; benchmarks/agentic_learning.py's tiny model
did not learn it within its budget. This probe measures the skill alone.

    python benchmarks/copy_probe.py --out runs/copy_probe                 # about 3 minutes on 2 CPU cores

Each document is `w1 w2 ... wN | w1 w2 ... wN`: N words drawn at random from 120 module-like names (the names the
agentic tasks use), then the same words again. Before the bar nothing better than the words' frequencies can be
known; after it every token is a copy. Two bounds frame the training loss (nats per token, every token counted):
``no copy``, the loss of the best bigram model of the documents (what a model that ignores all but the last token
reaches), and ``perfect copy``, that model's loss before the bar with every copied token predicted exactly. A
model that learned to copy approaches the second; one stuck at the first has not. The model is
agentic_learning.py's (--model-flags), from a random init, trained with pretrain_composer.py on a tokenizer
trained on the documents; the loss every --log-interval steps is read from its log.

`--kind tokens --tokenizer-model DIR` asks for the skill in its general form: one-token words of that tokenizer at
a distance that changes from document to document (bounds counted from the draws, `token_bounds`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.env.agent_tasks import MODULE_HEADS, MODULE_TAILS  # noqa: E402
from megatron_ext.lifetime import run_tied  # noqa: E402

MODEL_FLAGS = ("--model tiny --mtp-num-layers 0 --q-lora-rank 64 --kv-lora-rank 64 --qk-pos-emb-head-dim 16 "
               "--rotary-scaling-factor 1")


def documents(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = [h + t for h in MODULE_HEADS for t in MODULE_TAILS]
    out = []
    for _ in range(count):
        w = " ".join(rng.choice(names) for _ in range(words))
        out.append(f"{w} | {w}")
    return out


def token_documents(count: int, words: int, seed: int, tokenizer_dir: str, pool: int) -> list[str]:
    """`w1 ... wL | w1 ... wL` with L drawn from words/2..2*words per document and every w a word that is one
    token of the given tokenizer (`Ġ` and letters): the copy's distance changes from document to document, so only
    an induction head (find where the current token occurred, predict what followed it) copies, not attention to a
    fixed offset back."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).get_vocab()
    words_1tok = sorted(t[1:] for t in vocab  # `Ġ` (a space) then ASCII letters only
                        if t.startswith("\u0120") and len(t) > 2 and t[1:].isascii() and t[1:].isalpha())
    rng = random.Random(seed)
    chosen = rng.sample(words_1tok, min(pool, len(words_1tok)))
    out = []
    for _ in range(count):
        w = " ".join(rng.choice(chosen) for _ in range(rng.randint(max(2, words // 2), 2 * words)))
        out.append(f"{w} | {w}")
    return out


def token_bounds(words: int, pool: int) -> dict:
    """--kind tokens: each half draws L words uniformly from `pool` (L uniform over words/2..2*words), one token
    each; a document is 2L + 2 predictions (the words, the bar, the end of document). Without copying every word
    costs log(pool), with perfect copying only the first half's do; the bar and end-of-document costs are left
    out of both bounds (a model pays them on top, so the share of the gap it closes is, if anything, understated)."""
    lengths = range(max(2, words // 2), 2 * words + 1)
    mean = sum(lengths) / len(lengths)
    per_word = math.log(pool)
    return {"no_copy": 2 * mean * per_word / (2 * mean + 2), "perfect_copy": mean * per_word / (2 * mean + 2),
            "tokens_per_document": 2 * mean + 2}


def bounds(tokenizer_dir: str, docs: list[str], eod: int) -> dict:
    """Bigram cross-entropy of the documents (fitted on them: the best a context-free model can do) and the same
    with every token after the bar (and the end of document) free."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    pairs, firsts, seqs = Counter(), Counter(), []
    for d in docs:
        enc = tok.encode(d)
        bar = d.index(" | ") + 2   # the bar's character: tokens that start after it are copies
        copied = [start >= bar for start, _ in enc.offsets]
        ids = [eod] + enc.ids + [eod]   # documents follow each other: the first word is predicted from the eod
        seqs.append((ids, [False] + copied + [True]))
        for a, b in zip(ids, ids[1:]):
            pairs[(a, b)] += 1
            firsts[a] += 1
    total = before = 0.0
    n = 0
    for ids, copied in seqs:
        for (a, b), is_copy in zip(zip(ids, ids[1:]), copied[1:]):
            loss = -math.log(pairs[(a, b)] / firsts[a])
            total += loss
            before += 0.0 if is_copy else loss
            n += 1
    return {"no_copy": total / n, "perfect_copy": before / n, "tokens_per_document": n / len(seqs)}


def measure(ckpt: str, tokenizer_dir: str, docs: list[str]) -> dict:
    """Copying as a checkpoint does it, one document a sequence (no other document to copy from): over the tokens
    after the bar, how often the greedy prediction is the copy (top-1) and the probability it gives the copy.
    Any checkpoint of the tokenizer's vocabulary, e.g. a warm-up before and after the code pretraining that
    follows it (does the skill survive?)."""
    import torch
    from tokenizers import Tokenizer

    from megatron_ext import platform
    from megatron_ext.arguments import parse_args
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.training.checkpointing import load_weights
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(["--load", ckpt, "--use-checkpoint-args", "--tokenizer-model", tokenizer_dir, "--mock-data"],
                      world_size=1)
    initialize_distributed(args)
    hits = total = 0
    p_copy = 0.0
    try:
        model = build_model(args, wrap_ddp=False)
        load_weights(args, model, ckpt, log=lambda *x: None)
        model[0].eval()
        eod = build_tokenizer(args.tokenizer_type, tokenizer_dir).eod
        tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        device = platform.device()
        for d in docs:
            enc = tok.encode(d)
            bar = d.index(" | ") + 2
            ids = [eod] + enc.ids
            copies = [i + 1 for i, (start, _) in enumerate(enc.offsets) if start >= bar]
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                probs = model[0](x, torch.arange(len(ids), device=device).unsqueeze(0), None)[0].float().softmax(-1)
            for i in copies:
                hits += int(probs[i - 1].argmax().item() == ids[i])
                p_copy += probs[i - 1, ids[i]].item()
                total += 1
    finally:
        destroy()
    return {"checkpoint": ckpt, "documents": len(docs), "copied_tokens": total, "top1": hits / total,
            "p_copy": p_copy / total}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/copy_probe")
    p.add_argument("--documents", type=int, default=60000)
    p.add_argument("--words", type=int, default=8, help="words per half of a document (--kind tokens: from half "
                   "to twice as many)")
    p.add_argument("--kind", default="names", choices=("names", "tokens"),
                   help="names: the tasks' module names (tokens each, per the tokenizer); tokens: one-token words of "
                        "--tokenizer-model at a varying distance (needs --tokenizer-model)")
    p.add_argument("--pool", type=int, default=400, help="--kind tokens: distinct words drawn from")
    p.add_argument("--model-flags", default=MODEL_FLAGS)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--iters", type=int, default=800)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenizer-model", default=None,
                   help="use this tokenizer (e.g. agentic_learning.py's DIR/tokenizer) instead of training one")
    p.add_argument("--save", default=None,
                   help="keep the trained weights here: a copy warm-up that agentic_learning.py --init starts from")
    p.add_argument("--measure", default=None, metavar="CKPT",
                   help="train nothing: measure how a checkpoint copies on --measure-documents unseen documents of "
                        "this --kind (one a sequence), e.g. a --save of this probe, or what code pretraining made "
                        "of it (with the tokenizer it was trained with)")
    p.add_argument("--measure-documents", type=int, default=200)
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    if a.measure:
        if not a.tokenizer_model:
            p.error("--measure needs the checkpoint's tokenizer: --tokenizer-model DIR")
        n = a.documents + a.measure_documents  # the training documents' stream, past what training used
        fresh = (documents(n, a.words, a.seed) if a.kind == "names" else
                 token_documents(n, a.words, a.seed, a.tokenizer_model, a.pool))[a.documents:]
        m = measure(a.measure, a.tokenizer_model, fresh)
        with open(os.path.join(out, "measure_" + os.path.basename(os.path.normpath(a.measure)) + ".json"), "w") as f:
            json.dump(m, f, indent=1)
        print(f"{a.measure}: copied tokens (after the bar) predicted top-1 {m['top1']:.3f}, mean probability of the "
              f"copy {m['p_copy']:.3f} ({m['copied_tokens']} tokens, {m['documents']} documents, one a sequence)")
        return 0
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    py = [sys.executable, "-W", "ignore"]
    if a.kind == "tokens" and not a.tokenizer_model:
        p.error("--kind tokens draws one-token words from --tokenizer-model: pass one")
    docs = documents(a.documents, a.words, a.seed) if a.kind == "names" else \
        token_documents(a.documents, a.words, a.seed, a.tokenizer_model, a.pool)
    corpus = os.path.join(out, "copy.jsonl")
    with open(corpus, "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)

    def run(cmd, name):
        with open(os.path.join(out, name + ".log"), "w") as log:
            code = run_tied([str(c) for c in cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if code:
            raise SystemExit(f"{name} failed ({code}); see {os.path.join(out, name + '.log')}")

    tokenizer = a.tokenizer_model or os.path.join(out, "tokenizer")
    if not a.tokenizer_model:
        run(py + ["tools/train_tokenizer.py", "--input", corpus, "--vocab-size", 512, "--output", tokenizer],
            "tokenizer")
    prefix = os.path.join(out, "copy")
    run(py + ["tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix, "--tokenizer-type",
              "HFTokenizer", "--tokenizer-model", tokenizer, "--workers", 1, "--append-eod"], "preprocess")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", a.ranks]
    launcher = py + (torchrun if a.ranks > 1 else [])
    run(launcher + ["pretrain_composer.py", *a.model_flags.split(), "--seq-length", a.seq_length,
                    "--max-position-embeddings", a.seq_length, "--original-max-position-embeddings", a.seq_length,
                    "--data-path", prefix + "_text_document", "--tokenizer-model", tokenizer,
                    "--micro-batch-size", max(1, a.batch // a.ranks), "--global-batch-size", a.batch,
                    "--lr", a.lr, "--min-lr", a.lr / 10, "--lr-warmup-iters", min(20, max(1, a.iters // 10)),
                    "--lr-decay-style", "cosine",
                    "--train-iters", a.iters, "--split", "98,2,0", "--eval-interval", a.iters, "--eval-iters", 1,
                    "--log-interval", a.log_interval, "--seed", a.seed,
                    *(["--save", a.save, "--save-interval", a.iters] if a.save else [])], "train")
    with open(os.path.join(out, "train.log")) as f:
        curve = [(int(i), float(loss)) for i, loss in
                 re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+)", f.read())]
    from megatron_ext.data.tokenizers import build_tokenizer

    if a.kind == "names":
        b = bounds(tokenizer, docs[:5000], build_tokenizer("HFTokenizer", tokenizer).eod)  # the eod --append-eod wrote
    else:  # a bigram fitted on documents of uniform draws from --pool words overfits: count the draws instead
        b = token_bounds(a.words, a.pool)
    tokens_per_step = a.batch * a.seq_length
    rows = [{"step": s, "tokens": s * tokens_per_step, "loss": loss,
             "copied_fraction": (b["no_copy"] - loss) / (b["no_copy"] - b["perfect_copy"])} for s, loss in curve]
    summary = {"settings": vars(a), "bounds": b, "curve": rows}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"bounds (nats/token): no copy {b['no_copy']:.3f}, perfect copy {b['perfect_copy']:.3f}")
    print("| step | tokens seen | loss | share of the gap closed |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['tokens'] / 1e6:.2f}M | {r['loss']:.3f} | {r['copied_fraction']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
