"""benchmarks/agent_turns.py: per tool, the assistant turns a model would write verbatim under teacher forcing.
Scored with stand-in models whose greedy choice is known: the oracle (every next token), the oracle with one
path token wrong (only that read_file turn is lost), and a model that repeats its input (nothing exact)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megatron_ext.data.sft import render_chat
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.env.tools import TOOL_SCHEMAS, declarations
from tests.unit.data_fixtures import small_corpus, trained_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("agent_turns", os.path.join(ROOT, "benchmarks", "agent_turns.py"))
agent_turns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent_turns)


def _call(i, name, arguments):
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"functions.{name}:{i}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _conversation(path):
    return {"id": path, "tools": declarations(TOOL_SCHEMAS, "compact"), "messages": [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Implement f(x) in `{path}`: add 1 to x."},
        _call(0, "read_file", {"path": path}),
        {"role": "tool", "tool_call_id": "functions.read_file:0", "content": "def f(x):\n    raise NotImplementedError"},
        _call(1, "edit_file", {"path": path, "old_text": "    raise NotImplementedError\n", "new_text": "    x = x + 1\n"}),
        {"role": "tool", "tool_call_id": "functions.edit_file:1", "content": f"edited {path}"},
        _call(2, "finish", {"message": "done"})]}


class Oracle(torch.nn.Module):
    """Logits whose argmax is the true next token, except at the positions in `wrong` of the sequence `only`."""

    def __init__(self, vocab, wrong=(), only=None):
        super().__init__()
        self.vocab, self.wrong, self.only = vocab, set(wrong), only

    def forward(self, ids, positions, mask):
        logits = torch.zeros(1, ids.size(1), self.vocab)
        nxt = torch.cat([ids[0, 1:], ids[0, :1]])
        wrong = self.wrong if self.only is None or ids[0].tolist() == self.only else set()
        for i, t in enumerate(nxt.tolist()):
            logits[0, i, (t + 1) % self.vocab if i in wrong else t] = 1.0
        return logits


class Echo(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, ids, positions, mask):
        return torch.nn.functional.one_hot(ids, self.vocab).float()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    return build_tokenizer(None, trained_tokenizer(d, small_corpus(d), vocab_size=1024))


def test_turns_are_scored_per_tool_and_a_wrong_path_token_loses_only_its_turn(tokenizer):
    conversations = [_conversation("pkg/mod.py"), _conversation("other/thing.py")]
    vocab = tokenizer.vocab_size
    perfect = agent_turns.score(Oracle(vocab), tokenizer, conversations, "cpu")
    assert set(perfect) == {"read_file", "edit_file", "finish"}
    assert all(r["turns"] == 2 and r["exact_rate"] == 1.0 and r["token_accuracy"] == 1.0 for r in perfect.values())

    # one wrong prediction inside the first conversation's read_file path
    rendered = render_chat(tokenizer, conversations[0]["messages"], conversations[0]["tools"])
    start, end = agent_turns.turn_runs(rendered.loss_mask)[0]
    path_token = next(i for i in range(start, end) if "pkg/m" in tokenizer.detokenize(rendered.ids[start:i + 1]))
    scored = agent_turns.score(Oracle(vocab, wrong=[path_token - 1], only=rendered.ids), tokenizer, conversations, "cpu")
    assert scored["read_file"]["exact_rate"] == 0.5 and scored["read_file"]["token_accuracy"] < 1.0
    assert scored["edit_file"]["exact_rate"] == scored["finish"]["exact_rate"] == 1.0
    miss = scored["read_file"]["first_misses"][0]
    assert miss["task"] == "pkg/mod.py" and miss["predicted"] != miss["expected"]
    assert "pkg/m" in miss["context"] + miss["expected"]

    echo = agent_turns.score(Echo(vocab), tokenizer, conversations, "cpu")
    assert all(r["exact_rate"] == 0.0 for r in echo.values())


def test_turn_runs():
    assert agent_turns.turn_runs([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert agent_turns.turn_runs([0, 0]) == []
