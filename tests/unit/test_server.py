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
from megatron_ext.training.checkpointing import load_weights
from megatron_ext.training.initialize import destroy, initialize_distributed
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
def server(tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ckpt"))
    assert entry.main(["--model", "tiny", "--mock-data", "--train-iters", "2", "--global-batch-size", "4",
                       "--lr", "5e-2", "--save", save]) == 0
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)

    def reload(path):
        load_weights(args, model, path, log=lambda *a, **k: None)

    service = ModelService(InferenceEngine(model[0]), "tiny", reload=reload)
    httpd = serve(service, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", save
    httpd.shutdown()
    destroy()


def test_health_and_models(server):
    url, _ = server
    assert _call(url, "/health") == (200, {"status": "ok", "weights_version": 0})
    status, body = _call(url, "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "tiny"


def test_completion_with_token_ids_and_logprobs(server):
    url, _ = server
    status, body = _call(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                                                  "logprobs": 1})
    assert status == 200
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == 5 and all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    status, spec = _call(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0,
                                                  "speculative": True})
    assert status == 200 and spec["choices"][0]["token_ids"] == choice["token_ids"]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"prompt": "hello"}, 400, "need a server started with a tokenizer"),
    ({"prompt": []}, 400, "'prompt' must be"),
    ({"prompt": [99999]}, 400, "outside the vocabulary"),
    ({"prompt": [1], "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
    ({"prompt": [1], "temperature": "hot"}, 400, "'temperature' must be a number"),
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


def test_serve_script_starts_and_answers(tmp_path):
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-u", "tools/serve.py", "--model", "tiny", "--port", "0"],
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
        assert status == 200
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


def test_hf_dir_under_torchrun_is_refused(monkeypatch, capsys):
    from tests.unit.data_fixtures import load_tool

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_tool("serve").main(["--hf-dir", "/nonexistent"]) == 2
    assert "convert first" in capsys.readouterr().err
