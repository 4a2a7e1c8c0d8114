r"""Codebase negative log-likelihood: how well a model predicts a repository's source files.

    python tools/run_eval.py nll --load CKPT --tokenizer-model TOK --repo DIR [--out nll.json] [--bf16]
    python tools/run_eval.py nll --hf-dir HF_MODEL --repo DIR [--include '*.py,*.rs'] [--stride 2048]
    torchrun --nproc-per-node 8 tools/run_eval.py nll --load CKPT --tokenizer-model TOK --repo DIR \
        --tensor-model-parallel-size 8     # every rank scores the same windows on its shard; rank 0 writes

(`python -m megatron_ext.eval.nll ...` takes the same flags.) The report picks its base model by this figure.

Each file is one document: its UTF-8 text encoded with the tokenizer, after one boundary token (the tokenizer's
BOS, else its end-of-document id) that is context only. Every token of the file is then scored exactly once,
with a rolling window: with context length L (default the model's: the checkpoint's --seq-length, or an HF
config's max_position_embeddings) and stride S (default L // 2), window k holds sequence positions
[k*S, k*S + L); the first window scores every target in it, each later window only the targets after the
previous window's end (the last S of its positions). So a token at sequence position t (the boundary token is
position 0) is predicted from all t tokens before it when t < L, and from between L - S and L - 1 tokens
before it otherwise. S = L - 1 is the cheapest (L / (L - 1) forwards per token, little context at window
starts); smaller strides cost about L / S forwards per token and give every token at least L - S of context.

Log-probabilities are log-softmax over the tokenizer's ids in fp32 (the embedding's padding rows are not part
of the distribution). Figures per file and in total: summed NLL (nats), NLL per token, bits per token and bits
per UTF-8 byte (summed NLL / ln 2 / bytes: comparable across tokenizers). Files that are not UTF-8, empty or
excluded are listed as skipped with the reason.

Our checkpoints run through the inference engine (megatron_ext/inference/engine.py: the model's own weights,
TP/EP shards, prefill in chunks of --nll-chunk tokens over a latent cache, logits only where scored); Hugging
Face models through transformers' AutoModelForCausalLM.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

DEFAULT_INCLUDE = ("*.py", "*.pyi", "*.c", "*.h", "*.cc", "*.cpp", "*.hpp", "*.cu", "*.rs", "*.go", "*.java",
                   "*.kt", "*.scala", "*.js", "*.jsx", "*.ts", "*.tsx", "*.rb", "*.php", "*.swift", "*.cs",
                   "*.sh", "*.lua", "*.sql")
SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist", "venv"}


class NLLError(ValueError):
    """Unusable input; the message names the flag or file and the fix."""


# ---------------------------------------------------------------------------------------------------------
# the rolling window
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    start: int   # first sequence position the forward sees
    end: int     # one past the last
    first: int   # first target position scored here; targets first..end-1, predicted from positions first-1..end-2


def windows(n: int, context: int, stride: int) -> list[Window]:
    """The windows that score targets 1..n-1 of an n-token sequence once each (see the module docstring)."""
    if context < 2:
        raise NLLError(f"--context-length {context}: a window needs at least 2 tokens")
    if not 1 <= stride <= context - 1:
        raise NLLError(f"--stride {stride} must be between 1 and context length - 1 = {context - 1}: the first "
                       "token of a window has no context inside it, so windows must overlap")
    out, scored, start = [], 1, 0
    while scored < n:
        end = min(start + context, n)
        out.append(Window(start, end, scored))
        scored, start = end, start + stride
    return out


def score_sequence(ids: Sequence[int], context: int, stride: int,
                   window_logprobs: Callable[[list[int], int], torch.Tensor]) -> torch.Tensor:
    """Per-target log-probabilities [len(ids) - 1] (float64) of ids[1:], one window at a time.
    `window_logprobs(window_ids, k)` returns the log-probabilities of window_ids[k:] (targets) given what precedes
    each inside the window."""
    parts = []
    for w in windows(len(ids), context, stride):
        lp = window_logprobs(list(ids[w.start: w.end]), w.first - w.start)
        if lp.shape != (w.end - w.first,):
            raise RuntimeError(f"scorer returned {tuple(lp.shape)} log-probabilities for {w.end - w.first} targets")
        parts.append(lp.double().cpu())
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(target) under log-softmax over the first vocab_size logits, in fp32; logits [s, V], targets [s]."""
    logp = F.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    return logp.gather(-1, targets.view(-1, 1)).view(-1)


