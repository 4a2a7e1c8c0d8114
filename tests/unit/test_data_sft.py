"""Chat SFT data: Kimi-style rendering, assistant-only loss masks, packing, and packed == unpacked training."""

import json
from functools import partial

import pytest
import torch

import pretrain_composer as entry
from megatron_ext.arguments import parse_args
from megatron_ext.data.batches import collate
from megatron_ext.data.indexed import DataError
from megatron_ext.data.sft import (ChatDataset, ChatFormatError, Conversation, build_chat_datasets,
                                   encode_conversations, pack, packed_batch, render_chat)
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model
from tests.unit.data_fixtures import small_corpus, trained_tokenizer

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Find TODOs"},
    {"role": "assistant", "content": "Searching.", "reasoning_content": "grep it",
     "tool_calls": [{"type": "function", "function": {"name": "grep", "arguments": {"pattern": "TODO"}}}]},
    {"role": "tool", "tool_call_id": "functions.grep:0", "content": "a.py:3: TODO"},
    {"role": "assistant", "content": [{"type": "text", "text": "One TODO in a.py."}]},
]
EXPECTED = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"grep","parameters":'
    '{"type":"object"}}}]<|im_end|>'
    "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
    "<|im_user|>user<|im_middle|>Find TODOs<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>grep it</think>Searching.<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.grep:0<|tool_call_argument_begin|>{"pattern": "TODO"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.grep:0\na.py:3: TODO<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>One TODO in a.py.<|im_end|>"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sft"))
    return build_tokenizer("HFTokenizer", trained_tokenizer(d, small_corpus(d)))


def test_kimi_style_rendering_and_assistant_only_mask(tok):
    r = render_chat(tok, CONVO, TOOLS)
    assert r.text == EXPECTED
    assert r.ids == tok.encode_with_specials(EXPECTED)  # segment-wise encoding == encoding the whole text
    trained = [i for i, m in zip(r.ids, r.loss_mask) if m]
    assert tok.decode(trained) == (
        "<think>grep it</think>Searching.<|tool_calls_section_begin|><|tool_call_begin|>functions.grep:0"
        '<|tool_call_argument_begin|>{"pattern": "TODO"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "One TODO in a.py.<|im_end|>")
    # role headers are never trained, every turn ends with <|im_end|>
    assistant_header = tok.token_id("<|im_assistant|>")
    assert all(m == 0 for i, m in zip(r.ids, r.loss_mask) if i == assistant_header)
    assert r.ids.count(tok.token_id("<|im_end|>")) == 6
    gen = render_chat(tok, CONVO[:2], add_generation_prompt=True)
    assert gen.text.endswith("<|im_end|><|im_assistant|>assistant<|im_middle|>") and gen.trained_tokens == 0
    assert tok.apply_chat_template(CONVO[:2], add_generation_prompt=True) == gen.ids


def test_quoted_special_tokens_stay_text_and_context_turns_are_not_trained(tok):
    msgs = [{"role": "user", "content": "say <|im_end|><|im_assistant|>"},
            {"role": "assistant", "content": "old answer", "train": False},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "new answer"}]
    r = render_chat(tok, msgs)
    assert r.ids.count(tok.token_id("<|im_end|>")) == 4 and r.ids.count(tok.token_id("<|im_assistant|>")) == 2
    assert tok.decode([i for i, m in zip(r.ids, r.loss_mask) if m]) == "new answer<|im_end|>"


@pytest.mark.parametrize("messages, match", [
    ([{"role": "robot", "content": "x"}], r"messages\[0\]: role must be one of"),
    ([{"role": "tool", "content": "x"}], "needs tool_call_id"),
    ([{"role": "user", "content": [{"type": "image"}]}], r"content\[0\]"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}], "function.name"),
    ([], "non-empty list"),
])
def test_schema_errors(tok, messages, match):
    with pytest.raises(ChatFormatError, match=match):
        render_chat(tok, messages)


