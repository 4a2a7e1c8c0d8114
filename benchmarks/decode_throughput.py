"""Decode speed of the inference engine.

(a) Our latent-cache greedy decoding on the Megatron model ÷ `transformers` `generate` (KV cache on) on the same
    weights: a random DeepSeek-V3-shaped model is saved by transformers, imported with our converter, and both
    decode the same prompt for the same number of tokens (goal >= 2x).
    (a) also prints the weight-read floor: the time per token of only the one-row matrix products a decode step
    makes (every attention projection, the router, the shared expert, top-k routed experts, the dense MLP of the
    first layer, the output layer), timed as bare calls of the engine's kernel (`platform.linear`: oneDNN or
    torch's BLAS for big fp32 weights on an x86 CPU, whichever the engine measured faster), next to the same
    products as `F.linear` (torch's BLAS) and a bare read of the bytes (`sum`), each repeat with other routed
    experts (as steps routed elsewhere); decoding is reported as a fraction of the first. `--only floor` prints
    just that, without transformers' side. `--only ops` counts the torch ops our decode step issues per token
    on (a)'s model (the profiler's top-level ops): the per-step host overhead as a number that a busy machine
    does not change.
(b) MTP speculative decoding ÷ plain decoding, greedy, with the acceptance rate (goals >= 1.8x and >= 0.85).
    With --load CKPT: a checkpoint saved by pretrain_composer.py (architecture from the checkpoint), prompts cut
    at line starts from a --prompts-from text/code file and tokenised with the checkpoint's tokenizer (or
    --tokenizer-model). Without --load: a stand-in, the tiny preset trained here on the mock arithmetic-progression
    data with the MTP loss on, over sequences long enough to hold a prompt and its new tokens (with --load, a
    checkpoint trained on shorter sequences is measured, with a warning in the report).

    By default speculation steps aside where drafting is not expected to pay (`--speculation auto`: measured
    draft and verify costs against a plain step, and the acceptance observed; the decision is printed);
    `--speculation always` times drafting itself. `--num-layers N` trains an N-layer stand-in, `--mtp-num-layers
    D` gives it D MTP layers (D drafts a round), `--save DIR` keeps it for later runs with `--load DIR`.
    `--batched` decodes the prompts together (the server's and RL's path, its decision measured per batch size)
    instead of one at a time.

Timings alternate between the two sides of each ratio (one run of each per repeat, after a warm-up) and report
medians, so that load from other jobs on a shared machine hits both sides alike.

--check: a regression guard. After measuring, each ratio is compared with the last figure recorded for the same
options in docs/benchmarks.md (tables with `command`, `ratio` and `paired runs` columns); a ratio whose median
falls outside the recorded paired-run range has moved, and the exit status is 1 when one fell below it.

    python benchmarks/decode_throughput.py [--only a|b|floor|ops] [--tokens 64] [--repeats 5] [--threads 2] [--check]
    python benchmarks/decode_throughput.py --only b --load CKPT --prompts-from /usr/lib/python3.11/json/decoder.py
    python benchmarks/decode_throughput.py --only b --num-layers 16 [--mtp-num-layers 2] [--save DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shlex
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
from megatron_ext.inference.speculative import (SpeculationStats, describe_plan, draft_depth,  # noqa: E402
                                                generate_speculative)
from megatron_ext.inference.speculative_batch import generate_speculative_groups  # noqa: E402
from megatron_ext.training.checkpointing import checkpoint_dir, load_weights, read_tracker  # noqa: E402
from megatron_ext.training.initialize import destroy, initialize_distributed  # noqa: E402
from megatron_ext.training.step import build_model  # noqa: E402

QUIET = dict(log=lambda *a, **k: None)


class OtherLoad:
    """Share of the machine's CPUs used by other processes while a measurement ran (from /proc/stat minus this
    process's own CPU time), so each figure says how busy the shared machine was."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user .. steal (guest time is within user)
        busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
        own = os.times()
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system

    def fraction(self) -> float:
        (t0, busy0, own0), (t1, busy1, own1) = self.start, self._sample()
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * os.cpu_count())