# ---------------------------------------------------------------------------------------------------------
# scorers: our checkpoint (inference engine) and a Hugging Face model (transformers)
# ---------------------------------------------------------------------------------------------------------

class EngineScorer:
    """Windows through the inference engine: prefill in chunks over a latent cache, logits only for the rows
    whose next token is scored (at most `chunk` rows of logits at a time)."""

    def __init__(self, engine, vocab_size: int, chunk: int):
        self.engine, self.vocab_size, self.chunk = engine, vocab_size, chunk

    @torch.inference_mode()
    def __call__(self, ids: list[int], first: int) -> torch.Tensor:
        engine, n = self.engine, len(ids)
        device = engine.device
        tokens = torch.tensor([ids], device=device)
        cache = engine.new_cache(len(engine.layers), 1, n)
        out = []
        for a in range(0, n - 1, self.chunk):  # the last position predicts nothing in this window
            b = min(a + self.chunk, n - 1)
            hidden = engine.hidden(tokens[:, a:b], torch.arange(a, b, device=device).unsqueeze(0), cache,
                                   torch.tensor([a], device=device))
            lo = max(a, first - 1)  # rows lo..b-1 predict targets lo+1..b
            if lo < b:
                logits = engine.logits(hidden[lo - a:])[0]
                out.append(target_logprobs(logits, tokens[0, lo + 1: b + 1], self.vocab_size))
        return torch.cat(out)


class HFScorer:
    """Windows through a transformers causal LM; logits are computed only for the scored rows
    (`logits_to_keep`) where the model supports it."""

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def __call__(self, ids: list[int], first: int) -> torch.Tensor:
        tokens = torch.tensor([ids], device=self.device)
        keep = len(ids) - first + 1  # rows first-1 .. n-1; the last is dropped
        try:
            logits = self.model(input_ids=tokens, logits_to_keep=keep, use_cache=False).logits[0]
        except TypeError:  # models without logits_to_keep
            logits = self.model(input_ids=tokens, use_cache=False).logits[0]
        logits = logits[-keep:]  # also right when a model takes logits_to_keep in **kwargs and ignores it
        return target_logprobs(logits[:-1], tokens[0, first:], self.vocab_size)


# ---------------------------------------------------------------------------------------------------------
# files and figures
# ---------------------------------------------------------------------------------------------------------

def _globs(values: Optional[list[str]], default: Sequence[str]) -> list[str]:
    if not values:
        return list(default)
    return [g.strip() for v in values for g in v.split(",") if g.strip()]


def _matches(rel: str, globs: list[str]) -> bool:
    """fnmatch on the relative path ('*' crosses folders) or on the file name."""
    return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(os.path.basename(rel), g) for g in globs)


def source_files(repo: str, include: list[str], exclude: list[str]) -> list[str]:
    """Relative paths of the files to score, sorted; hidden folders and build/vendor folders are not entered."""
    out = []
    for base, dirs, files in os.walk(repo):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(base, f), repo)
            if _matches(rel, include) and not _matches(rel, exclude) and os.path.isfile(os.path.join(base, f)):
                out.append(rel)
    return out


@dataclass
class Figures:
    nll_nats: float = 0.0
    tokens: int = 0    # scored tokens (the file's, not the boundary token)
    bytes: int = 0     # UTF-8 bytes

    def add(self, other: "Figures"):
        self.nll_nats += other.nll_nats
        self.tokens += other.tokens
        self.bytes += other.bytes

    def as_dict(self) -> dict:
        return {**asdict(self),
                "nll_per_token": self.nll_nats / self.tokens if self.tokens else None,
                "bits_per_token": self.nll_nats / self.tokens / math.log(2) if self.tokens else None,
                "bits_per_byte": self.nll_nats / self.bytes / math.log(2) if self.bytes else None}


@dataclass
class Result:
    files: dict[str, dict] = field(default_factory=dict)
    skipped: list[dict] = field(default_factory=list)
    total: Figures = field(default_factory=Figures)


