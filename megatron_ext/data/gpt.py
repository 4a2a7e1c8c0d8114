"""Pretraining data: indexed datasets blended and split by Megatron-Core's `BlendedMegatronDatasetBuilder`.

`--data-path 0.7 a 0.3 b --split 98,1,1` means what it means in Megatron-LM: each prefix is cut into
train/validation/test by document ranges, and each split draws from the prefixes in proportion to the weights.
The datasets are built once (rank 0 writes the index cache, the others read it) and then addressed by global
sample index (data/batches.py), which keeps resume and resharding bit-exact.
"""

from __future__ import annotations

import argparse
import re
from typing import Optional, Sequence

import numpy as np
import torch

from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

from megatron_ext.data.indexed import INDEX_HEADER_BYTES, DataError, IndexSummary, verify_indexed_dataset

SPLITS = ("train", "validation", "test")


def parse_data_path(values: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron-LM's --data-path: prefixes only, or WEIGHT PREFIX pairs. Raises ValueError naming the problem."""
    values = list(values)
    if not values:
        raise ValueError("--data-path needs at least one dataset prefix")
    numeric = [_is_number(v) for v in values]
    if not any(numeric):
        return values, None
    if len(values) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise ValueError(f"--data-path {' '.join(values)}: give prefixes only ('a b') or WEIGHT PREFIX pairs "
                         "('0.7 a 0.3 b')")
    weights = [float(w) for w in values[0::2]]
    if any(w <= 0 for w in weights):
        raise ValueError(f"--data-path weights must be positive, got {weights}")
    return values[1::2], weights


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_split(split: str) -> list[float]:
    """'98,1,1' (or '98/1/1', '0.98 0.01 0.01') -> normalised [train, validation, test] shares."""
    parts = [p for p in re.split(r"[,/ ]+", split.strip()) if p]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to three numbers like 98,1,1") from None
    if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"--split {split!r}: expected one to three non-negative numbers (train, validation, "
                         "test) with a positive sum, like 98,1,1")
    shares += [0.0] * (3 - len(shares))
    return [s / sum(shares) for s in shares]


def split_ranges(num_sequences: int, shares: Sequence[float]) -> list[tuple[int, int]]:
    """The [begin, end) sequence range of each split, rounded as Megatron-Core's builder rounds them."""
    bounds = np.cumsum([0.0, *shares])
    return [(int(round(lo * num_sequences)), int(round(hi * num_sequences))) for lo, hi in zip(bounds, bounds[1:])]


_PROBE_TOKENS = 1 << 20


def check_token_range(summary: IndexSummary, vocab_size: int, probe: int = _PROBE_TOKENS):
    """The first and last `probe` tokens fit the vocabulary: data tokenised with another tokenizer is caught here,
    not as an embedding index error mid-run (a full scan would cost a pass over the whole dataset)."""
    tokens = np.memmap(get_bin_path(summary.prefix), mode="r", dtype=summary.dtype, shape=(summary.tokens,))
    for part in (tokens[:probe], tokens[-probe:]):
        top = int(part.max()) if len(part) else -1
        if top >= vocab_size:
            raise DataError(f"{get_bin_path(summary.prefix)} contains token id {top}, but --tokenizer-model has "
                            f"{vocab_size} ids; was it preprocessed with another tokenizer?")
    del tokens


def check_datasets(prefixes: Sequence[str], shares: Sequence[float], needed: Sequence[int],
                   vocab_size: Optional[int] = None) -> list[IndexSummary]:
    """Every prefix is intact, fits the vocabulary and leaves tokens in each split that will be sampled; raise
    DataError otherwise. Megatron-Core would otherwise loop forever looking for enough epochs of an empty split.
    """
    summaries = []
    for prefix in prefixes:
        summary = verify_indexed_dataset(prefix)
        if summary.tokens == 0:
            raise DataError(f"{prefix}: the dataset holds no tokens")
        if vocab_size is not None:
            check_token_range(summary, vocab_size)
        lengths = np.memmap(get_idx_path(prefix), mode="r", dtype=np.int32, offset=INDEX_HEADER_BYTES,
                            shape=(summary.sequences,))
        for name, share, count, (lo, hi) in zip(SPLITS, shares, needed, split_ranges(summary.sequences, shares)):
            if share <= 0 or not count:
                continue
            if hi <= lo:
                raise DataError(f"{prefix}: --split gives the {name} split {share:.2%} of {summary.sequences} "
                                f"sequences, which rounds to none; give it a larger share or use more data")
            if int(lengths[lo:hi].sum()) == 0:
                raise DataError(f"{prefix}: the {name} split (sequences {lo}..{hi - 1}) holds no tokens")
        del lengths
        summaries.append(summary)
    return summaries


def split_sizes(args: argparse.Namespace) -> list[int]:
    """Samples each split must provide: every training step, and the fixed validation/test batches."""
    eval_samples = args.eval_iters * args.global_batch_size
    return [args.train_iters * args.global_batch_size, eval_samples, eval_samples]


def build_gpt_datasets(args: argparse.Namespace, tokenizer) -> list:
    """[train, validation, test] Megatron datasets (None where --split gives a split no share). Every rank calls
    this: the builder synchronises ranks while rank 0 writes the index cache."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes, weights = parse_data_path(args.data_path)
    shares = parse_split(args.split)
    sizes = split_sizes(args)
    check_datasets(prefixes, shares, [s if share > 0 else 0 for s, share in zip(sizes, shares)], tokenizer.vocab_size)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=(prefixes, weights),
        split=",".join(f"{s:.12f}" for s in shares),  # the builder reads plain decimals
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


class DatasetSource:
    """Micro-batches by global sample index from a Megatron dataset; indices wrap around its length."""

    KEYS = ("tokens", "labels", "loss_mask", "position_ids")

    def __init__(self, dataset, name: str):
        if dataset is None or len(dataset) == 0:
            raise DataError(f"the {name} split is empty; give it a share in --split")
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)

    def __call__(self, indices) -> dict[str, torch.Tensor]:
        samples = [self.dataset[int(i) % len(self.dataset)] for i in indices]
        return {key: torch.stack([torch.as_tensor(s[key]) for s in samples]) for key in self.KEYS}
