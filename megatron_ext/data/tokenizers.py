"""One tokenizer interface over the two file formats this project meets.

* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` (what tools/train_tokenizer.py writes, and what most open
  models ship), run by the Rust ``tokenizers`` library.
* ``TikTokenizer``: a tiktoken BPE rank file as Kimi ships it: ``tiktoken.model`` (base64 token, rank per line)
  with the special tokens in ``tokenizer_config.json``'s ``added_tokens_decoder``, 256 reserved ids right after the
  base vocabulary (unnamed ones are ``<|reserved_token_ID|>``), and Kimi's pre-tokenisation regex.

Both implement Megatron-Core's tokenizer interface (``tokenize``/``detokenize``/``vocab_size``/``eod``/``pad``,
``unique_identifiers`` for the dataset cache), so `GPTDatasetConfig` takes them as they are. Text is always
encoded as text: a special token's spelling inside a document stays ordinary characters (only the chat renderer,
data/sft.py, inserts special ids), so corpus content can never forge a turn boundary.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import re
from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file and what is wrong."""


# Kimi's pre-tokeniser (tokenization_kimi.py): Han runs on their own, letters split at case changes with English
# contractions attached, digits in groups of at most three, punctuation runs, newline runs, trailing spaces.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
KIMI_NUM_RESERVED_SPECIAL_TOKENS = 256

# Kimi-style special tokens given to tokenizers trained here: document and chat-turn markers, tool calls,
# reasoning. Roles (bos/eos/pad/unk) are named in tokenizer_config.json as Kimi's is.
BOS, EOS, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"
CHAT_SPECIAL_TOKENS = (
    BOS, EOS, "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", UNK, PAD,
)
ROLE_DEFAULTS = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}

# When tokenizer_config.json names no eos token, these spellings (in order) end a document.
_EOD_CANDIDATES = (EOS, "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_PAD_CANDIDATES = (PAD, "<pad>", "<|pad|>", "<|finetune_right_pad_id|>")
_BOS_CANDIDATES = (BOS, "<s>", "<|begin_of_text|>", "<bos>")

TOKENIZER_TYPES = ("HFTokenizer", "TikTokenizer")
_TYPE_ALIASES = {"HuggingFaceTokenizer": "HFTokenizer"}  # Megatron-LM's name for the same thing


class Tokenizer(MegatronTokenizerBase):
    """The interface every consumer uses: encode/decode, document and padding ids, special ids, sizes."""

    kind = ""

    def __init__(self, path: str, model_file: str, special_tokens: dict[str, int], config: dict,
                 vocab_size: int):
        super().__init__(path, {})
        self.model_file = model_file
        self.special_tokens = dict(special_tokens)
        self._vocab_size = vocab_size
        self._roles = {role: self._role_id(config, role, candidates) for role, candidates in
                       (("eos_token", _EOD_CANDIDATES), ("pad_token", _PAD_CANDIDATES),
                        ("bos_token", _BOS_CANDIDATES), ("unk_token", (UNK, "<unk>")))}
        if self._roles["eos_token"] is None:
            raise TokenizerError(f"{model_file}: no end-of-document token; name one as eos_token in "
                                 f"tokenizer_config.json or add one of {list(_EOD_CANDIDATES)}")
        self.unique_identifiers = OrderedDict(
            [("class", type(self).__name__), ("tokenizer_path", [os.path.abspath(model_file)]),
             ("sha256", _sha256(model_file)), ("vocab_size", vocab_size)])

    def _role_id(self, config: dict, role: str, candidates: Sequence[str]) -> Optional[int]:
        named = config.get(role)
        if isinstance(named, dict):  # serialised AddedToken
            named = named.get("content")
        for content in ([named] if named else []) + list(candidates):
            if content in self.special_tokens:
                return self.special_tokens[content]
            if named and content == named:
                ids = self.encode_with_specials(content)
                if len(ids) == 1:
                    return ids[0]
        return None

    # ---- text <-> ids -------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def encode_with_specials(self, text: str) -> list[int]:
        """Encode where special-token spellings become their ids (for prompts written by hand, not data)."""
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    # ---- ids ---------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def padded_vocab_size(self, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1) -> int:
        """Megatron's padding: a multiple of the divisor times the TP size, so every TP shard of the embedding
        and output layer has the same width."""
        multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def eod(self) -> int:
        return self._roles["eos_token"]

    @property
    def eos(self) -> int:
        return self._roles["eos_token"]

    @property
    def bos(self) -> Optional[int]:
        return self._roles["bos_token"]

    @property
    def pad(self) -> int:
        """The padding id. Raises when the tokenizer has none; Megatron's datasets then use their own sentinel."""
        if self._roles["pad_token"] is None:
            raise TokenizerError(f"{self.model_file}: the tokenizer has no padding token")
        return self._roles["pad_token"]

    @property
    def pad_or_eod(self) -> int:
        """Filler for packed rows: its positions are always masked, so any valid id will do."""
        return self._roles["pad_token"] if self._roles["pad_token"] is not None else self.eod

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        """Role name -> id, the shape Megatron's datasets read to check that padding collides with nothing."""
        return {role: i for role, i in self._roles.items() if i is not None}

    def token_id(self, content: str) -> int:
        """The id of a special token, e.g. ``<|im_end|>``; names the tokenizer when it lacks one."""
        try:
            return self.special_tokens[content]
        except KeyError:
            raise TokenizerError(f"{self.model_file} has no special token {content!r}; train one with "
                                 "tools/train_tokenizer.py (it adds Kimi-style chat and tool tokens) or use "
                                 "Kimi's tokenizer") from None

    def apply_chat_template(self, messages: list[dict], tools: Optional[list] = None,
                            add_generation_prompt: bool = False) -> list[int]:
        from megatron_ext.data.sft import render_chat

        return render_chat(self, messages, tools, add_generation_prompt=add_generation_prompt).ids

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_file!r}, vocab_size={self.vocab_size})"


