"""The OpenAI-compatible server: protocol, errors that leave it serving, weights reload."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import pretrain_composer as entry
from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.inference.server import ModelService, serve
from megatron_ext.inference.reload import CheckpointReload
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.checkpointing import load_weights
from megatron_ext.training.step import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _call(url, path, body=None):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, checkpoint dir, service, reloader) of a tiny model served over HTTP."""
    save = str(tmp_path_factory.mktemp("ckpt"))
    assert entry.main(["--model", "tiny", "--mock-data", "--train-iters", "2", "--global-batch-size", "4",
                       "--lr", "5e-2", "--save", save]) == 0
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    reloader = CheckpointReload(args, model[0])
    service = ModelService(InferenceEngine(model[0]), "tiny", reload=reloader)
    httpd = serve(service, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", save, service, reloader
    httpd.shutdown()
    destroy()


@pytest.fixture(scope="module")
def server(served):
    return served[:2]


def test_health_and_models(server):
    url, _ = server
    assert _call(url, "/health") == (200, {"status": "ok", "weights_version": 0})
    status, body = _call(url, "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny"
    assert body["data"][0]["max_model_len"] == 1024  # the tiny preset's context, as vLLM names it


def test_a_request_past_the_context_names_the_room_left(server):
    url, _ = server
    status, body = _call(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1022})
    error = body["error"]
    assert status == 400 and error["reason"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert (error["prompt_tokens"], error["max_model_len"]) == (3, 1024)
    assert "prompt (3 tokens) + max_tokens (1022) = 1025 exceeds the model's context of 1024 tokens; at most " \
           "1021 tokens fit" in error["message"]
    assert _completion(url, prompt=[1, 2, 3], max_tokens=1021, stop_token_ids=list(range(1024)))  # fits: stops at once


def test_completion_with_token_ids_and_logprobs(server):
    url, _ = server
    status, body = _call(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                                                  "logprobs": 1})
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == 5 and all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    status, spec = _call(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                                                  "speculative": True})
    assert status == 200 and spec["choices"][0]["token_ids"] == choice["token_ids"]


def test_speculation_auto_decodes_plainly_where_drafting_cannot_pay(served):
    """`tools/serve.py --speculation auto`: a speculative request whose batch cannot gain from drafting (costs
    for its batch bucket given here) gets the plain tokens and nothing is drafted; `always` drafts."""
    from megatron_ext.inference.speculative import DraftCosts

    url, _, service, _ = served
    body = {"prompt": [4, 5, 6], "max_tokens": 6, "temperature": 0}
    _, plain = _call(url, "/v1/completions", body)
    engine = service.engine
    saved = dict(engine.draft_costs), dict(engine.speculation_decisions), service.speculation
    engine.draft_costs[(1, 1, "batched")] = DraftCosts(main=1.0, verify=1.6, draft=0.5)  # 2 tokens for 2.1 steps at best
    try:
        drafted = []
        for policy in ("auto", "always"):
            service.speculation, before = policy, service.stats.drafted
            status, spec = _call(url, "/v1/completions", dict(body, speculative=True))
            assert status == 200 and spec["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
            drafted.append(service.stats.drafted - before)
    finally:
        engine.draft_costs, engine.speculation_decisions, service.speculation = saved
    assert drafted[0] == 0 and drafted[1] > 0
    with pytest.raises(ValueError, match="speculation"):
        ModelService(engine, "tiny", speculation="sometimes")


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"prompt": "hello"}, 400, "need a server started with a tokenizer"),
    ({"prompt": []}, 400, "'prompt' must be"),
    ({"prompt": [99999]}, 400, "outside the vocabulary"),
    ({"prompt": [1], "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
    ({"prompt": [1], "temperature": "hot"}, 400, "'temperature' must be a finite number"),
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 501, "chat template"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, words):
    url, _ = server
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    got_status, got = _call(url, path, body)
    assert got_status == status and words in got["error"]["message"]
    assert _call(url, "/health")[0] == 200


def test_unknown_endpoint_is_404(server):
    url, _ = server
    assert _call(url, "/v1/nope", {})[0] == 404


def test_reload_swaps_weights(server):
    """After /v1/reload the server answers exactly as a fresh engine built on the new checkpoint."""
    url, save = server
    requests = [{"prompt": [4, 5, 6], "max_tokens": 4, "temperature": 0, "logprobs": 1},
                {"prompt": [9, 1], "max_tokens": 4, "temperature": 1.0, "top_p": 0.9, "seed": 3, "logprobs": 1}]

    def served():
        choices = [_call(url, "/v1/completions", r)[1]["choices"][0] for r in requests]
        return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]

    before = served()
    status, body = _call(url, "/v1/reload", {"load": save})
    assert status == 200 and body["weights_version"] == 1
    after = served()
    assert after != before
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    fresh = build_model(args, wrap_ddp=False)
    load_weights(args, fresh, save, log=lambda *a, **k: None)
    engine = InferenceEngine(fresh[0])
    for r, (ids, logprobs) in zip(requests, after):
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r.get("top_p", 1.0),
                                seed=r.get("seed"))
        want = engine.generate([r["prompt"]], params)[0]
        assert ids == want.token_ids
        assert logprobs == pytest.approx(want.logprobs, abs=1e-6)
    status, body = _call(url, "/v1/reload", {"load": save + "/nothing-here"})
    assert status == 422 and "cannot load" in body["error"]["message"]
    assert _call(url, "/health")[1]["weights_version"] == 1


