"""Sentence splitting with nltk's Punkt, trained on the corpus being split.

nltk's pretrained Punkt tables are a separate download that offline machines do not have, and for code and
technical text a model learned from the text itself knows its abbreviations better anyway. Training is
unsupervised and takes about a second per MB; the learned parameters are cached as JSON (no pickle) next to the
output and reused while the training sample is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from typing import Iterable

from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer, PunktTrainer

DEFAULT_SAMPLE_CHARS = 1_000_000


def sample_text(texts: Iterable[str], max_chars: int = DEFAULT_SAMPLE_CHARS) -> str:
    """The first `max_chars` characters of the corpus, documents separated by blank lines."""
    parts, total = [], 0
    for text in texts:
        parts.append(text[:max_chars - total])
        total += len(parts[-1]) + 2
        if total >= max_chars:
            break
    return "\n\n".join(parts)


def train(text: str) -> PunktParameters:
    trainer = PunktTrainer()
    trainer.train(text, finalize=True)
    return trainer.get_params()


def params_to_json(params: PunktParameters) -> dict:
    return {
        "abbrev_types": sorted(params.abbrev_types),
        "collocations": sorted([list(c) for c in params.collocations]),
        "sent_starters": sorted(params.sent_starters),
        "ortho_context": dict(sorted(params.ortho_context.items())),
    }


def params_from_json(data: dict) -> PunktParameters:
    params = PunktParameters()
    params.abbrev_types = set(data["abbrev_types"])
    params.collocations = {tuple(c) for c in data["collocations"]}
    params.sent_starters = set(data["sent_starters"])
    params.ortho_context = defaultdict(int, data["ortho_context"])
    return params


def load_or_train(cache_path: str, sample: str) -> tuple[PunktParameters, bool]:
    """Parameters for `sample`, from the cache when it was trained on the same sample. Returns (params, trained)."""
    fingerprint = hashlib.sha256(sample.encode("utf-8", "surrogatepass")).hexdigest()
    if os.path.isfile(cache_path):
        try:
            with open(cache_path, encoding="utf-8") as f:
                cached = json.load(f)
            if cached.get("sample_sha256") == fingerprint:
                return params_from_json(cached["params"]), False
        except (OSError, ValueError, KeyError):
            pass  # unreadable or stale cache: train again and overwrite it
    params = train(sample)
    tmp = cache_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"sample_sha256": fingerprint, "sample_chars": len(sample), "params": params_to_json(params)}, f)
    os.replace(tmp, cache_path)
    return params, True


def splitter(params: PunktParameters) -> PunktSentenceTokenizer:
    return PunktSentenceTokenizer(params)


def split_sentences(tokenizer: PunktSentenceTokenizer, text: str) -> list[str]:
    """Contiguous pieces that concatenate back to `text` exactly: each sentence keeps the whitespace after it,
    so code layout survives and documents can be reassembled from their sentences."""
    starts = [start for start, _ in tokenizer.span_tokenize(text)]
    if not starts:
        return [text] if text else []
    starts[0] = 0
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]