class HFTokenizer(Tokenizer):
    kind = "HFTokenizer"

    def __init__(self, path: str):
        from tokenizers import Tokenizer as RustTokenizer

        model_file = _find_file(path, "tokenizer.json")
        try:
            self._tok = RustTokenizer.from_file(model_file)
        except Exception as e:  # the library raises plain Exceptions on malformed JSON
            raise TokenizerError(f"{model_file}: not a Hugging Face tokenizer.json ({e})") from None
        self._tok.encode_special_tokens = True  # special spellings inside text are text
        added = self._tok.get_added_tokens_decoder()
        special = {tok.content: i for i, tok in added.items() if tok.special}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        super().__init__(path, model_file, special, _read_config(model_file), size)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        self._tok.encode_special_tokens = False
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        finally:
            self._tok.encode_special_tokens = True

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}


class TikTokenizer(Tokenizer):
    kind = "TikTokenizer"

    def __init__(self, path: str, pattern: str = KIMI_PATTERN):
        import tiktoken

        model_file = _find_file(path, "tiktoken.model")
        ranks = load_bpe_ranks(model_file)
        config = _read_config(model_file)
        num_base = len(ranks)
        reserved = int(config.get("num_reserved_special_tokens", KIMI_NUM_RESERVED_SPECIAL_TOKENS))
        added = {int(i): (t["content"] if isinstance(t, dict) else str(t))
                 for i, t in config.get("added_tokens_decoder", {}).items()}
        ids = range(num_base, max([num_base + reserved - 1, *added]) + 1)
        special = {added.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
        if len(special) != len(ids):
            raise TokenizerError(f"{model_file}: tokenizer_config.json gives two special ids the same content")
        self._enc = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(model_file))) or "bpe",
                                      pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        super().__init__(path, model_file, special, config, ids.stop)

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for piece in _tiktoken_pieces(text):
            out += self._enc.encode_ordinary(piece)
        return out

    def encode_with_specials(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            specials = set(self.special_tokens.values())
            ids = [i for i in ids if i not in specials]
        return self._enc.decode(ids)

    @property
    def vocab(self) -> dict[str, int]:
        out = {self._enc.decode_single_token_bytes(i).decode("utf-8", "backslashreplace"): i
               for i in range(self._enc.n_vocab) if i not in self.special_tokens.values()}
        out.update(self.special_tokens)
        return out

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}