@pytest.mark.parametrize("path, raw, words", [
    ("/v1/completions", b'{"prompt": [1], "temperature": NaN}', "'temperature' must be a finite number"),
    ("/v1/completions", b'{"prompt": [1], "top_p": Infinity}', "'top_p' must be a finite number"),
    ("/v1/completions", b'{"prompt": [1], "stop": 5}', "'stop' must be a string or a list"),
    ("/v1/completions", b'{"prompt": [1], "stop_token_ids": 5}', "'stop_token_ids' must be a list"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "not valid Unicode"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "not valid Unicode"),
    ("/v1/completions", b'{"prompt": [1], "speculative": "yes"}', "'speculative' must be true or false"),
    ("/v1/completions", b'{"prompt": [1], "stream": 1}', "'stream' must be true or false"),
    ("/v1/completions", b'{"prompt": [1], "n": 0}', "'n' must be an integer >= 1"),
    ("/v1/completions", b'{"prompt": [1], "n": "2"}', "'n' must be an integer"),
    ("/v1/completions", b'{"prompt": [1], "seed": -1}', "'seed' must be an integer >= 0"),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": 100000}', "exceeds the model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}',
     "'tools' must be a list"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     "'tools[0]' must be"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                             b'"tools": [{"type": "function", "function": {"name": ""}}]}', "name' must be"),
])
def test_invalid_fields_get_400_naming_them(server, path, raw, words):
    url, _ = server
    status, body = _call(url, path, raw)
    assert status == 400 and words in body["error"]["message"], body
    assert _call(url, "/health")[0] == 200


def _completion(url, **fields):
    status, body = _call(url, "/v1/completions", {"prompt": [4, 5, 6], "max_tokens": 5, **fields})
    assert status == 200, body
    return body


def test_n_samples_share_the_request_and_follow_the_seeds(server):
    url, _ = server
    body = _completion(url, n=3, seed=10, temperature=1.0, logprobs=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for j, choice in enumerate(body["choices"]):
        alone = _completion(url, seed=10 + j, temperature=1.0, logprobs=True)["choices"][0]
        assert choice["token_ids"] == alone["token_ids"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)
    assert body["usage"]["completion_tokens"] == 15
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1


def _stream(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(dict(body, stream=True)).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_sends_openai_chunks_token_by_token(server):
    url, _ = server
    request = {"prompt": [4, 5, 6], "max_tokens": 6, "n": 2, "seed": 3, "temperature": 1.0, "logprobs": True}
    whole = _call(url, "/v1/completions", request)[1]
    chunks = _stream(url, "/v1/completions", request)
    assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    for j, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == j]
        assert [t for m in mine for t in m["token_ids"]] == choice["token_ids"]
        assert len(mine) == len(choice["token_ids"]) + 1  # one chunk per token, then the finish reason
        assert [m["finish_reason"] for m in mine] == [None] * (len(mine) - 1) + [choice["finish_reason"]]
        lps = [lp for m in mine for lp in m["logprobs"]["token_logprobs"]]
        assert lps == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)