def score_repo(repo: str, files: list[str], encode: Callable[[str], list[int]], prefix: int, context: int,
               stride: int, scorer, log: Callable[[str], None] = lambda m: None) -> Result:
    result = Result()
    started, done_tokens = time.monotonic(), 0
    for i, rel in enumerate(files, 1):
        try:
            with open(os.path.join(repo, rel), "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            result.skipped.append({"path": rel, "reason": "not UTF-8 text"})
            continue
        ids = encode(text)
        if not ids:
            result.skipped.append({"path": rel, "reason": "empty"})
            continue
        logprobs = score_sequence([prefix] + ids, context, stride, scorer)
        fig = Figures(float(-logprobs.sum()), len(ids), len(raw))
        result.files[rel] = fig.as_dict()
        result.total.add(fig)
        done_tokens += len(ids)
        elapsed = time.monotonic() - started
        log(f"[{i}/{len(files)}] {rel}: {len(ids)} tokens, {fig.as_dict()['nll_per_token']:.4f} nats/token, "
            f"{fig.as_dict()['bits_per_byte']:.4f} bits/byte | total {result.total.as_dict()['nll_per_token']:.4f} "
            f"nats/token, {done_tokens / max(elapsed, 1e-9):.0f} tokens/s")
    return result


# ---------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------

def _nll_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("codebase NLL")
    g.add_argument("--repo", required=True, help="the repository (a directory) whose source files are scored")
    g.add_argument("--hf-dir", default=None, help="score a Hugging Face model directory (transformers) instead of "
                                                   "--load CKPT")
    g.add_argument("--include", action="append", default=None,
                   help="comma-separated globs of files to score, on the path relative to --repo or the file name "
                        "('*' crosses folders); repeatable. Default: common source-code extensions")
    g.add_argument("--exclude", action="append", default=None, help="globs of files not to score (as --include)")
    g.add_argument("--context-length", type=int, default=None,
                   help="window length in tokens (default: the model's: --load: the checkpoint's --seq-length; "
                        "--hf-dir: config.max_position_embeddings)")
    g.add_argument("--stride", type=int, default=None,
                   help="tokens the window advances by (1 .. context - 1; default context // 2): every token past "
                        "the first window is predicted from at least context - stride tokens")
    g.add_argument("--nll-chunk", type=int, default=2048,
                   help="--load: tokens per prefill forward and rows of logits at a time (memory, not results)")
    g.add_argument("--out", default=None, help="write the figures here (JSON)")
    g.add_argument("--hf-dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="--hf-dir: weights dtype")
    g.add_argument("--device", default=None, help="--hf-dir: torch device (default cuda when available, else cpu)")
    g.add_argument("--quiet", action="store_true", help="no per-file progress lines")


def _hf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nll", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _nll_args(p)
    p.add_argument("--tokenizer-model", default=None,
                   help="tokenizer file or directory (default: the --hf-dir's own tokenizer files)")
    p.add_argument("--tokenizer-type", default=None, help="HFTokenizer | TikTokenizer (default: inferred)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the model code shipped in --hf-dir (e.g. Kimi K2.5's kimi_k25)")
    return p


def _tokenizer(kind: Optional[str], path: str):
    from megatron_ext.data.tokenizers import TokenizerError, build_tokenizer

    try:
        return build_tokenizer(kind, path)
    except TokenizerError as e:
        raise NLLError(f"--tokenizer-model {path}: {e}") from None


def _boundary(tok) -> int:
    return tok.bos if tok.bos is not None else tok.eod


def _stride(args, context: int) -> int:
    return args.stride if args.stride is not None else max(1, context // 2)


def _run_hf(args, log) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    files = _files(args)
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise NLLError(f"--hf-dir {args.hf_dir}: no config.json (not a Hugging Face model directory)")
    tok = _tokenizer(args.tokenizer_type, args.tokenizer_model or args.hf_dir)
    config = AutoConfig.from_pretrained(args.hf_dir, trust_remote_code=args.trust_remote_code)
    config = getattr(config, "text_config", None) or config
    context = args.context_length or getattr(config, "max_position_embeddings", None)
    if not context:
        raise NLLError(f"{args.hf_dir}/config.json has no max_position_embeddings: pass --context-length")
    windows(2, context, _stride(args, context))  # validates both before the model is loaded
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.hf_dtype]
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=dtype, trust_remote_code=args.trust_remote_code)
    model = model.to(device).eval()
    vocab = model.get_output_embeddings().weight.size(0)
    if tok.vocab_size > vocab:
        raise NLLError(f"the tokenizer has {tok.vocab_size} ids, the model's head {vocab}: they do not belong "
                       "together (--tokenizer-model)")
    log(f"scoring {len(files)} files of {args.repo} with {args.hf_dir} (context {context}, stride "
        f"{_stride(args, context)}, {device})")
    result = score_repo(args.repo, files, tok.encode, _boundary(tok), context, _stride(args, context),
                        HFScorer(model, tok.vocab_size), log)
    return _report(args, result, {"hf_dir": os.path.abspath(args.hf_dir)}, tok, context)


def _run_checkpoint(argv: list[str], log) -> dict:
    from megatron_ext.arguments import ArgumentError, parse_args
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.training.checkpointing import CheckpointError, load_checkpoint, read_tracker
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    extra = [] if "--use-checkpoint-args" in argv else ["--use-checkpoint-args"]
    try:
        args = parse_args(argv + extra + ["--mock-data"], description=__doc__, extra=(_nll_args,))
    except ArgumentError as e:
        raise NLLError(str(e)) from None
    if read_tracker(args.load) is None:
        raise NLLError(f"--load {args.load}: no checkpoint there (latest_checkpointed_iteration.txt missing)")
    if args.tokenizer_model is None:
        raise NLLError("--load needs --tokenizer-model PATH (the tokenizer the checkpoint was trained with)")
    files = _files(args)
    tok = _tokenizer(args.tokenizer_type, args.tokenizer_model)
    context = args.context_length or args.seq_length
    stride = _stride(args, context)
    windows(2, context, stride)  # validates both before the model is built
    if args.nll_chunk < 1:
        raise NLLError(f"--nll-chunk {args.nll_chunk} must be >= 1")
    args.finetune = True  # weights only
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)
        try:
            load_checkpoint(args, model, None, None, log=lambda *a, **k: None)
        except CheckpointError as e:
            raise NLLError(str(e)) from None
        model[0].eval()
        try:
            engine = InferenceEngine(model[0], vocab_size=tok.vocab_size)
        except ValueError as e:
            raise NLLError(f"--load {args.load}: {e}") from None
        log(f"scoring {len(files)} files of {args.repo} with {args.load} (context {context}, stride {stride}, "
            f"{engine.device}, {engine.dtype})")
        result = score_repo(args.repo, files, tok.encode, _boundary(tok), context, stride,
                            EngineScorer(engine, tok.vocab_size, args.nll_chunk), log)
    finally:
        destroy()
    return args, _report(args, result, {"load": os.path.abspath(args.load)}, tok, context)


