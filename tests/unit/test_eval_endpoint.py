"""tools/run_eval.py --agent endpoint:URL against our tools/serve.py model service (a random tiny model with a
trained tokenizer, uvicorn in this process on a free loopback port): every episode goes through the HTTP chat
API, its tokens are counted with the tokenizer, and the run is scored (a random model answers without tool calls,
so each episode ends after one turn and scores 0)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.env.agents import EndpointAgent
from megatron_ext.env.episode import SYSTEM_PROMPT
from megatron_ext.env.tools import TOOL_SCHEMAS
from megatron_ext.eval.usage import message_tokens
from tests.unit.eval_fixtures import make_suite, run_eval_main


def test_endpoint_agent_over_our_server(tmp_path, capsys):
    from tests.unit.inference_fixtures import served_chat_model

    with served_chat_model(str(tmp_path)) as (url, tokenizer, tokenizer_dir):
        suite = make_suite(str(tmp_path), ids=("add-a",))
        out = str(tmp_path / "run")
        code = run_eval_main()(["--tasks", suite, "--agent", f"endpoint:{url}", "--model", "tiny",
                                "--passes", "2", "--concurrency", "2", "--max-tokens", "8",
                                "--count-tokenizer", tokenizer_dir, "--out", out, "--env-sandbox-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err[-3000:]
    episodes = [json.loads(line) for line in open(os.path.join(out, "episodes.jsonl"))]
    assert [e["pass"] for e in episodes] == [0, 1]
    for e in episodes:
        assert e["status"] == "no_tool_calls" and e["error"] is None and e["counts"]["turns"] == 1, e["error"]
        reply = e["transcript"][2]
        assert reply["role"] == "assistant" and isinstance(reply["content"], str)
        count = lambda text: len(tokenizer.tokenize(text)) if text else 0  # noqa: E731
        assert e["usage"]["output_tokens"] == message_tokens(reply, count)
        assert e["usage"]["cached_input_tokens"] == 0 and e["usage"]["input_tokens"] > 100  # tools + prompt
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["accuracy"] == 0.0 and s["statuses"] == {"no_tool_calls": 2} and s["model"] == "tiny"
    assert s["token_counter"] == f"tokenizer {tokenizer_dir}" and s["agent"] == f"endpoint:{url}"
    assert "[2/2] add-a pass" in capsys.readouterr().err


def test_local_checkpoint_served_in_process(tmp_path, capsys):
    """local:CKPT: tools/serve.py's model service for a saved checkpoint, in the evaluating process."""
    import pretrain_composer as entry
    from megatron_ext.data.tokenizers import build_tokenizer
    from tests.unit.data_fixtures import small_corpus, trained_tokenizer

    tokenizer_dir = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024)
    vocab = build_tokenizer(None, tokenizer_dir).vocab_size
    save = str(tmp_path / "ckpt")
    # trained at the tiny preset's 1024-token context (YaRN), served at 4096: the agent's prompt alone is ~1700
    assert entry.main(["--model", "tiny", "--mock-data", "--vocab-size", str(vocab), "--train-iters", "1",
                       "--global-batch-size", "1", "--micro-batch-size", "1", "--save", save]) == 0
    suite = make_suite(str(tmp_path), ids=("add-a",))
    out = str(tmp_path / "run")
    code = run_eval_main()(["--tasks", suite, "--agent", f"local:{save}", "--serve-arg=--tokenizer-model",
                            f"--serve-arg={tokenizer_dir}", "--serve-arg=--inference-max-seq-length",
                            "--serve-arg=4096", "--max-tokens", "8", "--out", out,
                            "--env-sandbox-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "serving context 1024 -> 4096 tokens: YaRN factor 4 -> 64 (original 64)" in captured.out
    episode = json.loads(open(os.path.join(out, "episodes.jsonl")).readline())
    assert episode["error"] is None and episode["counts"]["turns"] >= 1
    assert episode["transcript"][2]["role"] == "assistant"
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["token_counter"] == f"tokenizer {tokenizer_dir}" and summary["episodes"] == 1
    import torch.distributed as dist

    assert not dist.is_initialized()  # the run stopped the server and tore its process group down


def test_agents_fit_their_turns_into_the_context(tmp_path, capsys):
    """A served context of 1700 tokens: the first turn's prompt (~1670 tokens) leaves a few dozen, so --max-tokens
    4096 is clamped to what is left (the server's 400 names prompt_tokens and max_model_len); a task whose
    instruction alone overflows the context ends "context_exceeded", stored and counted as wrong."""
    import urllib.error
    import urllib.request

    from tests.unit.inference_fixtures import served_chat_model

    with served_chat_model(str(tmp_path), context=1700) as (url, tokenizer, tokenizer_dir):
        models = json.load(urllib.request.urlopen(url + "/v1/models"))
        assert models["data"][0]["max_model_len"] == 1700
        request = urllib.request.Request(url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 4096}).encode())
        try:
            urllib.request.urlopen(request)
            raise AssertionError("a request past the context was served")
        except urllib.error.HTTPError as e:
            assert e.code == 400
            error = json.loads(e.read())["error"]
        assert error["reason"] == "context_length_exceeded" and error["max_model_len"] == 1700
        assert 0 < error["prompt_tokens"] < 100 and "exceeds the model's context of 1700 tokens" in error["message"]
        suite = make_suite(str(tmp_path), ids=("add-a", "add-b"))
        lines = open(suite).read().splitlines()
        long = json.loads(lines[1])
        long["instruction"] += " Keep the change small." * 200
        with open(suite, "w") as f:
            f.write(lines[0] + "\n" + json.dumps(long) + "\n")
        # the agent's requests for the first turn of add-a: clamped to the context, then to the room left
        agent, sent = EndpointAgent(url, model="tiny", max_tokens=4096), []

        def post(body, real=agent._post):
            sent.append(body["max_tokens"])
            reply = real(body)
            sent.append(reply["usage"])
            return reply

        agent._post = post
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": json.loads(lines[0])[
            "instruction"]}]
        assert agent.act(messages, TOOL_SCHEMAS)["role"] == "assistant"
        prompt = len(tokenizer.apply_chat_template(messages, tools=TOOL_SCHEMAS, add_generation_prompt=True))
        assert 1600 < prompt < 1700 and sent[:2] == [1699, 1700 - prompt]
        assert sent[2]["prompt_tokens"] == prompt and 1 <= sent[2]["completion_tokens"] <= 1700 - prompt
        out = str(tmp_path / "run")
        code = run_eval_main()(["--tasks", suite, "--agent", f"endpoint:{url}", "--model", "tiny",
                                "--max-tokens", "4096", "--count-tokenizer", tokenizer_dir, "--out", out,
                                "--env-sandbox-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err[-3000:]
    fits, overflows = [json.loads(line) for line in open(os.path.join(out, "episodes.jsonl"))]
    assert fits["error"] is None and fits["status"] in ("no_tool_calls", "finished", "max_turns")
    assert fits["counts"]["turns"] >= 1 and fits["transcript"][2]["role"] == "assistant"
    assert overflows["status"] == "context_exceeded" and overflows["reward"]["correctness"] == 0.0
    assert "fills the model's context of 1700 tokens" in overflows["error"] and overflows["counts"]["turns"] == 0
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["statuses"]["context_exceeded"] == 1 and s["episodes"] == 2 and s["accuracy"] == 0.0


def test_serving_context_follows_yarn():
    from megatron_ext.models.presets import TINY
    from megatron_ext.training.stages import StageError, attention_scale_factor, serving_context

    arch = TINY.replace(rotary_scaling_factor=4.0, original_max_position_embeddings=256, max_position_embeddings=1024)
    longer, note = serving_context(arch, 4096)
    assert (longer.max_position_embeddings, longer.rotary_scaling_factor) == (4096, 16.0)
    assert attention_scale_factor(longer) > attention_scale_factor(arch)
    assert "YaRN factor 4 -> 16 (original 256)" in note and "trained at factor 4" in note
    shorter, _ = serving_context(arch, 512)
    assert (shorter.max_position_embeddings, shorter.rotary_scaling_factor) == (512, 4.0)
    with pytest.raises(StageError, match="plain RoPE"):
        serving_context(arch.replace(rope_type="rope"), 2048)
    with pytest.raises(StageError, match=">= 1"):
        serving_context(arch, 0)
