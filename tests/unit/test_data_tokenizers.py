"""Tokenizers: both file formats round-trip text, agree on special ids, and fail on bad files by name."""

import base64
import json
import os
import shutil

import pytest

from megatron_ext.data import bpe
from megatron_ext.data.tokenizers import (CHAT_SPECIAL_TOKENS, HFTokenizer, TikTokenizer, TokenizerError,
                                          build_tokenizer, infer_tokenizer_type)
from tests.unit.data_fixtures import load_tool, read_texts, small_corpus, trained_tokenizer

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "中文English混合 naïve café — ☃ 🐍 \t\r\n",
    "a literal <|im_end|> and [EOS] inside a document stay text",
    "   leading and trailing spaces   ",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return trained_tokenizer(str(d), small_corpus(str(d)))


@pytest.fixture(scope="module")
def corpus_texts(tok_dir):
    return read_texts(os.path.join(os.path.dirname(tok_dir), "corpus.jsonl"))


@pytest.mark.parametrize("kind", ["HFTokenizer", "TikTokenizer"])
def test_round_trip_text_ids_text(tok_dir, corpus_texts, kind):
    tok = build_tokenizer(kind, tok_dir)
    for text in SAMPLES + corpus_texts:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # special spellings in data are ordinary text; only explicit special encoding yields the id
    im_end = tok.token_id("<|im_end|>")
    assert im_end not in tok.encode(SAMPLES[2]) and tok.eod not in tok.encode(SAMPLES[2])
    assert tok.encode_with_specials("x<|im_end|>y").count(im_end) == 1
    assert tok.decode([im_end]) == "<|im_end|>"


def test_both_formats_share_layout_and_agree_on_ids(tok_dir, corpus_texts):
    hf, tk = HFTokenizer(tok_dir), TikTokenizer(tok_dir)
    assert hf.vocab_size == tk.vocab_size == 1024
    assert hf.special_tokens == tk.special_tokens
    # Kimi's layout: special tokens right after the base vocabulary, in the trainer's order
    base = 1024 - len(CHAT_SPECIAL_TOKENS)
    assert [hf.special_tokens[t] for t in CHAT_SPECIAL_TOKENS] == list(range(base, 1024))
    assert (hf.eod, hf.pad, hf.bos) == (hf.token_id("[EOS]"), hf.token_id("[PAD]"), hf.token_id("[BOS]"))
    assert (tk.eod, tk.pad, tk.bos) == (hf.eod, hf.pad, hf.bos)
    # same merges, same pre-tokeniser (Kimi's regex in both libraries): the same ids
    for text in corpus_texts[:4] + SAMPLES:
        assert hf.encode(text) == tk.encode(text)


def test_megatron_interface_and_tp_padding(tok_dir):
    tok = build_tokenizer("HFTokenizer", tok_dir)
    assert tok.tokenize("x = 1") == tok.encode("x = 1") and tok.detokenize(tok.encode("x = 1")) == "x = 1"
    assert tok.padded_vocab_size(128, 1) == 1024
    assert tok.padded_vocab_size(128, 3) == 1152 and tok.padded_vocab_size(100, 1) == 1100
    assert tok.special_tokens_dict["eos_token"] == tok.eod and tok.special_tokens_dict["pad_token"] == tok.pad
    assert tok.unique_identifiers["sha256"] and json.dumps(tok.unique_identifiers)
    assert len(tok.vocab) == 1024 and tok.inv_vocab[tok.eod] == "[EOS]"


def test_kimi_style_tiktoken_directory(tmp_path, tok_dir):
    """A Kimi-like directory: tiktoken.model + tokenizer_config.json naming only some ids; the rest of 256
    reserved ids get <|reserved_token_ID|> names."""
    d = tmp_path / "kimi"
    d.mkdir()
    shutil.copy(os.path.join(tok_dir, "tiktoken.model"), d / "tiktoken.model")
    base = sum(1 for _ in open(d / "tiktoken.model"))
    names = {base: "[BOS]", base + 1: "[EOS]", base + 2: "<|im_end|>", base + 255: "[PAD]"}
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in names.items()}}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer("TikTokenizer", str(d / "tiktoken.model"))
    assert tok.vocab_size == base + 256
    assert (tok.bos, tok.eod, tok.pad) == (base, base + 1, base + 255)
    assert tok.token_id(f"<|reserved_token_{base + 7}|>") == base + 7
    assert tok.decode(tok.encode(SAMPLES[1])) == SAMPLES[1]
    assert infer_tokenizer_type(str(d)) == "TikTokenizer" and infer_tokenizer_type(tok_dir) == "HFTokenizer"


def test_bad_tokenizer_files_are_named(tmp_path, tok_dir):
    with pytest.raises(TokenizerError, match="does not exist"):
        build_tokenizer("HFTokenizer", str(tmp_path / "nope"))
    bad = tmp_path / "bad"
    bad.mkdir()
    lines = open(os.path.join(tok_dir, "tiktoken.model")).read().splitlines()
    (bad / "tiktoken.model").write_text("\n".join(lines[:10] + ["not-a-rank-line"] + lines[10:]) + "\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:11: expected 'BASE64 RANK'"):
        TikTokenizer(str(bad))
    (bad / "tiktoken.model").write_text("\n".join(lines[1:]) + "\n")  # byte 0 has no rank any more
    with pytest.raises(TokenizerError, match="ranks must be 0..|single bytes have no rank"):
        TikTokenizer(str(bad))
    (bad / "tiktoken.model").write_text(f"{base64.b64encode(b'a').decode()} 0\n")
    with pytest.raises(TokenizerError, match="256"):
        TikTokenizer(str(bad))
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a Hugging Face tokenizer.json"):
        HFTokenizer(str(bad))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(TokenizerError, match="--tokenizer-type"):
        infer_tokenizer_type(str(tmp_path / "weights.bin"))


def test_vocab_size_must_leave_room_for_merges():
    with pytest.raises(ValueError, match="--vocab-size 200"):
        bpe.train_bpe(["abc"], 200)


def test_byte_level_alphabet_is_a_bijection():
    alphabet = bpe.byte_level_alphabet()
    assert sorted(alphabet) == list(range(256)) and len(set(alphabet.values())) == 256
    assert alphabet[ord("a")] == "a" and alphabet[ord(" ")] == "\u0120"  # GPT-2's 'Ġ'


def test_train_tokenizer_cli_writes_both_formats(tmp_path, capsys):
    corpus = small_corpus(str(tmp_path))
    out = str(tmp_path / "tok")
    tool = load_tool("train_tokenizer")
    assert tool.main(["--input", corpus, "--vocab-size", "600", "--output", out, "--tiktoken"]) == 0
    assert "600 ids (16 special" in capsys.readouterr().out
    hf, tk = HFTokenizer(out), TikTokenizer(out)
    assert hf.vocab_size == tk.vocab_size == 600 and hf.special_tokens == tk.special_tokens
    assert tool.main(["--input", corpus, "--vocab-size", "100", "--output", out, "--tiktoken"]) == 2
    assert "--vocab-size 100" in capsys.readouterr().err
    # without --tiktoken the earlier tiktoken.model would be left disagreeing with a new tokenizer.json
    assert tool.main(["--input", corpus, "--vocab-size", "600", "--output", out]) == 2
    assert "tiktoken.model is left from an earlier run" in capsys.readouterr().err
    assert TikTokenizer(out).vocab_size == 600
