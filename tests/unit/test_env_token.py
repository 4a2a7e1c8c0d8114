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
from megatron_ext.env.demo import ORACLE, make_task


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


def test_self_summarisation_chains_sequences(tmp_path):
    from megatron_ext.env.episode import SUMMARY_REQUEST
    tokenizer = build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))
    path = make_task(str(tmp_path / "t"))
    env = CodingEnv(tokenizer, EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")),
                                             summarize_at=150), task_dir=os.path.dirname(path))
    sequences = [env.reset(json.load(open(path)))]
    actions, i, restarts = list(ORACLE), 0, 0
    while True:
        messages = env.session.messages
        if messages[-1]["content"] == SUMMARY_REQUEST:  # the model writes its summary as a plain turn
            generated = tokenizer.encode("I read calc and added a todo.") + [tokenizer.token_id("<|im_end|>")]
        else:
            generated = _turn(tokenizer, messages, actions[i], i)
            i += 1
        step = env.step(generated)
        sequences[-1] += generated
        if step.done:
            break
        if step.restart:
            restarts += 1
            assert env.session.segments[-1][-1]["content"] == "I read calc and added a todo."
            sequences.append(step.observation)
            assert "## Summary of your work so far\nI read calc and added a todo." in tokenizer.decode(step.observation)
        else:
            sequences[-1] += step.observation
    assert restarts == 1 and len(sequences) == 2
    # each sequence of the chain is exactly its rendered segment
    assert sequences[0] == render_chat(tokenizer, env.session.segments[0], tools=TOOL_SCHEMAS).ids
    assert sequences[1] == render_chat(tokenizer, env.session.messages[:-1], tools=TOOL_SCHEMAS).ids
    assert env.score().parts["correctness"] == 1.0


def test_grading_failure_scores_zero_with_the_error(tmp_path, monkeypatch):
    from megatron_ext.env import episode
    tokenizer = build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))
    path = make_task(str(tmp_path / "t"))
    env = CodingEnv(tokenizer, EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes"))),
                    task_dir=os.path.dirname(path))
    env.reset(json.load(open(path)))

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(episode, "overlay", broken)
    score = env.score()
    assert score.total == 0.0 and score.parts == {} and "OSError: disk full" in score.error
    assert os.listdir(tmp_path / "boxes") == []
