"""The token-level coding environment: reset/step/score over one token sequence that equals the rendered
transcript, so model tokens are never re-tokenised and the observation tokens are exactly what the template adds."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.data.sft import render_chat
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.env.episode import EpisodeConfig
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.token_env import CodingEnv
from megatron_ext.env.tools import TOOL_SCHEMAS
from tests.unit.data_fixtures import small_corpus, trained_tokenizer
from tests.unit.env_fixtures import ORACLE, make_task


def _turn(tokenizer, messages, action, index):
    """The ids a model would generate for one tool-calling turn (body and <|im_end|>)."""
    reply = {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"functions.{action['name']}:{index}", "type": "function",
        "function": {"name": action["name"], "arguments": json.dumps(action["arguments"])}}]}
    prefix = render_chat(tokenizer, messages, tools=TOOL_SCHEMAS, add_generation_prompt=True).ids
    return render_chat(tokenizer, messages + [reply], tools=TOOL_SCHEMAS).ids[len(prefix):]


def test_oracle_through_tokens(tmp_path):
    tokenizer = build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))
    path = make_task(str(tmp_path / "t"))
    env = CodingEnv(tokenizer, EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes"))),
                    task_dir=os.path.dirname(path))
    sequence = env.reset(json.load(open(path)))
    for i, action in enumerate(ORACLE):
        generated = _turn(tokenizer, env.session.messages, action, i)
        step = env.step(generated)
        sequence += generated + step.observation
        assert step.done == (i == len(ORACLE) - 1)
    transcript = env.session.messages
    assert [m["role"] for m in transcript].count("tool") == len(ORACLE)
    assert sequence == render_chat(tokenizer, transcript[:-1], tools=TOOL_SCHEMAS).ids
    score = env.score()
    assert score.parts["correctness"] == 1.0 and score.parts["invalid_calls"] == 0
    assert os.listdir(tmp_path / "boxes") == []
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(generated)


def test_cut_turn_is_closed_and_garbage_is_an_invalid_turn(tmp_path):
    tokenizer = build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))
    path = make_task(str(tmp_path / "t"))
    env = CodingEnv(tokenizer, EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes"))),
                    task_dir=os.path.dirname(path))
    env.reset(json.load(open(path)))
    generated = _turn(tokenizer, env.session.messages, {"name": "list_dir", "arguments": {}}, 0)
    cut = generated[:-1]  # the turn hit its token limit before <|im_end|>
    step = env.step(cut)
    im_end = tokenizer.token_id("<|im_end|>")
    assert not step.done and step.observation[0] == im_end
    assert tokenizer.decode(step.observation).count("calc/") == 1
    # a turn of plain text (no tool calls) ends the episode; the no-op scores 0
    assert env.step(tokenizer.encode("I give up.") + [im_end]).done
    score = env.score()
    assert score.parts["correctness"] == 0.0 and env.result.status == "no_tool_calls"
    assert env.result.messages[-1]["content"] == "I give up."