def alternate(first, second, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds per call of `first` and of `second`, run in turn `repeats` times after one warm-up each; which
    goes first alternates from pair to pair (with a fixed order the second of a pair ran measurably slower on a
    2-core VM: identical work measured 0.83-0.93x)."""
    first(), second()
    a, b = [], []
    for i in range(repeats):
        for fn, times in ((first, a), (second, b))[:: 1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return a, b


DOCS = os.path.join(ROOT, "docs", "benchmarks.md")
# options that do not change what a ratio measures
_NOT_COMPARED = {"check", "repeats", "only", "docs", "save"}


class Figure:
    """One ratio of a run: kind "a" (ours ÷ transformers, end to end) or "b" (speculative ÷ plain), the median
    over paired runs and their range."""

    def __init__(self, kind: str, median: float, lo: float, hi: float):
        self.kind, self.median, self.lo, self.hi = kind, median, lo, hi

    def __repr__(self):
        return f"({self.kind}) {self.median:.2f}x (paired {self.lo:.2f}-{self.hi:.2f})"


def recorded_figures(text: str) -> list[tuple[str, str, Figure]]:
    """(date, command, figure) of every row of the markdown tables whose header has `command`, `ratio` and
    `paired runs` columns, in file order; the ratio cell reads "(a) 1.50x", the paired cell "1.38-1.64"."""
    out, header = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(cells) <= {"---", ":---", "---:", ""} or not {"command", "ratio", "paired runs"} <= set(header):
            continue
        row = dict(zip(header, cells))
        ratio = re.search(r"\((a|b)\)\s*([0-9.]+)x", row.get("ratio", ""))
        paired = re.search(r"([0-9.]+)\s*-\s*([0-9.]+)", row.get("paired runs", ""))
        if ratio and paired:
            figure = Figure(ratio.group(1), float(ratio.group(2)), float(paired.group(1)), float(paired.group(2)))
            out.append((row.get("date", ""), row["command"].strip("`"), figure))
    return out


def options_of(command: str) -> dict:
    """The measured options of a recorded command line (what follows decode_throughput.py), defaults filled."""
    words = shlex.split(command)
    at = next((i for i, w in enumerate(words) if w.endswith("decode_throughput.py")), None)
    if at is None:
        raise ValueError(f"not a decode_throughput.py command: {command!r}")
    opts = vars(parser().parse_args(words[at + 1:]))
    return {k: v for k, v in opts.items() if k not in _NOT_COMPARED}


def compare(figures: list[Figure], options: dict, text: str) -> tuple[list[str], bool]:
    """A line per ratio against the last recorded figure of its kind with the same options, and whether one
    fell below its recorded paired-run range."""
    lines, fell = [], False
    records = [(date, fig) for date, command, fig in recorded_figures(text) if options_of(command) == options]
    for fig in figures:
        last = [(date, rec) for date, rec in records if rec.kind == fig.kind]
        if not last:
            lines.append(f"check ({fig.kind}): no recorded figure for these options")
            continue
        date, rec = last[-1]
        if fig.median < rec.lo:
            verdict, fell = f"MOVED DOWN by {rec.median - fig.median:.2f}x", True
        elif fig.median > rec.hi:
            verdict = f"moved up by {fig.median - rec.median:.2f}x"
        else:
            verdict = "within the recorded paired-run range"
        lines.append(f"check ({fig.kind}): now {fig.median:.2f}x (paired {fig.lo:.2f}-{fig.hi:.2f}), recorded "
                     f"{date} {rec.median:.2f}x (paired {rec.lo:.2f}-{rec.hi:.2f}): {verdict}")
    return lines, fell


def ratio_summary(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(median of b/a over paired runs, min, max)."""
    ratios = [y / x for x, y in zip(a, b)]
    return statistics.median(ratios), min(ratios), max(ratios)


def load_engine(load: str) -> tuple[InferenceEngine, argparse.Namespace]:
    args = parse_args(["--mock-data", "--use-checkpoint-args", "--load", load], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    load_weights(args, model, load, **QUIET)
    return InferenceEngine(model[0]), args


def weight_read_floor(engine: InferenceEngine, repeats: int = 30) -> tuple[float, dict[str, float]]:
    """(MB read, {kind: median ms}) of one decode step's matrix products alone: "engine", as one-row products
    through the engine's own kernel choice (`platform.linear`: oneDNN or torch's BLAS, whichever the engine
    measured faster on this CPU), the floor its decode step is measured against; "F.linear", through torch's BLAS
    (MKL on x86, what `transformers` uses); "read", one `sum` per matrix, reading the same bytes without
    multiplying. Each repeat reads other routed experts (`decode_weights(rotation)`), as decode steps routed
    elsewhere do: re-reading the same few would time them from the CPU's cache, faster than a step reads them."""
    import torch.nn.functional as F

    from megatron_ext import platform

    kinds = {"engine": lambda x, w: platform.linear(x, w), "F.linear": F.linear, "read": lambda x, w: w.sum()}
    # each kind of each repeat has experts of its own: the kind after another would find them in the cache
    steps = [[w.detach() for w in engine.decode_weights(r)] for r in range((repeats + 3) * len(kinds))]
    rows = [torch.randn(1, w.size(1), dtype=w.dtype, device=w.device) for w in steps[0]]
    sync = torch.cuda.synchronize if rows[0].is_cuda else (lambda: None)  # a GPU's products are asynchronous
    times = {kind: [] for kind in kinds}
    # as the engine's forwards, outside the CPU bridge's device mapping (its dispatch costs ~10 us per torch call)
    with torch.inference_mode(), platform.without_device_mapping():
        for r in range(repeats + 3):
            for k, (kind, product) in enumerate(kinds.items()):  # interleaved, so that load hits each kind alike
                weights = steps[r * len(kinds) + k]
                sync()
                t = time.perf_counter()
                for x, w in zip(rows, weights):
                    product(x, w)
                sync()
                times[kind].append(time.perf_counter() - t)
    mb = sum(w.numel() * w.element_size() for w in steps[0]) / 1e6
    return mb, {kind: statistics.median(ts[3:]) * 1e3 for kind, ts in times.items()}


def floor_words(mb: float, ms: dict[str, float]) -> str:
    return (f"weight-read floor {mb:.1f} MB: {ms['engine']:.2f} ms per token as the engine's one-row products "
            f"({mb / ms['engine']:.1f} GB/s), {ms['F.linear']:.2f} ms as F.linear (torch's BLAS, "
            f"{mb / ms['F.linear']:.1f} GB/s), {ms['read']:.2f} ms to read the bytes alone (sum, "
            f"{mb / ms['read']:.1f} GB/s)")


def random_deepseek(opts, workdir: str):
    """A random DeepSeek-V3-shaped transformers model and our engine on the same weights (imported)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    hidden = opts.hidden
    cfg = DeepseekV3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden,
                           moe_intermediate_size=hidden // 2, num_hidden_layers=opts.layers,
                           num_attention_heads=hidden // 32, num_key_value_heads=hidden // 32, n_shared_experts=1,
                           n_routed_experts=opts.experts, num_experts_per_tok=4, n_group=1, topk_group=1,
                           kv_lora_rank=hidden // 4, q_lora_rank=hidden // 2, qk_rope_head_dim=16,
                           qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1,
                           max_position_embeddings=max(1024, opts.prompt_length + opts.tokens),
                           num_mtp_layers=0)
    hf = DeepseekV3ForCausalLM(cfg).eval()
    hf_dir, save = os.path.join(workdir, "hf"), os.path.join(workdir, "mg")
    hf.save_pretrained(hf_dir)
    import_hf(hf_dir, save, **QUIET)
    destroy()
    engine, _ = load_engine(save)
    return hf.to(engine.device), engine  # both on the engine's device (a GPU where there is one)


def product_table(engine: InferenceEngine, rows=(1, 8), repeats: int = 9) -> list[str]:
    """Per distinct weight shape of a decode step: microseconds per product of `rows` rows through F.linear
    (torch's BLAS) and through oneDNN's inner product (what `platform.linear` picks for big fp32 weights on an x86
    CPU). Each repeat multiplies by enough copies of the weight to total 96 MB, so that the weights come from
    memory as a decode step's do (their 82 MB outgrow a CPU's cache) rather than from a cache that one repeated
    weight would sit in; medians over interleaved repeats. Empty where oneDNN's op is missing."""
    import torch.nn.functional as F

    from megatron_ext import platform

    if engine.device.type != "cpu" or not platform._onednn_linear_available():
        return []
    onednn = torch.ops.mkldnn._linear_pointwise
    shapes = {}
    for w in engine.decode_weights():
        shapes.setdefault(tuple(w.shape), w.detach().float().contiguous())
    lines = ["| weight [out, in] | KiB | rows | F.linear us | oneDNN us | ratio | platform.linear picks |",
             "|---|---|---|---|---|---|---|"]
    with torch.inference_mode(), platform.without_device_mapping():
        for shape, w in sorted(shapes.items(), key=lambda kv: kv[1].numel()):
            copies = [w.clone() for _ in range(max(1, (96 << 20) // (w.numel() * 4)))]
            for n in rows:
                x = torch.randn(n, shape[1])
                kinds = {"F.linear": lambda c: F.linear(x, c), "oneDNN": lambda c: onednn(x, c, None, "none", [], "")}
                times = {k: [] for k in kinds}
                for _ in range(repeats + 2):
                    for k, product in kinds.items():
                        t = time.perf_counter()
                        for c in copies:
                            product(c)
                        times[k].append((time.perf_counter() - t) / len(copies) * 1e6)
                blas, dnn = (statistics.median(times[k][2:]) for k in kinds)
                pick = "oneDNN" if platform.onednn_linear(w) else "F.linear"
                lines.append(f"| {shape[0]} x {shape[1]} | {w.numel() * 4 / 1024:.0f} | {n} | {blas:.1f} | "
                             f"{dnn:.1f} | {blas / dnn:.2f}x | {pick} |")
    return lines


def floor_only(opts, workdir: str) -> str:
    _, engine = random_deepseek(opts, workdir)
    load = OtherLoad()
    mb, ms = weight_read_floor(engine)
    table = product_table(engine)
    busy = load.fraction()
    destroy()
    return (f"hidden {opts.hidden}, {opts.layers} layers, {opts.experts} experts top-4, {opts.threads} threads: "
            f"{floor_words(mb, ms)}; other processes used {busy:.0%} of the CPUs meanwhile"
            + ("\n\none product per weight shape (median us per call):\n" + "\n".join(table) if table else ""))


def op_counts(engine: InferenceEngine, prompts: list[list[int]], tokens: int) -> tuple[float, collections.Counter]:
    """(ops per decode step, Counter of op name -> per step): the torch ops the host issues, counted at the top
    level (an op another op calls is not counted again) by the profiler, for `tokens` greedy tokens of each of
    `prompts` (one batch) minus the prompts' forward and first token, after a warm-up generation."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    engine.generate(prompts, params)  # one-time set-up (tables, views)

    def count(n: int) -> collections.Counter:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, dataclasses.replace(params, max_tokens=n))
        return collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)

    one, many = count(1), count(tokens)
    per_step = collections.Counter({k: (many[k] - one[k]) / (tokens - 1) for k in many if many[k] > one[k]})
    return sum(per_step.values()), per_step


def forward_op_count(engine: InferenceEngine, new: int, context: int = 32) -> int:
    """Top-level torch ops of one batch-1 forward of `new` tokens after `context` cached ones (a plain decode step
    for 1, a speculative verify of the newest token and its drafts for 1 + D), logits included."""
    from torch.profiler import ProfilerActivity, profile

    ids = (torch.arange(context + new, device=engine.device) * 7919 % engine.vocab_size).unsqueeze(0)
    cache = engine.new_cache(len(engine.layers), 1, context + new)

    def positions(start, count):
        return torch.arange(start, start + count, device=engine.device).unsqueeze(0)

    def at(n):
        return torch.full((1,), n, dtype=torch.long, device=engine.device)

    with torch.inference_mode(), engine.generating():
        engine.hidden(ids[:, :context], positions(0, context), cache, at(0), host_lengths=[0])
        run = lambda: engine.logits(engine.hidden(ids[:, context:], positions(context, new), cache,  # noqa: E731
                                                  at(context), host_lengths=[context]))
        run()  # one-time set-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    return sum(1 for e in prof.events() if e.cpu_parent is None)


OPS_BATCHES = (1, 8)


def ops_only(opts, workdir: str) -> str:
    _, engine = random_deepseek(opts, workdir)
    g = torch.Generator().manual_seed(1)
    lines = []
    for batch in OPS_BATCHES:
        prompts = [torch.randint(0, 8192, (opts.prompt_length,), generator=g).tolist() for _ in range(batch)]
        total, per_step = op_counts(engine, prompts, opts.tokens)
        top = ", ".join(f"{name.removeprefix('aten::')} {n:.1f}" for name, n in per_step.most_common(12))
        lines.append(f"batch {batch}: {total:.1f} top-level torch ops per decode step; most frequent: {top}")
    step, verify = forward_op_count(engine, 1), forward_op_count(engine, 2)
    lines.append(f"batch 1 after 32 cached tokens: a forward of 1 token {step} ops, a verify of 1 + 1 tokens "
                 f"{verify} ops ({verify / step:.2f} steps)")
    destroy()
    return (f"(a)'s model (hidden {opts.hidden}, {opts.layers} layers, {opts.experts} experts top-4), ours, prompt "
            f"{opts.prompt_length}, {opts.tokens} new tokens:\n  " + "\n  ".join(lines))


def versus_transformers(opts, workdir: str) -> tuple[str, Figure]:
    hf, engine = random_deepseek(opts, workdir)
    hidden = opts.hidden
    prompt = torch.randint(0, 8192, (opts.prompt_length,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = torch.tensor([prompt], device=engine.device)

    def ours(tokens: int):
        return engine.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0))[0].token_ids

    def theirs(tokens: int):
        return hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                           use_cache=True)[0, len(prompt):].tolist()

    n = opts.tokens
    load = OtherLoad()
    ours_s, theirs_s = alternate(lambda: ours(n), lambda: theirs(n), opts.repeats)
    # the prompt's forward and the first token alone, to separate decoding from prefill
    ours_1, theirs_1 = alternate(lambda: ours(1), lambda: theirs(1), opts.repeats)
    busy = load.fraction()
    same = ours(n) == theirs(n)
    floor_mb, floor_ms = weight_read_floor(engine)
    destroy()
    median, lo, hi = ratio_summary(ours_s, theirs_s)
    med = statistics.median
    ours_decode = (n - 1) / (med(ours_s) - med(ours_1))
    theirs_decode = (n - 1) / (med(theirs_s) - med(theirs_1))
    return (f"(a) greedy, hidden {hidden}, {opts.layers} layers, {opts.experts} experts top-4, batch 1, prompt "
            f"{opts.prompt_length}, {n} new tokens, {opts.threads} threads: end to end ours {n / med(ours_s):.1f} "
            f"tok/s, transformers generate {n / med(theirs_s):.1f} tok/s -> {median:.2f}x (paired runs "
            f"{lo:.2f}-{hi:.2f}); decoding alone (minus the prompt's forward) ours {ours_decode:.1f}, transformers "
            f"{theirs_decode:.1f} tok/s -> {ours_decode / theirs_decode:.2f}x (goal >= 2); prompt forward ours "
            f"{med(ours_1) * 1e3:.0f} ms, transformers {med(theirs_1) * 1e3:.0f} ms; same tokens: {same}; "
            f"ours decoding {1e3 / ours_decode:.2f} ms per token, {floor_ms['engine'] * ours_decode / 1e3:.0%} of "
            f"the {floor_words(floor_mb, floor_ms)}; other processes used {busy:.0%} of the CPUs meanwhile",
            Figure("a", median, lo, hi))


def checkpoint_tokenizer(load: str, tokenizer_model, tokenizer_type):
    """The tokenizer named on the command line, else the one the checkpoint's training run used."""
    from megatron.core import dist_checkpointing

    from megatron_ext.data.tokenizers import build_tokenizer

    if tokenizer_model is None:
        saved = dist_checkpointing.load_common_state_dict(checkpoint_dir(load, read_tracker(load)))["args"]
        tokenizer_model, tokenizer_type = saved.get("tokenizer_model"), saved.get("tokenizer_type")
        if not tokenizer_model or not os.path.exists(tokenizer_model):
            raise SystemExit(f"--prompts-from needs the tokenizer {load} was trained with; it recorded "
                             f"{tokenizer_model!r}: pass --tokenizer-model PATH")
    return build_tokenizer(tokenizer_type, tokenizer_model)


def file_prompts(path: str, tokenizer, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, each starting at a line start, spread evenly over the file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines(keepends=True)
    starts = [i * max(len(lines) - 1, 1) // max(count, 1) for i in range(count)]
    prompts = []
    for start in starts:
        ids = []
        end = start
        while len(ids) < length and end < len(lines):
            end = min(len(lines), end + 50)
            ids = tokenizer.encode("".join(lines[start:end]))
        if len(ids) < length:
            continue
        if max(ids) >= vocab_size:
            raise SystemExit(f"the tokenizer produced id {max(ids)}, outside the model's vocabulary ({vocab_size})")
        prompts.append(ids[:length])
    if not prompts:
        raise SystemExit(f"{path} is too short for prompts of {length} tokens")
    return prompts


def stand_in_lr(opts) -> float:
    """--train-lr, else 1e-2 for the preset's 4 layers and 3e-3 for a deeper stand-in: at 1e-2 a 16-layer one
    averaged lm loss 3.43 over its 1000 iterations and its MTP accepted 0.19 of its drafts; at 3e-3 1.55 and 0.64
    (the 4-layer one at 1e-2: 1.41 and 0.56; docs/benchmarks.md)."""
    if opts.train_lr is not None:
        return opts.train_lr
    return 3e-3 if opts.num_layers and opts.num_layers > 4 else 1e-2


def stand_in_seq_length(opts) -> int:
    """The stand-in's training sequence length: the smallest power of two, at least the tiny preset's 64, that
    holds a prompt and its new tokens. Decoding past the trained positions measures extrapolation, not
    speculation: a 16-layer stand-in trained at 64 accepted all drafts below position 64 and 0.42 past 80, where
    the main model itself left the progression (docs/benchmarks.md)."""
    need = opts.prompt_length + opts.tokens
    seq = 64
    while seq < need:
        seq *= 2
    return seq


def stand_in_global_batch(seq: int) -> int:
    """1024 tokens a step (16 sequences of 64, 8 of 128), at least one micro-batch of 8 sequences."""
    return max(8, 16 * 64 // seq)


def trained_stand_in(opts, workdir: str) -> str:
    """Train the stand-in (in `workdir`, or in --save to keep it); its checkpoint directory."""
    save = opts.save or os.path.join(workdir, "trained")
    if opts.save and os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt")):
        raise SystemExit(f"--save {save} already holds a checkpoint: measure it with --load {save}, or name "
                         "another directory")
    layers = ["--num-layers", str(opts.num_layers)] if opts.num_layers else []
    if opts.mtp_num_layers is not None:
        layers += ["--mtp-num-layers", str(opts.mtp_num_layers)]
    lr = stand_in_lr(opts)
    seq = stand_in_seq_length(opts)
    assert entry.main(["--model", "tiny", "--mock-data", *layers, "--seq-length", str(seq), "--train-iters",
                       str(opts.train_iters), "--micro-batch-size", "8", "--global-batch-size",
                       str(stand_in_global_batch(seq)), "--lr", str(lr), "--lr-warmup-iters", "10", "--min-lr",
                       str(lr / 10), "--log-interval", str(max(1, opts.train_iters // 10)), "--save", save]) == 0
    destroy()
    return save


def speculative(opts, workdir: str) -> tuple[str, Figure]:
    load = opts.load or trained_stand_in(opts, workdir)
    engine, args = load_engine(load)
    if opts.prompts_from:
        tokenizer = checkpoint_tokenizer(load, opts.tokenizer_model, opts.tokenizer_type)
        prompts = file_prompts(opts.prompts_from, tokenizer, opts.num_prompts, opts.prompt_length, engine.vocab_size)
        source = f"{len(prompts)} prompts of {opts.prompt_length} tokens from {opts.prompts_from}"
    else:
        prompts = [mock_sample(10_000_000 + i, opts.prompt_length, args.vocab_size, args.seed).tolist()
                   for i in range(opts.num_prompts)]
        source = f"{len(prompts)} mock prompts of {opts.prompt_length} tokens"
    params = SamplingParams(max_tokens=opts.tokens, temperature=0.0)
    depth, policy = opts.draft_depth, opts.speculation
    stats = SpeculationStats()
    busy = OtherLoad()
    if opts.batched:  # the prompts decoded together: the server's and RL's path
        def plain():
            return [group[0].token_ids for group in engine.generate_groups(prompts, 1, params)]

        def spec():
            return [group[0].token_ids for group in generate_speculative_groups(engine, prompts, 1, params, stats,
                                                                                 depth, policy=policy)]
    else:
        def plain():
            return [engine.generate([p], params)[0].token_ids for p in prompts]

        def spec():
            return [generate_speculative(engine, p, params, stats, depth, policy=policy).token_ids for p in prompts]
    plain_s, spec_s = alternate(plain, spec, opts.repeats)
    busy = busy.fraction()
    lossless = spec() == plain()
    decision = ("; " + describe_plan(stats.plan, draft_depth(engine, depth))) if stats.plan is not None else ""
    destroy()
    median, lo, hi = ratio_summary(spec_s, plain_s)
    tokens = opts.tokens * len(prompts)
    by_depth = ", ".join(f"{a / max(c, 1):.3f}" for a, c in zip(stats.accepted_by_depth, stats.checked_by_depth))
    layers = f", {opts.num_layers} layers" if opts.num_layers else ""
    layers += f", {opts.mtp_num_layers} MTP layers" if opts.mtp_num_layers is not None else ""
    model = (f"{load}" if opts.load else f"tiny preset{layers} trained {opts.train_iters} iterations on mock data "
             f"here at lr {stand_in_lr(opts):g}, sequence length {args.seq_length}")
    past = opts.prompt_length + opts.tokens - args.seq_length
    beyond = (f"; WARNING: decoding runs {past} positions past the {args.seq_length} the model was trained on, "
              "where its acceptance measures extrapolation" if past > 0 else "")
    together = ", decoded together (batched path)" if opts.batched else ", one at a time"
    return (f"(b) MTP speculative vs plain greedy ({model}; {source}{together}; {opts.tokens} new tokens each; "
            f"{len(engine.mtp_layers)} MTP layer(s), drafting {depth or len(engine.mtp_layers)}; {opts.threads} "
            f"threads): plain {tokens / statistics.median(plain_s):.1f} tok/s, speculative "
            f"{tokens / statistics.median(spec_s):.1f} tok/s -> {median:.2f}x (paired runs {lo:.2f}-{hi:.2f}; goal "
            f">= 1.8), acceptance {stats.acceptance_rate:.3f} (by draft position: {by_depth}; goal >= 0.85), "
            f"{stats.tokens_per_forward:.2f} tokens per main forward, lossless: {lossless}; other processes used "
            f"{busy:.0%} of the CPUs meanwhile{decision}{beyond}", Figure("b", median, lo, hi))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["a", "b", "floor", "ops"], default=None,
                   help="run one of the two measurements, or only (a)'s weight-read floor, or count the torch ops "
                        "our decode step issues on (a)'s model (independent of the machine's load)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each side after a warm-up")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--prompt-length", type=int, default=32, help="tokens per prompt")
    g = p.add_argument_group("(a) against transformers")
    g.add_argument("--hidden", type=int, default=512, help="model width")
    g.add_argument("--layers", type=int, default=6, help="decoder layers")
    g.add_argument("--experts", type=int, default=32, help="routed experts")
    g = p.add_argument_group("(b) speculative decoding")
    g.add_argument("--load", default=None, help="checkpoint directory saved by pretrain_composer.py (with MTP "
                                                "layers); default: train a stand-in here")
    g.add_argument("--prompts-from", default=None, help="text or code file to cut prompts from (needs a tokenizer)")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer for --prompts-from (default: the checkpoint's)")
    g.add_argument("--tokenizer-type", default=None, help="its format (default: inferred)")
    g.add_argument("--num-prompts", type=int, default=4, help="prompts per timed run")
    g.add_argument("--draft-depth", type=int, default=None, help="MTP layers drafting (default: all)")
    g.add_argument("--train-iters", type=int, default=1000, help="training of the stand-in model")
    g.add_argument("--train-lr", type=float, default=None, help="peak learning rate of the stand-in (decays to a "
                                                                 "tenth; default: 1e-2, 3e-3 above 4 layers)")
    g.add_argument("--num-layers", type=int, default=None, help="decoder layers of the stand-in (default: the "
                                                                "tiny preset's 4)")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="MTP layers of the stand-in, each drafting "
                                                                    "one more token a round (default: the tiny "
                                                                    "preset's 1)")
    g.add_argument("--save", default=None, help="keep the trained stand-in in this directory (measure it again "
                                                "with --load DIR; default: a temporary directory)")
    g.add_argument("--batched", action="store_true",
                   help="decode the --num-prompts prompts together (engine.generate_groups against "
                        "generate_speculative_groups: the server's and RL's path, whose step-aside decision is "
                        "measured per batch bucket); default: one at a time (generate_speculative)")
    g.add_argument("--speculation", choices=["auto", "always"], default="auto",
                   help="auto: decode plainly where drafting is not expected to pay; always: draft")
    p.add_argument("--check", action="store_true", help="compare the ratios with the last ones recorded for the "
                                                        "same options in --docs; exit 1 if one fell")
    p.add_argument("--docs", default=DOCS, help="where the recorded figures are (default: docs/benchmarks.md)")
    return p


def main(argv=None):
    opts = parser().parse_args(argv)
    if opts.check and opts.only in ("floor", "ops"):
        raise SystemExit(f"--check compares the ratios of (a) and (b); --only {opts.only} has none")
    if opts.load and (opts.save or opts.mtp_num_layers is not None or opts.num_layers):
        raise SystemExit("--save, --mtp-num-layers and --num-layers shape the stand-in trained here; with --load "
                         "the checkpoint is measured as it is")
    if opts.mtp_num_layers is not None and opts.mtp_num_layers < 1:
        raise SystemExit(f"--mtp-num-layers {opts.mtp_num_layers}: speculation needs at least one MTP layer")
    if opts.check and not os.path.isfile(opts.docs):
        raise SystemExit(f"--check: {opts.docs} does not exist")
    torch.set_num_threads(opts.threads)
    workdir = tempfile.mkdtemp(prefix="decode_bench_")
    figures = []
    try:
        if opts.only == "floor":
            print(floor_only(opts, workdir), flush=True)
        if opts.only == "ops":
            print(ops_only(opts, workdir), flush=True)
        for kind, run in (("a", versus_transformers), ("b", speculative)):
            if opts.only in (None, kind):
                line, figure = run(opts, workdir)
                print(line, flush=True)
                figures.append(figure)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if opts.check:
        with open(opts.docs, encoding="utf-8") as f:
            lines, fell = compare(figures, {k: v for k, v in vars(opts).items() if k not in _NOT_COMPARED}, f.read())
        print("\n".join(lines), flush=True)
        if fell:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
