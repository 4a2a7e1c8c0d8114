"""Chat SFT data: Kimi-K2-style rendering, assistant-only loss masks, and packing without cross-talk.

Rendering follows Kimi K2's chat template: every message is ``<|im_ROLE|>NAME<|im_middle|>CONTENT<|im_end|>``
(tool results are system-side messages ``## Return of ID``), declared tools come first as a ``tool_declare``
system message, an assistant's tool calls are a ``<|tool_calls_section_begin|>`` section of
``<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`` and its reasoning is
``<think>...</think>``. Special ids are inserted by id and text is encoded as text, so a conversation that quotes
``<|im_end|>`` cannot end its own turn. The loss mask covers what the model must produce: an assistant message's
body and its ``<|im_end|>``, never the role header, the prompt or tool output.

Packing puts whole conversations into ``--seq-length`` rows and records their boundaries (``cu_seqlens``);
`packed_batch` turns a micro-batch into Megatron's THD packed-sequence form, so attention, rotary positions and
MTP's shifted targets all restart at each conversation: a packed row trains exactly as its conversations would
one by one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ext.data.indexed import DataError

ROLE_TOKENS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>",
               "tool": "<|im_system|>"}
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"


class ChatFormatError(ValueError):
    """A conversation that does not follow the chat schema; the message says where."""


@dataclass
class Rendered:
    ids: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)  # 1 where the model is trained to produce the token
    text: str = ""  # the same conversation as one string, special tokens spelled out

    @property
    def trained_tokens(self) -> int:
        return int(sum(self.loss_mask))


class _Writer:
    def __init__(self, tokenizer):
        self.tok, self.out = tokenizer, Rendered()

    def special(self, content: str, train: bool = False):
        self.out.ids.append(self.tok.token_id(content))
        self.out.loss_mask.append(int(train))
        self.out.text += content

    def text(self, content: str, train: bool = False):
        if content:
            ids = self.tok.encode(content)
            self.out.ids += ids
            self.out.loss_mask += [int(train)] * len(ids)
            self.out.text += content


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}.content[{k}]: only {{'type': 'text', 'text': ...}} parts are "
                                      "supported")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatFormatError(f"{where}.content must be a string, a list of text parts or null")


def _tool_call(call, where: str, index: int) -> tuple[str, str]:
    """(call id, argument text) of an OpenAI-style tool call; ids default to Kimi's functions.NAME:INDEX."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatFormatError(f"{where}: a tool call needs function.name")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = call.get("id") or f"functions.{function['name']}:{index}"
    return str(call_id), arguments


def render_chat(tokenizer, messages: Sequence[dict], tools: Optional[list] = None,
                add_generation_prompt: bool = False) -> Rendered:
    """Token ids and loss mask of a conversation. An assistant message with ``"train": false`` stays context."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    w = _Writer(tokenizer)
    if tools:
        w.special(ROLE_TOKENS["system"])
        w.text("tool_declare")
        w.special(IM_MIDDLE)
        w.text(json.dumps(tools, ensure_ascii=False, separators=(",", ":")))
        w.special(IM_END)
    calls = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLE_TOKENS:
            raise ChatFormatError(f"{where}: role must be one of {sorted(ROLE_TOKENS)}, got "
                                  f"{m.get('role') if isinstance(m, dict) else m!r}")
        role = m["role"]
        content = _content_text(m.get("content"), where)
        train = role == "assistant" and bool(m.get("train", True))
        w.special(ROLE_TOKENS[role])
        w.text("tool" if role == "tool" else str(m.get("name") or role))
        w.special(IM_MIDDLE)
        if role == "assistant":
            reasoning = m.get("reasoning_content")
            if reasoning:
                w.special(THINK_BEGIN, train)
                w.text(str(reasoning), train)
                w.special(THINK_END, train)
            w.text(content, train)
            tool_calls = m.get("tool_calls") or []
            if not isinstance(tool_calls, list):
                raise ChatFormatError(f"{where}.tool_calls must be a list")
            if tool_calls:
                w.special(SECTION_BEGIN, train)
                for k, call in enumerate(tool_calls):
                    call_id, arguments = _tool_call(call, f"{where}.tool_calls[{k}]", calls)
                    calls += 1
                    w.special(CALL_BEGIN, train)
                    w.text(call_id, train)
                    w.special(CALL_ARGS, train)
                    w.text(arguments, train)
                    w.special(CALL_END, train)
                w.special(SECTION_END, train)
        elif role == "tool":
            if not m.get("tool_call_id"):
                raise ChatFormatError(f"{where}: a tool message needs tool_call_id")
            w.text(f"## Return of {m['tool_call_id']}\n{content}")
        else:
            w.text(content)
        w.special(IM_END, train)
    if add_generation_prompt:
        w.special(ROLE_TOKENS["assistant"])
        w.text("assistant")
        w.special(IM_MIDDLE)
    return w.out


def iter_conversations(path: str):
    """(line number, record, None) for each JSON line with a messages list, (line number, None, reason) otherwise."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                yield number, None, f"invalid JSON ({getattr(e, 'msg', e)})"
                continue
            if isinstance(record, dict) and isinstance(record.get("messages"), list):
                yield number, record, None
            else:
                yield number, None, "expected an object with a 'messages' list"


