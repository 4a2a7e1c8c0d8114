"""Training a byte-level BPE tokenizer on a corpus, written in both formats data/tokenizers.py reads.

The tokenizer pre-tokenises with Kimi's regex and keeps Kimi's layout: base vocabulary first, special tokens
(document, chat-turn, tool-call and reasoning markers) right after it, roles named in tokenizer_config.json. So the
tiny demo model sees the same kind of token stream as Kimi K2.5, and the same directory loads as ``HFTokenizer``
(tokenizer.json) and, with --tiktoken, as ``TikTokenizer`` (tiktoken.model) with identical special ids.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Iterable, Sequence

from megatron_ext import atomic
from megatron_ext.data.tokenizers import CHAT_SPECIAL_TOKENS, KIMI_PATTERN, ROLE_DEFAULTS


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              special_tokens: Sequence[str] = CHAT_SPECIAL_TOKENS, pattern: str = KIMI_PATTERN):
    """A `tokenizers.Tokenizer` with at most `vocab_size` ids, the special tokens included (a small corpus may
    run out of merges before that)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    base = vocab_size - len(special_tokens)
    if base < 256 + 1:
        raise ValueError(f"--vocab-size {vocab_size} leaves no room for merges: 256 byte tokens and "
                         f"{len(special_tokens)} special tokens need at least {257 + len(special_tokens)}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=base, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    # Added after training so that they follow the base vocabulary, as Kimi's do.
    tok.add_special_tokens(list(special_tokens))
    return tok


def save(tok, out_dir: str, tiktoken: bool = False, roles: dict | None = None) -> dict:
    """Write tokenizer.json and tokenizer_config.json (and tiktoken.model); returns the config written.

    The files are staged and moved into `out_dir` together once all are written; other files there stay."""
    staging = atomic.staging_dir(out_dir)
    try:
        config = _write(tok, staging, tiktoken, roles)
        atomic.publish_dir(staging, out_dir)
    except BaseException:
        atomic.remove_staging(staging)
        raise
    return config


def _write(tok, out_dir: str, tiktoken: bool, roles: dict | None) -> dict:
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = tok.get_added_tokens_decoder()
    first_special = min(added) if added else tok.get_vocab_size()
    config = {
        "tokenizer_class": "TikTokenTokenizer" if tiktoken else "PreTrainedTokenizerFast",
        **(roles or ROLE_DEFAULTS),
        "added_tokens_decoder": {str(i): {"content": t.content, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, t in sorted(added.items())},
        # Kimi reserves 256 ids after the base vocabulary; a small vocabulary reserves only what it uses.
        "num_reserved_special_tokens": len(added),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    if tiktoken:
        write_tiktoken_ranks(tok, os.path.join(out_dir, "tiktoken.model"), first_special)
    return config


def write_tiktoken_ranks(tok, path: str, num_base: int):
    """The base vocabulary as tiktoken ranks: token id = rank, bytes recovered from the byte-level alphabet.

    The BPE trainer numbers merged tokens in merge order, which is the priority tiktoken gives lower ranks.
    """
    to_byte = {ch: b for b, ch in byte_level_alphabet().items()}
    vocab = tok.get_vocab(with_added_tokens=False)
    by_id = sorted((i, t) for t, i in vocab.items() if i < num_base)
    if [i for i, _ in by_id] != list(range(num_base)):
        raise ValueError("the base vocabulary is not numbered 0..N-1; cannot write tiktoken ranks")
    with open(path, "w", encoding="ascii") as f:
        for i, token in by_id:
            raw = bytes(to_byte[ch] for ch in token)
            f.write(f"{base64.b64encode(raw).decode('ascii')} {i}\n")


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level mapping: printable Latin-1 bytes stand for themselves, the other 68 bytes are shifted
    to code points from 256 up so that every byte has a visible, whitespace-free character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping
