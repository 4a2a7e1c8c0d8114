"""The data an entry script trains on, chosen by flags: mock tokens, indexed GPT datasets, or packed chat SFT.

Each source maps a global sample index to a sample, and data/batches.py decides which indices a rank takes in
an iteration; that split of concerns is what makes resume and resharding bit-exact for every kind of data.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional

from megatron.core import parallel_state

from megatron_ext.data.batches import microbatches
from megatron_ext.data.mock import mock_batch

VALIDATION_SEED_OFFSET = 1_000_000  # the mock validation stream: disjoint from training's


class DataSources:
    """Split name -> fetch(indices) -> micro-batch dict."""

    def __init__(self, train: Callable, validation: Optional[Callable] = None, test: Optional[Callable] = None):
        self.fetchers = {"train": train, "validation": validation, "test": test}

    def has(self, split: str) -> bool:
        return self.fetchers.get(split) is not None

    def microbatches(self, split: str, k: int, args: argparse.Namespace):
        """The micro-batches of the k-th global batch of `split` for this data-parallel rank."""
        return microbatches(self.fetchers[split], k, args.global_batch_size, args.micro_batch_size,
                            parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())


def mock_sources(args: argparse.Namespace) -> DataSources:
    def stream(seed):
        return lambda indices: mock_batch(indices, args.seq_length, args.vocab_size, seed)

    return DataSources(stream(args.seed), stream(args.seed + VALIDATION_SEED_OFFSET))


def build_data(args: argparse.Namespace, log=print) -> DataSources:
    """Build what the flags ask for; raises DataError/TokenizerError with a message naming file and fix."""
    if args.mock_data:
        return mock_sources(args)
    from megatron_ext.data.gpt import DatasetSource, build_gpt_datasets, parse_split
    from megatron_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    if args.sft:
        from megatron_ext.data.sft import build_chat_datasets

        datasets, report = build_chat_datasets(tokenizer, args.data_path[0], args.seq_length,
                                               parse_split(args.split), args.seed, packed=True,
                                               on_error=args.data_on_error,
                                               pad_multiple=2 * args.context_parallel_size
                                               if args.context_parallel_size > 1 else 1)
        if report["bad_lines"]:
            shown = ", ".join(f"line {n}: {why}" for n, why in report["bad_lines"][:5])
            log(f"data: skipped {len(report['bad_lines'])} malformed conversations ({shown})")
        if report["truncated"] or report["untrained"]:
            log(f"data: {report['truncated']} conversations truncated to --seq-length {args.seq_length} + 1, "
                f"{report['untrained']} dropped without assistant tokens")
        sources = datasets  # ChatDatasets fetch micro-batches themselves
    else:
        datasets = build_gpt_datasets(args, tokenizer)
        sources = [DatasetSource(d, name) if d is not None else None
                   for d, name in zip(datasets, ("train", "validation", "test"))]
    sizes = ", ".join(f"{name} {len(d):,}" for name, d in zip(("train", "validation", "test"), datasets)
                      if d is not None)
    log(f"data: {'chat SFT (packed) ' if args.sft else ''}{' '.join(args.data_path)} | split {args.split} | "
        f"samples of {args.seq_length} tokens: {sizes} | tokenizer {tokenizer}")
    return DataSources(*sources)