def test_concurrent_clients_are_batched_without_resets(served):
    """20 clients x 8 requests on loopback: every request answered, the right tokens, several per engine call."""
    from concurrent.futures import ThreadPoolExecutor

    url, _, service, _ = served
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(8)]
    want = [_completion(url, prompt=p, max_tokens=3, temperature=0)["choices"][0]["token_ids"] for p in prompts]
    calls = []
    execute = service.execute

    def counting(name, *args, **kwargs):
        if name == "generate":
            calls.append(len(args[0]))
        return execute(name, *args, **kwargs)

    service.execute = counting
    try:
        def client(c):
            return [(i, _call(url, "/v1/completions", {"prompt": prompts[i], "max_tokens": 3, "temperature": 0}))
                    for i in range(8)]

        with ThreadPoolExecutor(20) as pool:
            results = [r for rs in pool.map(client, range(20)) for r in rs]
    finally:
        service.execute = execute
    assert len(results) == 160
    for i, (status, body) in results:
        assert status == 200 and body["choices"][0]["token_ids"] == want[i]
    assert sum(calls) == 160 and len(calls) < 160 and max(calls) > 1  # requests joined into batches


def _copy_checkpoint(save, tmp_path, name):
    import shutil

    from megatron_ext.training.checkpointing import checkpoint_dir, read_tracker

    target = str(tmp_path / name)
    shutil.copytree(save, target)
    return target, checkpoint_dir(target, read_tracker(target))


