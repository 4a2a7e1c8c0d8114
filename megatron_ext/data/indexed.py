"""Integrity of Megatron indexed datasets (.bin/.idx) before anything trains on them.

Megatron-Core's `IndexedDataset` trusts its files: a truncated .bin or an .idx written for another .bin shows
up as garbage tokens or an out-of-range read hours into a run. `verify_indexed_dataset` checks the whole layout
(header, counts, sizes, pointers, document boundaries) against both files in O(sequences), without reading
tokens, and names the file and the mismatch.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType, get_bin_path, get_idx_path


class DataError(ValueError):
    """Unusable input data; the message names the file (and line) and what is wrong."""


@dataclass(frozen=True)
class IndexSummary:
    prefix: str
    dtype: type
    sequences: int
    documents: int
    tokens: int


INDEX_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence and document counts


def verify_indexed_dataset(prefix: str) -> IndexSummary:
    idx_path, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"{path} does not exist (--data-path takes the prefix that tools/preprocess_data.py "
                            "printed, e.g. data/corpus_text_document)")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(INDEX_HEADER_BYTES)
    if len(head) < INDEX_HEADER_BYTES or head[:len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise DataError(f"{idx_path}: not a Megatron index (bad or truncated header)")
    offset = len(_INDEX_HEADER)
    version, = struct.unpack_from("<Q", head, offset)
    code, = struct.unpack_from("<B", head, offset + 8)
    sequences, documents = struct.unpack_from("<QQ", head, offset + 9)
    if version != 1:
        raise DataError(f"{idx_path}: index version {version}, only version 1 is known")
    try:
        dtype = DType.dtype_from_code(code)
    except (KeyError, ValueError):
        raise DataError(f"{idx_path}: unknown token dtype code {code}") from None
    expected = INDEX_HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if idx_size < expected:
        raise DataError(f"{idx_path} is truncated: its header announces {sequences} sequences and {documents - 1} "
                        f"documents ({expected} bytes) but the file has {idx_size} bytes")
    if idx_size not in (expected, expected + sequences):  # + one mode byte per sequence when multimodal
        raise DataError(f"{idx_path}: {idx_size} bytes where the header implies {expected}; the index is corrupt")
    mm = np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=sequences, offset=INDEX_HEADER_BYTES)
    pointers = np.frombuffer(mm, dtype=np.int64, count=sequences, offset=INDEX_HEADER_BYTES + 4 * sequences)
    doc_idx = np.frombuffer(mm, dtype=np.int64, count=documents, offset=INDEX_HEADER_BYTES + 12 * sequences)
    itemsize = DType.size(dtype)
    if sequences and (lengths < 0).any():
        raise DataError(f"{idx_path}: negative sequence lengths; the index is corrupt")
    ends = np.cumsum(lengths, dtype=np.int64) * itemsize
    if sequences and (pointers[0] != 0 or not np.array_equal(pointers[1:], ends[:-1])):
        raise DataError(f"{idx_path}: sequence pointers do not follow the sequence lengths; the index is corrupt")
    if documents == 0 or doc_idx[0] != 0 or doc_idx[-1] != sequences or (np.diff(doc_idx) < 0).any():
        raise DataError(f"{idx_path}: document boundaries are not 0..{sequences} in order; the index is corrupt")
    tokens = int(ends[-1] // itemsize) if sequences else 0
    bin_size = os.path.getsize(bin_path)
    if bin_size != tokens * itemsize:
        what = "truncated" if bin_size < tokens * itemsize else "longer than its index"
        raise DataError(f"{bin_path} is {what}: {idx_path} describes {tokens} tokens of {np.dtype(dtype).name} "
                        f"({tokens * itemsize} bytes) but the file has {bin_size} bytes; the two files do not "
                        "belong together or a write was interrupted (rerun tools/preprocess_data.py)")
    del mm
    return IndexSummary(prefix, dtype, sequences, documents - 1, tokens)