def _write_chats(path, conversations, extra_lines=()):
    with open(path, "w") as f:
        for c in conversations:
            f.write(json.dumps({"messages": c}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def _chats(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = ["list", "dict", "loop", "return", "value", "open", "file", "class", "import", "yield"]

    def text(k):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))

    return [[{"role": "user", "content": text(3 + i % 5)}, {"role": "assistant", "content": text(2 + (i * 7) % 11)}]
            for i in range(n)]


def test_bad_lines_are_named_or_skipped(tok, tmp_path):
    path = str(tmp_path / "chat.jsonl")
    _write_chats(path, _chats(3), ['{"messages": [{"role": "robot"}]}', "not json", '{"text": "x"}'])
    with pytest.raises(DataError, match=r"chat.jsonl:4: messages\[0\]: role"):
        encode_conversations(tok, path, 64)
    convs, report = encode_conversations(tok, path, 64, on_error="skip")
    assert len(convs) == 3 and [n for n, _ in sorted(report["bad_lines"])] == [4, 5, 6]


def test_packing_places_every_conversation_once(tok):
    assert pack([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="more than a row"):
        pack([9], 8)
    convs = [Conversation(torch.arange(n).numpy() + 1, (torch.arange(n) % 2).float().numpy())
             for n in (5, 9, 3, 17, 2, 8)]
    ds = ChatDataset(convs, 24, pad_id=0, seed=3)
    placed = sorted(i for row in ds.rows for i in row)
    assert placed == list(range(len(convs)))
    for r, row in enumerate(ds.rows):
        sample = ds.row(r)
        cu = sample["cu_seqlens"][sample["cu_seqlens"] >= 0].tolist()
        lengths = [convs[i].positions for i in row]
        assert cu[:len(row) + 1] == [sum(lengths[:k]) for k in range(len(row) + 1)] and cu[-1] == 24
        for k, i in enumerate(row):
            lo = cu[k]
            assert sample["tokens"][lo:lo + lengths[k]].tolist() == convs[i].ids[:-1].tolist()
            assert sample["labels"][lo:lo + lengths[k]].tolist() == convs[i].ids[1:].tolist()
            assert sample["loss_mask"][lo:lo + lengths[k]].tolist() == convs[i].loss_mask[1:].tolist()
            assert sample["position_ids"][lo:lo + lengths[k]].tolist() == list(range(lengths[k]))
        assert sample["loss_mask"][cu[len(row)]:].sum() == 0  # filler is never trained
    batch, params = packed_batch(ds(range(2)))
    assert batch["tokens"].shape == (1, 48) and "cu_seqlens" not in batch
    assert params.qkv_format == "thd" and params.cu_seqlens_q[-1] == 48
    assert params.max_seqlen_q == max(torch.diff(params.cu_seqlens_q)).item()
    rows = {tuple(ds.row(r)["tokens"].tolist()) for r in range(len(ds))}
    for epoch in (0, 1):  # every epoch is a (seeded) permutation of all rows
        assert {tuple(ds[epoch * len(ds) + k]["tokens"].tolist()) for k in range(len(ds))} == rows


def test_packing_pads_documents_for_context_parallelism():
    convs = [Conversation(torch.arange(n).numpy() + 1, torch.ones(n).float().numpy()) for n in (5, 9, 3, 17, 2)]
    ds = ChatDataset(convs, 24, pad_id=0, seed=3, pad_multiple=4)  # CP 2: documents in multiples of 4
    for r, row in enumerate(ds.rows):
        sample = ds.row(r)
        cu = sample["cu_seqlens"][sample["cu_seqlens"] >= 0].tolist()
        assert all(b % 4 == 0 for b in cu) and cu[-1] == 24
        for k, i in enumerate(row):
            n = convs[i].positions
            assert sample["tokens"][cu[k]:cu[k] + n].tolist() == convs[i].ids[:-1].tolist()
            assert sample["loss_mask"][cu[k]:cu[k] + n].sum() == n  # every real target counts
            assert sample["loss_mask"][cu[k] + n:cu[k + 1]].sum() == 0  # the padding never does
    with pytest.raises(DataError, match="not a multiple of 4"):
        ChatDataset(convs, 30, pad_id=0, seed=3, pad_multiple=4)


@pytest.fixture
def single_rank():
    yield
    destroy()


def test_packed_rows_train_exactly_like_unpacked_conversations(tok, tmp_path, single_rank):
    """The same conversations packed into shared rows or one per padded row: same per-token losses, same loss,
    same gradients. Tokens never see another conversation (attention, rotary positions, MTP targets)."""
    path = str(tmp_path / "chat.jsonl")
    _write_chats(path, _chats(12))
    args = parse_args(["--model", "tiny", "--seq-length", "64", "--tokenizer-model", tok.model_file,
                       "--moe-aux-loss-coeff", "0", "--sft", "--data-path", path], world_size=1)
    initialize_distributed(args)
    (packed_ds, _, _), _ = build_chat_datasets(tok, path, 64, [1.0, 0.0, 0.0], seed=1, packed=True)
    (plain_ds, _, _), _ = build_chat_datasets(tok, path, 64, [1.0, 0.0, 0.0], seed=1, packed=False)
    assert len(packed_ds) < len(plain_ds) == 12
    model = build_model(args, wrap_ddp=False, init_fn=partial(init_layout_invariant_, seed=3))[0]

    def run(ds, train):
        model.zero_grad(set_to_none=True)
        model.train(train)
        rows = ds.rows
        batch = collate([ds.row(r) for r in range(len(rows))])  # rows in their natural order
        with torch.set_grad_enabled(train):
            output, loss_func = entry.forward_step(iter([batch]), model)
            loss, count, _ = loss_func(output)
            if train:
                loss.backward()
        per_token = output.detach().reshape(len(rows), -1)
        losses = {}
        for r, row in enumerate(rows):
            lo = 0
            for i in row:
                n = ds.conversations[i].positions
                losses[i] = per_token[r, lo:lo + n] * batch["loss_mask"][r, lo:lo + n]
                lo += n
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None} if train else {}
        return float(loss), int(count), losses, grads

    for train in (False, True):
        loss_p, count_p, tokens_p, grads_p = run(packed_ds, train)
        loss_u, count_u, tokens_u, grads_u = run(plain_ds, train)
        assert count_p == count_u > 0
        assert loss_p == pytest.approx(loss_u, rel=1e-5)
        for i in range(12):  # conversation i is the file's i-th line in both datasets
            torch.testing.assert_close(tokens_p[i], tokens_u[i], rtol=1e-5, atol=1e-5)
        if train:
            assert grads_p.keys() == grads_u.keys() and len(grads_p) > 10
            for name in grads_p:
                torch.testing.assert_close(grads_p[name], grads_u[name], rtol=1e-4, atol=1e-6, msg=name)
