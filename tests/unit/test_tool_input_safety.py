"""Issue 25, tool and server items: random weights only on request and said so, a port in use named at start,
seeds and logprobs out of range answered 400, make_rl_prompts and build_corpus say why they cannot do what was
asked."""

import json
import socket
import urllib.request

import pytest

from megatron_ext.inference.server import ModelService, RequestError, serve
from tests.unit.data_fixtures import load_tool
from tests.unit.inference_fixtures import engine  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def serve_tool():
    return load_tool("serve")


def test_serving_without_a_checkpoint_needs_random_weights(serve_tool, tmp_path, capsys):
    missing = str(tmp_path / "missing")
    assert serve_tool.main(["--model", "tiny", "--load", missing, "--load-optional", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--load {missing} holds no checkpoint" in err and "--random-weights" in err and "Traceback" not in err
    assert serve_tool.main(["--model", "tiny", "--port", "0"]) == 2
    assert "no weights to serve" in capsys.readouterr().err


def test_a_port_in_use_is_named_before_the_model_is_built(serve_tool, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert serve_tool.main(["--model", "tiny", "--random-weights", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there (Address already in use)")
    assert "Traceback" not in err


def test_random_weights_are_reported_by_health_and_models(engine):  # noqa: F811
    service = ModelService(engine[0], "tiny")
    service.random_weights = True
    httpd = serve(service, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=60).read())
        models = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=60).read())
    finally:
        httpd.shutdown()
    assert health["random_weights"] is True and models["data"][0]["random_weights"] is True


@pytest.mark.parametrize("body, words", [
    ({"seed": 10**23}, "'seed' must be an integer >= 0 and <= "),
    ({"logprobs": 100000}, "'logprobs' 100000: this server returns the sampled token's logprob only"),
])
def test_out_of_range_request_fields_are_400(engine, body, words):  # noqa: F811
    service = ModelService(engine[0], "tiny")
    with pytest.raises(RequestError, match=words) as e:
        service.parse_completion({"prompt": [1, 2], "max_tokens": 2, **body})
    assert e.value.status == 400


def test_make_rl_prompts_refuses_more_prompts_than_distinct_inputs(tmp_path, capsys):
    tool = load_tool("make_rl_prompts")
    with pytest.raises(SystemExit):
        tool.main(["--out", str(tmp_path), "--min-len", "1", "--max-len", "1", "--train", "50"])
    err = capsys.readouterr().err
    assert "--train 50 asks for more prompts than the 29 distinct (op, input) pairs of the train split" in err
    assert not (tmp_path / "train.jsonl").exists()
    assert tool.main(["--out", str(tmp_path), "--min-len", "2", "--max-len", "2", "--train", "20",
                      "--heldout", "5"]) == 0
    assert "distinct (op, input) pairs" in capsys.readouterr().out


def test_build_corpus_names_the_size_filter_when_it_removed_everything(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    for name in ("a.py", "b.py"):
        (tmp_path / "src" / name).write_text("x = 1\n")
    code = load_tool("build_corpus").main(["--input", str(tmp_path / "src"), "--output", str(tmp_path / "c.jsonl")])
    err = capsys.readouterr().err
    assert code == 1
    assert "2 files matched --input and --extensions but none was kept: 2 below --min-bytes 64" in err
    assert "lower --min-bytes" in err and "no files matched" not in err