@dataclass
class Conversation:
    ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def positions(self) -> int:
        """Input positions it occupies in a row: every token but the last is an input with a next-token label."""
        return len(self.ids) - 1


def encode_conversations(tokenizer, path: str, seq_length: int, on_error: str = "fail"):
    """Rendered conversations (at most seq_length + 1 tokens each) and a report of what was dropped or cut."""
    out, report = [], {"bad_lines": [], "truncated": 0, "untrained": 0}
    for number, record, problem in iter_conversations(path):
        if problem is None:
            try:
                r = render_chat(tokenizer, record["messages"], record.get("tools"))
            except ChatFormatError as e:
                problem = str(e)
        if problem is not None:
            report["bad_lines"].append((number, problem))
            if on_error == "fail":
                raise DataError(f"{path}:{number}: {problem}; fix the line or pass --on-error skip")
            continue
        ids, mask = np.asarray(r.ids, dtype=np.int64), np.asarray(r.loss_mask, dtype=np.float32)
        if len(ids) > seq_length + 1:
            ids, mask = ids[:seq_length + 1], mask[:seq_length + 1]
            report["truncated"] += 1
        if len(ids) < 2 or not mask[1:].any():
            report["untrained"] += 1  # nothing left to learn from (no assistant tokens within the length)
            continue
        out.append(Conversation(ids, mask))
    return out, report


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit packing of items (in order) into rows of `capacity` positions; deterministic."""
    rows, room = [], []
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"item {i} needs {n} positions, more than a row's {capacity}")
        for r, free in enumerate(room):
            if free >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return rows


class ChatDataset:
    """One split of conversations as fixed-length rows, packed (with ``cu_seqlens``) or one per row.

    Row ``i`` of epoch ``e`` is a seeded permutation of the rows, so any global sample index maps to the same
    row on every rank and after a resume.
    """

    def __init__(self, conversations: Sequence[Conversation], seq_length: int, pad_id: int, seed: int,
                 packed: bool = True, pad_multiple: int = 1):
        if not conversations:
            raise DataError("no conversations in this split")
        if packed and seq_length % pad_multiple:
            raise DataError(f"sequence length {seq_length} is not a multiple of {pad_multiple}")
        self.conversations, self.seq_length, self.pad_id, self.seed, self.packed = \
            list(conversations), seq_length, pad_id, seed, packed
        # Context parallelism splits every packed document into 2 x CP chunks: each conversation then occupies
        # a multiple of that many positions, the padding masked out of the loss.
        self.pad_multiple = pad_multiple if packed else 1
        lengths = [self._span(c) for c in self.conversations]
        self.rows = pack(lengths, seq_length) if packed else [[i] for i in range(len(lengths))]
        self.max_documents = max(len(r) for r in self.rows) + 1  # + the filler after the last conversation
        self._perms: dict[int, np.ndarray] = {}

    def _span(self, c: Conversation) -> int:
        return -(-c.positions // self.pad_multiple) * self.pad_multiple

    def __len__(self) -> int:
        return len(self.rows)

    def row_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms[epoch] = np.random.RandomState(self.seed + epoch).permutation(len(self.rows))
        return self._perms[epoch]

    def row(self, r: int) -> dict[str, torch.Tensor]:
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        position_ids = np.zeros(s, dtype=np.int64)
        bounds = [0]
        for c in (self.conversations[i] for i in self.rows[r]):
            lo, n = bounds[-1], c.positions
            tokens[lo:lo + n], labels[lo:lo + n] = c.ids[:-1], c.ids[1:]
            loss_mask[lo:lo + n] = c.loss_mask[1:]
            span = self._span(c)
            position_ids[lo:lo + span] = np.arange(span)
            bounds.append(lo + span)
        position_ids[bounds[-1]:] = np.arange(s - bounds[-1])
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.packed:
            if bounds[-1] < s:
                bounds.append(s)  # the filler is a document of its own, fully masked
            cu = np.full(self.max_documents + 1, -1, dtype=np.int32)
            cu[:len(bounds)] = bounds
            sample["cu_seqlens"] = cu
        return {k: torch.from_numpy(v) for k, v in sample.items()}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        epoch, k = divmod(int(index), len(self.rows))
        return self.row(int(self.row_order(epoch)[k]))

    def __call__(self, indices) -> dict[str, torch.Tensor]:
        samples = [self[i] for i in indices]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def build_chat_datasets(tokenizer, path: str, seq_length: int, shares: Sequence[float], seed: int,
                        packed: bool = True, on_error: str = "fail", pad_multiple: int = 1):
    """[train, validation, test] ChatDatasets (None for a split without share) from one chat JSONL, split by
    conversation order as Megatron splits documents; plus the encoding report."""
    from megatron_ext.data.gpt import SPLITS, split_ranges

    conversations, report = encode_conversations(tokenizer, path, seq_length, on_error)
    if not conversations:
        raise DataError(f"{path}: no usable conversations ({len(report['bad_lines'])} malformed lines, "
                        f"{report['untrained']} without assistant tokens)")
    datasets = []
    for name, share, (lo, hi) in zip(SPLITS, shares, split_ranges(len(conversations), shares)):
        if share <= 0:
            datasets.append(None)
            continue
        if hi <= lo:
            raise DataError(f"{path}: --split gives the {name} split {share:.2%} of {len(conversations)} "
                            "conversations, which rounds to none; give it a larger share or use more data")
        datasets.append(ChatDataset(conversations[lo:hi], seq_length, tokenizer.pad_or_eod, seed, packed,
                                    pad_multiple))
    return datasets, report


def packed_batch(batch: dict) -> tuple[dict, Optional[PackedSeqParams]]:
    """A micro-batch with ``cu_seqlens`` as one THD sequence of all its rows' documents, and the matching
    PackedSeqParams; a batch without it is returned unchanged with None."""
    cu = batch.get("cu_seqlens")
    if cu is None:
        return batch, None
    cu = cu.cpu()  # host already when it comes through batches.to_device
    b, s = batch["tokens"].shape
    bounds = [0]
    for r in range(b):
        row = cu[r][cu[r] >= 0].to(torch.int64)
        if len(row) < 2 or int(row[0]) != 0 or int(row[-1]) != s:
            raise ValueError(f"row {r}: cu_seqlens must run from 0 to the row length {s}")
        bounds += (row[1:] + r * s).tolist()
    # On the batch's device: Transformer Engine's attention and Megatron-Core's rotary embedding read it there.
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=batch["tokens"].device)
    max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    flat = {k: v.reshape(1, b * s) for k, v in batch.items() if k != "cu_seqlens"}
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return flat, params


def parse_assistant(tokenizer, ids: Sequence[int]) -> dict:
    """The inverse of rendering an assistant turn: generated ids -> an OpenAI-style message.

    Works on ids, not text, so tool-call markers are recognised by their special ids whatever the detokenizer does
    with specials. Returns {"content", "reasoning_content" (when a <think> block is present), "tool_calls"}; a call
    whose markers are cut off (the generation hit its token limit) is left out and reported in "incomplete".
    """
    special = {name: tokenizer.token_id(name) for name in
               (IM_END, THINK_BEGIN, THINK_END, SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_ARGS, CALL_END)}
    ids = [int(i) for i in ids]
    if special[IM_END] in ids:
        ids = ids[: ids.index(special[IM_END])]
    reasoning = None
    if special[THINK_END] in ids:
        end = ids.index(special[THINK_END])
        start = ids.index(special[THINK_BEGIN]) + 1 if special[THINK_BEGIN] in ids[:end] else 0
        reasoning = tokenizer.decode(ids[start:end])
        ids = ids[end + 1:]
    calls, incomplete = [], False
    if special[SECTION_BEGIN] in ids:
        section = ids[ids.index(special[SECTION_BEGIN]) + 1:]
        ids = ids[: ids.index(special[SECTION_BEGIN])]
        while special[CALL_BEGIN] in section:
            section = section[section.index(special[CALL_BEGIN]) + 1:]
            if special[CALL_END] not in section:
                incomplete = True  # cut off by the token limit
                break
            span, section = section[: section.index(special[CALL_END])], section[section.index(special[CALL_END]) + 1:]
            if special[CALL_ARGS] in span:
                head, arguments = span[: span.index(special[CALL_ARGS])], tokenizer.decode(
                    span[span.index(special[CALL_ARGS]) + 1:])
            else:  # a sampled call whose markers are out of order: kept, so the toolbox reports it as invalid
                head, arguments = span, f"(malformed call: no {CALL_ARGS} marker before {CALL_END})"
            call_id = tokenizer.decode(head).strip()
            name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    message = {"content": tokenizer.decode(ids), "tool_calls": calls}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if incomplete:
        message["incomplete"] = True
    return message