def test_failed_reloads_keep_the_previous_weights_serving(served, tmp_path):
    import torch

    from megatron_ext.training.checkpointing import _write_manifest

    url, save, service, reloader = served
    request = {"prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0, "logprobs": True}
    before = _call(url, "/v1/completions", request)[1]
    version = before["weights_version"]

    other_arch, ckpt = _copy_checkpoint(save, tmp_path, "arch")
    common = torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)
    common["args"]["arch"]["num_experts"] *= 2
    torch.save(common, os.path.join(ckpt, "common.pt"))
    os.remove(os.path.join(ckpt, "manifest.json"))
    _write_manifest(ckpt)  # a consistent checkpoint of another model, not a damaged one
    corrupt, ckpt = _copy_checkpoint(save, tmp_path, "metadata")
    meta = os.path.join(ckpt, ".metadata")
    size = os.path.getsize(meta)
    with open(meta, "wb") as f:
        f.write(b"\x00garbage" * (size // 8) + b"\x00" * (size % 8))  # same size: the manifest cannot tell

    for path, status, words in [(other_arch, 422, "num_experts: checkpoint"), (corrupt, 422, ".metadata is corrupt")]:
        got_status, body = _call(url, "/v1/reload", {"load": path})
        assert got_status == status and words in body["error"]["message"], body
        assert "previous weights kept" in body["error"]["message"]

    # a load that fails after overwriting part of the weights: restored
    def wipe_then_fail(path):
        with torch.no_grad():
            for p in reloader.model.parameters():
                p.zero_()
        raise OSError("disk went away")

    reloader.load = wipe_then_fail
    try:
        got_status, body = _call(url, "/v1/reload", {"load": save})
    finally:
        del reloader.load
    assert got_status == 500 and "OSError: disk went away" in body["error"]["message"], body

    after = _call(url, "/v1/completions", request)[1]
    assert after["choices"] == before["choices"] and after["weights_version"] == version
    assert _call(url, "/health")[1] == {"status": "ok", "weights_version": version}
    status, body = _call(url, "/v1/reload", {"load": save})  # and a good one still works
    assert status == 200 and body["weights_version"] == version + 1
    assert _call(url, "/v1/completions", request)[1]["weights_version"] == version + 1


def test_serve_script_starts_and_answers(tmp_path):
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-u", "tools/serve.py", "--model", "tiny",
                             "--random-weights", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        deadline = time.time() + 120
        while "serving" not in line and time.time() < deadline:
            line = proc.stdout.readline()
        url = line.strip().split(" on ")[1]
        status, body = _call(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_text_and_chat_with_a_tokenizer(tmp_path):
    from tests.unit.data_fixtures import small_corpus, trained_tokenizer
    from megatron_ext.data.tokenizers import build_tokenizer

    tok_dir = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024)
    tokenizer = build_tokenizer(None, tok_dir)
    args = parse_args(["--model", "tiny", "--mock-data", "--vocab-size", str(tokenizer.vocab_size)], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)
        httpd = serve(ModelService(InferenceEngine(model[0]), "tiny", tokenizer=tokenizer), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        status, body = _call(url, "/v1/completions", {"prompt": "def main():", "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["text"] == tokenizer.decode(choice["token_ids"])
        status, body = _call(url, "/v1/chat/completions", {
            "messages": [{"role": "system", "content": "You write Python."},
                         {"role": "user", "content": "Print hello."}], "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["usage"]["prompt_tokens"] > 5
        status, body = _call(url, "/v1/chat/completions", {"messages": [{"role": 3}], "max_tokens": 2})
        assert status == 400 and "cannot render" in body["error"]["message"]
        # streamed text and chat content add up to what the whole reply holds
        request = {"prompt": "def main():", "max_tokens": 8, "temperature": 0.8, "seed": 4, "stop": ["ZZ"]}
        whole = _call(url, "/v1/completions", request)[1]["choices"][0]
        chunks = _stream(url, "/v1/completions", request)
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
        chat = {"messages": [{"role": "user", "content": "Print hello."}], "max_tokens": 6, "temperature": 0}
        reply = _call(url, "/v1/chat/completions", chat)[1]["choices"][0]["message"]["content"]
        chunks = _stream(url, "/v1/chat/completions", chat)
        assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == reply
        tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
        status, body = _call(url, "/v1/chat/completions", dict(chat, tools=tools, stream=True))
        assert status == 400 and "'stream' with 'tools'" in body["error"]["message"]
        httpd.shutdown()
    finally:
        destroy()


def test_assistant_turns_parse_back_to_messages(tmp_path):
    from megatron_ext.data.sft import parse_assistant, render_chat
    from megatron_ext.data.tokenizers import build_tokenizer
    from tests.unit.data_fixtures import small_corpus, trained_tokenizer

    tokenizer = build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))
    calls = [{"id": "functions.read_file:0", "type": "function",
              "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
             {"id": "functions.run:1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]
    user = [{"role": "user", "content": "look"}]
    prompt = render_chat(tokenizer, user, add_generation_prompt=True).ids
    full = render_chat(tokenizer, user + [{"role": "assistant", "content": "Reading.", "tool_calls": calls}]).ids
    generated = full[len(prompt):]
    parsed = parse_assistant(tokenizer, generated)
    assert parsed["content"] == "Reading." and parsed["tool_calls"] == calls
    cut = parse_assistant(tokenizer, generated[: len(generated) // 2 + 8])
    assert cut.get("incomplete") or len(cut["tool_calls"]) < 2
    plain = render_chat(tokenizer, user + [{"role": "assistant", "content": "No tools needed."}]).ids
    assert parse_assistant(tokenizer, plain[len(prompt):]) == {"content": "No tools needed.", "tool_calls": []}


def test_garbled_tool_call_markers_never_raise(tmp_path):
    """A sampled turn may put the call markers in any order (an RL policy does); parsing keeps going and a call
    without its argument marker comes back as a call the toolbox rejects, not as an exception."""
    import random

    from megatron_ext.data.sft import CALL_ARGS, CALL_BEGIN, CALL_END, IM_END, SECTION_BEGIN, SECTION_END, \
        THINK_BEGIN, THINK_END, parse_assistant
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.env.tools import ToolError, validate
    from tests.unit.data_fixtures import small_corpus, trained_tokenizer

    tokenizer = build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))
    sp = {name: tokenizer.token_id(name) for name in
          (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_ARGS, CALL_END, THINK_BEGIN, THINK_END, IM_END)}
    name = tokenizer.encode("functions.list_dir:0")
    # the order that crashed an RL run: END before ARGS, then no END after ARGS
    garbled = [sp[SECTION_BEGIN], sp[CALL_BEGIN], *name, sp[CALL_END], sp[CALL_ARGS], *tokenizer.encode("{}")]
    parsed = parse_assistant(tokenizer, garbled)
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["list_dir"]
    try:
        validate("list_dir", parsed["tool_calls"][0]["function"]["arguments"])
        raise AssertionError("a call without its argument marker must not validate")
    except ToolError as e:
        assert "not valid JSON" in str(e)
    rng = random.Random(0)
    pool = list(sp.values()) + name + tokenizer.encode('{"path": "a"}')
    for _ in range(2000):
        message = parse_assistant(tokenizer, [rng.choice(pool) for _ in range(rng.randint(0, 24))])
        assert isinstance(message["content"], str) and isinstance(message["tool_calls"], list)


def test_hf_dir_under_torchrun_is_refused(monkeypatch, capsys):
    from tests.unit.data_fixtures import load_tool

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_tool("serve").main(["--hf-dir", "/nonexistent"]) == 2
    assert "convert first" in capsys.readouterr().err
