"""tools/run_eval.py --agent endpoint:URL against our tools/serve.py model service (a random tiny model with a
trained tokenizer, uvicorn in this process on a free loopback port): every episode goes through the HTTP chat
API, its tokens are counted with the tokenizer, and the run is scored (a random model answers without tool calls,
so each episode ends after one turn and scores 0)."""

from __future__ import annotations

import json
import os

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
    assert entry.main(["--model", "tiny", "--mock-data", "--vocab-size", str(vocab), "--seq-length", "4096",
                       "--max-position-embeddings", "4096", "--train-iters", "1", "--global-batch-size", "1",
                       "--micro-batch-size", "1", "--save", save]) == 0
    suite = make_suite(str(tmp_path), ids=("add-a",))
    out = str(tmp_path / "run")
    code = run_eval_main()(["--tasks", suite, "--agent", f"local:{save}", "--serve-arg=--tokenizer-model",
                            f"--serve-arg={tokenizer_dir}", "--max-tokens", "8", "--out", out,
                            "--env-sandbox-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err[-3000:]
    episode = json.loads(open(os.path.join(out, "episodes.jsonl")).readline())
    assert episode["error"] is None and episode["counts"]["turns"] >= 1
    assert episode["transcript"][2]["role"] == "assistant"
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["token_counter"] == f"tokenizer {tokenizer_dir}" and summary["episodes"] == 1
    import torch.distributed as dist

    assert not dist.is_initialized()  # the run stopped the server and tore its process group down
