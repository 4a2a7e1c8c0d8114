"""Data flags: validation messages name the flag and the fix; the tokenizer sets the vocabulary size."""

import pytest

from megatron_ext.arguments import ArgumentError, parse_args, require_dataset
from tests.unit.data_fixtures import small_corpus, trained_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("args"))
    return trained_tokenizer(d, small_corpus(d), vocab_size=1000)


def _parse(flags, world=1):
    return parse_args(["--model", "tiny", *flags], world_size=world)


def test_tokenizer_sets_and_bounds_the_vocabulary(tok):
    args = _parse(["--tokenizer-model", tok, "--tensor-model-parallel-size", "2", "--sequence-parallel"], world=2)
    assert args.vocab_size == 1000 and args.arch.vocab_size == 1000 and args.tokenizer_type == "HFTokenizer"
    assert args.padded_vocab_size == 1024  # Megatron's padding: a multiple of 128 x TP
    assert _parse(["--tokenizer-model", tok, "--vocab-size", "1100"]).vocab_size == 1100
    with pytest.raises(ArgumentError) as err:
        _parse(["--tokenizer-model", tok, "--vocab-size", "999"])
    assert "--vocab-size 999 is smaller than the 1000 ids of --tokenizer-model" in str(err.value)


@pytest.mark.parametrize("flags, names", [
    (["--mock-data", "--data-path", "x"], ["--mock-data and --data-path"]),
    (["--data-path", "x"], ["--data-path needs --tokenizer-model"]),
    (["--data-path", "0.7", "a", "b"], ["--data-path 0.7 a b", "WEIGHT PREFIX"]),
    (["--data-path", "-1", "a"], ["--data-path weights must be positive"]),
    (["--split", "a,b"], ["--split 'a,b'"]),
    (["--split", "0,1,0", "--data-path", "x", "--tokenizer-model", "TOK"], ["--split 0,1,0 gives training no share"]),
    (["--split", "99,0,1", "--eval-interval", "5", "--data-path", "x", "--tokenizer-model", "TOK"],
     ["--eval-interval needs a validation share", "--split 98,1,1"]),
    (["--sft"], ["--sft takes exactly one chat JSONL"]),
    (["--sft", "--data-path", "a.jsonl", "b.jsonl", "--tokenizer-model", "TOK"], ["--sft takes exactly one"]),
    (["--sft", "--data-path", "a.jsonl", "--tokenizer-model", "TOK", "--pipeline-model-parallel-size", "2"],
     ["--micro-batch-size 1"]),
    (["--tokenizer-type", "TikTokenizer"], ["--tokenizer-type needs --tokenizer-model"]),
    (["--tokenizer-model", "/nonexistent/tokenizer.json"], ["--tokenizer-model /nonexistent/tokenizer.json",
                                                            "does not exist"]),
])
def test_bad_data_flags_name_the_flag(tok, flags, names):
    flags = [tok if f == "TOK" else f for f in flags]
    world = 2 if "--pipeline-model-parallel-size" in flags else 1
    with pytest.raises(ArgumentError) as err:
        _parse(flags, world)
    for name in names:
        assert name in str(err.value)


def test_training_needs_a_dataset(tok):
    with pytest.raises(ArgumentError, match="pass --data-path PREFIX .* or --mock-data"):
        require_dataset(_parse([]))
    require_dataset(_parse(["--mock-data"]))
    require_dataset(_parse(["--data-path", "0.5", "a", "0.5", "b", "--tokenizer-model", tok, "--split", "98,1,1"]))