def load_bpe_ranks(model_file: str) -> dict[bytes, int]:
    """Parse a tiktoken rank file, checking what tiktoken itself would only discover by panicking mid-encode."""
    ranks: dict[bytes, int] = {}
    try:
        with open(model_file, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError:
                    raise TokenizerError(f"{model_file}:{number}: expected 'BASE64 RANK', got "
                                         f"{line[:60]!r}") from None
    except OSError as e:
        raise TokenizerError(f"{model_file}: cannot read ({e.strerror})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{model_file}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{model_file}: {len(missing)} single bytes have no rank (e.g. {missing[0]}); "
                             "a byte-level BPE needs all 256")
    return ranks


# tiktoken's encoder is quadratic in the length of one pre-token and its Rust side panics past a few hundred
# thousand characters, so long texts and long same-class runs (minified code, base64 blobs) are encoded in pieces.
_MAX_CHARS = 400_000
_MAX_RUN = 25_000
_LONG_RUN = re.compile(r"(?<!\s)\s{%d,}|(?<!\S)\S{%d,}" % (_MAX_RUN, _MAX_RUN))


def _tiktoken_pieces(text: str):
    if len(text) <= _MAX_CHARS and _LONG_RUN.search(text) is None:
        yield text
        return
    for start in range(0, len(text), _MAX_CHARS):
        chunk = text[start:start + _MAX_CHARS]
        pos = 0
        for m in _LONG_RUN.finditer(chunk):
            if m.start() > pos:
                yield chunk[pos:m.start()]
            for s in range(m.start(), m.end(), _MAX_RUN):
                yield chunk[s:min(s + _MAX_RUN, m.end())]
            pos = m.end()
        if pos < len(chunk):
            yield chunk[pos:]


def _find_file(path: str, name: str) -> str:
    candidate = os.path.join(path, name) if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise TokenizerError(f"tokenizer model {candidate!r} does not exist")
    return candidate


def _read_config(model_file: str) -> dict:
    config_file = os.path.join(os.path.dirname(os.path.abspath(model_file)), "tokenizer_config.json")
    if not os.path.isfile(config_file):
        return {}
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{config_file}: unreadable ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_file}: expected a JSON object")
    return config


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def infer_tokenizer_type(path: str) -> str:
    """The type a model path implies: a tokenizer.json is HF's, a tiktoken.model (or *.tiktoken) is tiktoken's."""
    if not os.path.exists(path):
        raise TokenizerError(f"tokenizer model {path!r} does not exist")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return "HFTokenizer"
        if os.path.isfile(os.path.join(path, "tiktoken.model")):
            return "TikTokenizer"
    elif path.endswith(".json"):
        return "HFTokenizer"
    elif path.endswith((".model", ".tiktoken")):
        return "TikTokenizer"
    raise TokenizerError(f"cannot tell the tokenizer type of {path!r}; pass --tokenizer-type "
                         f"{' or '.join(TOKENIZER_TYPES)}")


def normalize_tokenizer_type(tokenizer_type: Optional[str], path: str) -> str:
    if tokenizer_type is None:
        return infer_tokenizer_type(path)
    tokenizer_type = _TYPE_ALIASES.get(tokenizer_type, tokenizer_type)
    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r}; use one of {list(TOKENIZER_TYPES)}")
    return tokenizer_type


@functools.lru_cache(maxsize=8)
def build_tokenizer(tokenizer_type: Optional[str], tokenizer_model: str) -> Tokenizer:
    """Load (once per process) the tokenizer a run or tool names with --tokenizer-type/--tokenizer-model."""
    kind = normalize_tokenizer_type(tokenizer_type, tokenizer_model)
    return HFTokenizer(tokenizer_model) if kind == "HFTokenizer" else TikTokenizer(tokenizer_model)
