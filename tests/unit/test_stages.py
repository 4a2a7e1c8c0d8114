"""--stage pretrain | extend | sft: prerequisites, YaRN set-up, resuming a stage, and what YaRN costs at short range."""

import json
import os

import pytest
import torch

import pretrain_composer as entry
from megatron_ext.arguments import ArgumentError, parse_args
from megatron_ext.training import stages
from megatron_ext.training.checkpointing import read_tracker
from megatron_ext.data.sft import render_chat
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.training import lm
from megatron_ext.training.lm import window_loss
from tests.unit.data_fixtures import preprocessed, small_corpus, trained_tokenizer

SHORT = 64
PRETRAIN_ITERS = 80


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny model trained on standard-library code at 64 tokens with plain RoPE (YaRN factor 1)."""
    d = str(tmp_path_factory.mktemp("stages"))
    corpus = small_corpus(d)
    tok = trained_tokenizer(d, corpus)
    prefix = preprocessed(d, corpus, tok)
    data = ["--data-path", prefix, "--tokenizer-model", tok, "--split", "90,10,0"]
    save = os.path.join(d, "pretrain")
    code = entry.main(["--stage", "pretrain", "--model", "tiny", *data, "--seq-length", str(SHORT),
                       "--rotary-scaling-factor", "1", "--original-max-position-embeddings", str(SHORT),
                       "--micro-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "5",
                       "--train-iters", str(PRETRAIN_ITERS), "--log-interval", "40", "--save", save])
    assert code == 0 and read_tracker(save) == PRETRAIN_ITERS
    return {"dir": d, "data": data, "save": save, "tok": tok, "prefix": prefix}


def _parse(*flags):
    return parse_args(["--model", "tiny", *flags], world_size=1)


@pytest.mark.parametrize("flags, message", [
    (["--stage", "pretrain"], "--stage pretrain needs data"),
    (["--stage", "extend", "--mock-data", "--seq-length", "128"], "--stage extend continues the previous stage"),
    (["--stage", "sft", "--load", "DIR"], "--stage sft needs --data-path CHAT.jsonl"),
    (["--stage", "extend", "--load", "DIR"], "--stage extend needs data"),
    (["--stage", "extend", "--load", "DIR", "--mock-data", "--sft"], "--sft belongs to --stage sft"),
    (["--stage", "pretrain", "--mock-data", "--sft"], "for chat data use --stage sft"),
    (["--stage", "extend", "--load", "DIR", "--mock-data", "--finetune"], "drop --finetune"),
])
def test_missing_prerequisites_are_named(flags, message):
    with pytest.raises(ArgumentError, match=message):
        _parse(*flags)


def test_extend_needs_a_checkpoint_and_a_longer_context(tmp_path, pretrained):
    with pytest.raises(ArgumentError, match="no checkpoint under --load .*run the previous stage"):
        _parse("--stage", "extend", "--mock-data", "--load", str(tmp_path), "--seq-length", "256")
    with pytest.raises(ArgumentError, match="--seq-length 64 must exceed the previous stage's 64"):
        _parse("--stage", "extend", "--mock-data", "--load", pretrained["save"], "--seq-length", "64")
    with pytest.raises(ArgumentError, match="do not cover --seq-length 256"):
        _parse("--stage", "extend", "--mock-data", "--load", pretrained["save"], "--seq-length", "256",
               "--rotary-scaling-factor", "2")


def test_extend_sets_yarn_from_the_previous_stage(tmp_path, pretrained):
    args = _parse("--stage", "extend", "--mock-data", "--load", pretrained["save"], "--seq-length", "256",
                  "--save", str(tmp_path / "extend"))
    arch = args.arch
    assert (arch.rope_type, arch.rotary_scaling_factor, arch.original_max_position_embeddings) == ("yarn", 4.0, SHORT)
    assert arch.max_position_embeddings >= 256 and arch.seq_length == 256
    assert args.finetune and not args.stage_resume  # weights only: fresh optimizer and schedule
    assert stages.attention_scale_factor(arch) == pytest.approx((0.1 * 1.0 * torch.log(torch.tensor(4.0)) + 1) ** 2)
    assert "YaRN factor 1 -> 4" in stages.describe(args, args.stage_previous_arch)
    kept = _parse("--stage", "extend", "--mock-data", "--load", pretrained["save"], "--seq-length", "256",
                  "--stage-keep-optimizer")
    assert not kept.finetune


def test_an_interrupted_stage_resumes_from_its_own_checkpoints(tmp_path, pretrained):
    save = str(tmp_path / "extend")
    flags = ["--stage", "extend", "--model", "tiny", "--mock-data", "--load", pretrained["save"], "--save", save,
             "--seq-length", "128", "--micro-batch-size", "2", "--train-iters", "4", "--log-interval", "2"]
    assert entry.main(flags + ["--exit-interval", "2"]) == 0 and read_tracker(save) == 2
    args = parse_args(flags, world_size=1)
    assert args.stage_resume and args.load == save and not args.finetune
    assert args.arch.rotary_scaling_factor == 2.0  # taken from this stage's own checkpoint
    assert entry.main(flags) == 0 and read_tracker(save) == 4


def _chat(i):
    return [{"role": "user", "content": f"what is {i} + {i}?"}, {"role": "assistant", "content": f"{i} + {i} = {2 * i}"}]


def test_sft_stage_trains_on_chats_from_the_previous_stage(tmp_path, pretrained, monkeypatch):
    """The stage trains (and validates) on packed rows whose loss mask covers exactly the assistant tokens: each
    answer and its <|im_end|>, nothing of the user turns, headers or padding."""
    chats = tmp_path / "chat.jsonl"
    with open(chats, "w") as f:
        for i in range(24):
            f.write(json.dumps({"messages": _chat(i)}) + "\n")
    seen = []

    def recording_step(data_iterator, model):
        raw = next(data_iterator)
        seen.append(raw)
        return lm.forward_step(iter([raw]), model)

    monkeypatch.setattr(entry, "forward_step", recording_step)
    save = str(tmp_path / "sft")
    code = entry.main(["--stage", "sft", "--model", "tiny", "--load", pretrained["save"], "--save", save,
                       "--data-path", str(chats), "--tokenizer-model", pretrained["tok"], "--split", "90,10,0",
                       "--micro-batch-size", "2", "--train-iters", "3", "--log-interval", "1", "--eval-interval",
                       "3", "--eval-iters", "1"])
    assert code == 0 and read_tracker(save) == 3
    tok = build_tokenizer("HFTokenizer", pretrained["tok"])
    header, end = tok.token_id("<|im_assistant|>"), "<|im_end|>"
    assert len(seen) == 3 + 1 and all("cu_seqlens" in b for b in seen)  # 3 one-micro-batch steps + 1 evaluation
    for batch in seen:
        for tokens, labels, mask in zip(batch["tokens"], batch["labels"], batch["loss_mask"]):
            trained = labels[mask.bool()].tolist()
            answers = tok.decode(trained).split(end)
            assert answers[-1] == "" and len(answers) - 1 == int((tokens == header).sum()) > 0
            numbers = [int(a.split(" + ")[0]) for a in answers[:-1]]
            assert answers[:-1] == [f"{i} + {i} = {2 * i}" for i in numbers]
            assert len(trained) == sum(render_chat(tok, _chat(i)).trained_tokens for i in numbers)


def test_yarn_extension_keeps_short_context_loss_close(pretrained, capsys):
    """The pretrained weights under the extension's YaRN (factor 4, original 64), before any extension
    training, evaluated on 64-token windows of held-out code: close to the model as trained (measured on this
    corpus: a few hundredths of a nat, against ~2 nats of training progress)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(pretrained["prefix"])
    ids = torch.from_numpy(ds[len(ds) - 1].astype("int64"))  # the last document: in the validation split
    del ds
    windows = ids[: (len(ids) - 1) // (SHORT + 1) * (SHORT + 1)].view(-1, SHORT + 1)[:8]
    batches = [(windows[i:i + 4, :-1], windows[i:i + 4, 1:]) for i in range(0, len(windows), 4)]
    common = ["--model", "tiny", "--mock-data", "--micro-batch-size", "4"]
    before = window_loss(common + ["--load", pretrained["save"], "--use-checkpoint-args"],
                         pretrained["save"], batches)
    after = window_loss(common + ["--stage", "extend", "--load", pretrained["save"], "--seq-length", "256"],
                        pretrained["save"], batches)
    untrained = 6.93  # ln(1024): the loss of the untrained model
    with capsys.disabled():
        print(f"\nshort-context loss: trained {before:.4f}, under YaRN x4 {after:.4f}, delta {after - before:+.4f}")
    assert before < untrained - 1.0  # the model has learned something worth keeping
    assert abs(after - before) < 0.1 * (untrained - before)