def _files(args) -> list[str]:
    """The files to score (checked before any model is loaded)."""
    if not os.path.isdir(args.repo):
        raise NLLError(f"--repo {args.repo} is not a directory")
    args.include = _globs(args.include, DEFAULT_INCLUDE)
    args.exclude = _globs(args.exclude, ())
    files = source_files(args.repo, args.include, args.exclude)
    if not files:
        raise NLLError(f"--repo {args.repo}: no file matches --include {args.include} "
                       f"(--exclude {args.exclude})")
    return files


def _report(args, result: Result, model: dict, tok, context: int) -> dict:
    if not result.files:
        raise NLLError(f"--repo {args.repo}: every file was skipped: {result.skipped[:3]}")
    return {"model": model, "repo": os.path.abspath(args.repo),
            "tokenizer": os.path.abspath(args.tokenizer_model or args.hf_dir), "tokenizer_type": type(tok).__name__, "context_length": context, "stride": _stride(args, context),
            "boundary_token": _boundary(tok), "include": args.include, "exclude": args.exclude,
            "total": result.total.as_dict(), "files": result.files, "skipped": result.skipped}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet = "--quiet" in argv
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def log(message: str):
        if rank0 and not quiet:
            print(message, file=sys.stderr, flush=True)

    try:
        hf, load = (any(a == flag or a.startswith(flag + "=") for a in argv) for flag in ("--hf-dir", "--load"))
        if hf and load:
            raise NLLError("--load and --hf-dir exclude each other: score one model per run (compare the --out "
                           "files, same --repo, --context-length and --stride)")
        if hf:
            args = _hf_parser().parse_args(argv)
            report = _run_hf(args, log)
        elif load or {"-h", "--help"} & set(argv):
            args, report = _run_checkpoint(argv, log)
        else:
            raise NLLError("pass --load CKPT (our checkpoint, with --tokenizer-model) or --hf-dir DIR (a Hugging "
                           "Face model directory)")
    except NLLError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if rank0:
        total = report["total"]
        print(f"total: {total['tokens']} tokens, {total['bytes']} bytes, NLL {total['nll_nats']:.3f} nats, "
              f"{total['nll_per_token']:.5f} nats/token, {total['bits_per_byte']:.5f} bits/byte "
              f"({len(report['files'])} files, {len(report['skipped'])} skipped)")
        if args.out:
            from megatron_ext.atomic import atomic_output

            with atomic_output(args.out) as f:
                f.write(json.dumps(report, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
