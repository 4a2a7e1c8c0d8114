"""RemoteGenerate against our server's SGLang-native protocol: the same samples as the local engine, weight reload
by path, and errors that name the server (and a typed, retryable one when a server dies)."""

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import pretrain_composer as entry
from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.inference.reload import CheckpointReload
from megatron_ext.inference.server import ModelService, serve
from megatron_ext.rl.remote import (
    BadResponse,
    ReloadFailed,
    RemoteGenerate,
    RequestRejected,
    ServerUnavailable,
)
from megatron_ext.rl.rollout import EngineGenerate, Sampling
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model
from tests.unit.test_server import _call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two servers holding the same tiny model (each its own copy), a checkpoint of other weights, and the
    number of /generate jobs each server received."""
    save = str(tmp_path_factory.mktemp("ckpt"))
    assert entry.main(["--model", "tiny", "--mock-data", "--train-iters", "2", "--global-batch-size", "4",
                       "--lr", "5e-2", "--save", save]) == 0
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    servers, services, jobs = [], [], []
    for k in range(2):
        model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
        service = ModelService(InferenceEngine(model), "tiny", reload=CheckpointReload(args, model))
        count = [0]
        submit = service.submit

        def counting(job, submit=submit, count=count):
            count[0] += job.n
            return submit(job)

        service.submit = counting
        servers.append(serve(service, "127.0.0.1", 0))
        services.append(service)
        jobs.append(count)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    yield urls, services, jobs, save
    for s in servers:
        s.shutdown()
    destroy()


def _same(local, remote, version):
    assert [len(g) for g in local] == [len(g) for g in remote]
    for group_l, group_r in zip(local, remote):
        for a, b in zip(group_l, group_r):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)  # batch composition moves the last bits
            assert b.sampled_logprobs == pytest.approx(a.sampled_logprobs, abs=1e-5)
            assert a.versions == b.versions == [version] * len(a.token_ids)
            assert b.routing.dtype == np.int16 and np.array_equal(a.routing, b.routing)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [9, 8], [100, 200, 300, 400, 500]]
SAMPLINGS = {"greedy": Sampling(max_tokens=6, temperature=0.0, return_routing=True),
             "sampled": Sampling(max_tokens=7, temperature=1.0, top_k=20, seed=5, return_routing=True),
             "top-p with a stop id": Sampling(max_tokens=8, temperature=0.8, top_p=0.9, seed=11,
                                              stop_token_ids=(3, 17, 512), return_routing=True)}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_remote_equals_the_local_engine(fleet, name):
    urls, services, jobs, _ = fleet
    sampling = SAMPLINGS[name]
    before = [c[0] for c in jobs]
    remote = RemoteGenerate(urls)(PROMPTS, 3, sampling)
    assert all(c[0] > b for c, b in zip(jobs, before))  # both servers took requests
    engine = services[0].engine
    _same(EngineGenerate(engine)(PROMPTS, 3, sampling), remote, engine.weights_version)
    if sampling.temperature > 0:
        assert len({tuple(s.token_ids) for s in remote[0]}) > 1  # seeds differ per sample


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_remote_speculative_equals_local_speculative(fleet, name):
    """Our servers' MTP drafting ("speculative": true) draws what EngineGenerate(speculative=True) draws."""
    urls, services, _, _ = fleet
    sampling = SAMPLINGS[name]
    gen = RemoteGenerate(urls, speculative=True)
    remote = gen(PROMPTS[:2], 2, sampling)
    engine = services[0].engine
    local = EngineGenerate(engine, speculative=True)
    _same(local(PROMPTS[:2], 2, sampling), remote, engine.weights_version)
    counts, want = gen.pop_speculation(), local.pop_speculation()  # meta_info.spec_*: the same drafts
    assert counts["drafted"] == want["drafted"] > 0 and counts["accepted"] == want["accepted"]
    assert counts["tokens"] == want["tokens"] and gen.pop_speculation()["drafted"] == 0
    if name == "greedy":
        _same(EngineGenerate(engine)(PROMPTS[:2], 2, sampling), remote, engine.weights_version)


def test_reload_by_path_reaches_every_server(fleet):
    urls, services, _, save = fleet
    gen = RemoteGenerate(urls)
    sampling = SAMPLINGS["sampled"]
    before = gen(PROMPTS, 2, sampling)
    gen.reload(save, version=7)
    assert gen.versions() == {u: 7 for u in urls}
    after = gen(PROMPTS, 2, sampling)
    assert [s.token_ids for g in after for s in g] != [s.token_ids for g in before for s in g]
    for service in services:  # each server's own engine, on the loaded weights, draws what the client got
        _same(EngineGenerate(service.engine)(PROMPTS, 2, sampling), after, 7)
    with pytest.raises(ReloadFailed) as err:
        gen.reload(save + "/nothing-here", version=8)
    assert all(u in str(err.value) for u in urls) and "2 of 2 server(s)" in str(err.value)
    assert "previous weights kept" in str(err.value)
    assert gen.versions() == {u: 7 for u in urls}


def test_native_generate_shapes(fleet):
    urls, services, _, _ = fleet
    url, engine = urls[0], services[0].engine
    status, one = _call(url, "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                           "return_routed_experts": True,
                                           "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert status == 200 and isinstance(one, dict)
    want = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, return_routing=True))[0]
    meta = one["meta_info"]
    assert one["output_ids"] == want.token_ids and meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert [t[1] for t in meta["output_token_logprobs"]] == want.token_ids
    assert [t[0] for t in meta["output_token_logprobs"]] == pytest.approx(want.logprobs, abs=1e-6)
    assert meta["weight_version"] == str(engine.weights_version)
    rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(meta["routed_experts_shape"])
    assert np.array_equal(rows, want.routing.numpy())
    # a batch with n: a list, prompt-major; sample j of a seeded request draws with seed + j
    status, many = _call(url, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {
        "max_new_tokens": 3, "temperature": 1.0, "n": 2, "sampling_seed": 40}})
    assert status == 200 and len(many) == 4
    for k, out in enumerate(many):
        prompt, j = [[5, 6, 7], [8, 9]][k // 2], k % 2
        alone = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=1.0, seed=40 + j))[0]
        assert out["output_ids"] == alone.token_ids
    status, stop = _call(url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "stop_token_ids": [want.token_ids[1]]}})
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": want.token_ids[1]}
    assert len(stop["output_ids"]) == 2


@pytest.mark.parametrize("body, words", [
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not implemented by this server's sampler"),
    ({"input_ids": [1], "sampling_params": {"mystery": 1}}, "does not implement: ['mystery']"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "'max_new_tokens' must be an integer >= 1"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 entries for 2 prompts"),
    ({"input_ids": []}, "'input_ids' must be a non-empty list"),
    ({"text": "hi"}, "needs a server started with a tokenizer"),
    ({"input_ids": [1], "logprob_start_len": 0}, "prompt logprobs"),
    ({"input_ids": [1], "lora_path": "x"}, "does not implement: ['lora_path']"),
])
def test_native_generate_refuses_what_it_cannot_do(fleet, body, words):
    status, out = _call(fleet[0][0], "/generate", body)
    assert status == 400 and words in out["error"]["message"], out


def test_update_weights_from_disk_checks_its_fields(fleet):
    url = fleet[0][0]
    for body, words in [({"model_path": ""}, "'model_path' must name"), ({"model_path": "x", "weight_version": "v2"},
                        "'weight_version' must be a non-negative integer"),
                        ({"model_path": "x", "load_format": "safetensors"}, "'load_format'")]:
        status, out = _call(url, "/update_weights_from_disk", body)
        assert status == 400 and out["success"] is False and words in out["message"], out
    status, out = _call(url, "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "3"})
    assert status == 422 and out["success"] is False and "previous weights kept" in out["message"]


# ---- failures, against small fake servers -----------------------------------------------------------------------

class _Fake:
    """A loopback HTTP server answering /generate with `reply(body) -> (status, json)`, or closing the connection
    without an answer when reply returns None (a server dying mid-request)."""

    def __init__(self, reply):

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = reply(body)
                if answer is None:
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, payload = answer
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _good(n, meta_extra=None, **meta):
    out = {"text": "", "output_ids": [4, 5], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
        "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]], **meta}}
    return [out] * n


@pytest.mark.parametrize("reply, kind, words", [
    (lambda b: (200, [{"output_ids": [4], "meta_info": {"finish_reason": {"type": "stop"}}}]), BadResponse,
     "output_token_logprobs missing"),
    (lambda b: (200, [{"meta_info": {}}]), BadResponse, "'output_ids' missing"),
    (lambda b: (200, {"oops": 1}), BadResponse, "answered dict for 1 samples"),
    (lambda b: (200, _good(1, output_token_logprobs=[[-0.5, 9, None], [-0.2, 5, None]])), BadResponse,
     "token ids differ from output_ids"),
    (lambda b: (200, _good(1, weight_version="v-new")), BadResponse, "is not an integer version"),
    (lambda b: (400, {"error": {"message": "'top_p' must be in (0, 1]"}}), RequestRejected, "HTTP 400: 'top_p'"),
    (lambda b: (503, {"error": {"message": "overloaded"}}), ServerUnavailable, "HTTP 503: overloaded"),
    (lambda b: (200, _good(1, finish_reason={"type": "abort", "message": "weights update"})), ServerUnavailable,
     "aborted"),
    (lambda b: None, ServerUnavailable, "died mid-request"),
])
def test_bad_answers_name_the_server(reply, kind, words):
    fake = _Fake(reply)
    try:
        with pytest.raises(kind) as err:
            RemoteGenerate([fake.url])([[1, 2]], 1, Sampling(max_tokens=2))
        assert fake.url in str(err.value) and words in str(err.value), str(err.value)
        assert err.value.url == fake.url and err.value.prompt_indices == [0]
        assert err.value.retryable == (kind is ServerUnavailable)
    finally:
        fake.close()


def test_sglang_style_answers_are_accepted():
    """One weight version per request, no sampled logprobs, routing one row short (SGLang's shapes)."""
    routing = np.arange(4 * 3 * 2, dtype="<i4").reshape(4, 3, 2) % 7
    encoded = base64.b64encode(routing.tobytes()).decode()
    fake = _Fake(lambda b: (200, _good(len(b["input_ids"]), routed_experts=encoded)))
    try:
        import pickle

        gen = pickle.loads(pickle.dumps(RemoteGenerate([fake.url], routing_shape=(3, 2))))  # as a Ray argument
        out = gen([[1, 2, 3]], 2, Sampling(max_tokens=2, return_routing=True))
        assert len(out[0]) == 2
        s = out[0][1]
        assert s.token_ids == [4, 5] and s.logprobs == s.sampled_logprobs == [-0.5, -0.25] and s.versions == [3, 3]
        assert s.routing.dtype == np.int16 and np.array_equal(s.routing, routing)
    finally:
        fake.close()


def test_a_down_server_fails_only_its_prompts():
    """One server of two refuses connections: the error is retryable, names it and the prompts it held."""
    dead = _Fake(lambda b: (200, _good(1)))
    dead.close()  # the port is closed now
    alive = _Fake(lambda b: (200, _good(len(b["input_ids"]))))
    try:
        with pytest.raises(ServerUnavailable) as err:
            RemoteGenerate([alive.url, dead.url])([[1], [2], [3], [4]], 1, Sampling(max_tokens=2))
        assert dead.url in str(err.value) and err.value.url == dead.url
        assert 0 < len(err.value.prompt_indices) < 4  # the live server answered the others
        # failover: the dead server's prompts go to the live one, which is then preferred
        gen = RemoteGenerate([dead.url, alive.url], failover=True)
        out = gen([[1], [2], [3], [4]], 2, Sampling(max_tokens=2))
        assert [len(g) for g in out] == [2] * 4 and all(s.token_ids == [4, 5] for g in out for s in g)
        assert gen._down == {dead.url}
        other = _Fake(lambda b: (200, _good(1)))
        other.close()
        with pytest.raises(ServerUnavailable, match="failed"):  # every server down: still a retryable error
            RemoteGenerate([dead.url, other.url], failover=True)([[1]], 1, Sampling(max_tokens=2))
        with pytest.raises(ValueError, match="given twice"):
            RemoteGenerate([dead.url, dead.url + "/"])
        with pytest.raises(ValueError, match="http:// or https://"):
            RemoteGenerate(["localhost:8000"])
    finally:
        alive.close()


@contextlib.contextmanager
def _serve_subprocess(*flags):
    """tools/serve.py in a subprocess on a free loopback port: (process, url); killed afterwards."""
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-u", "tools/serve.py", *flags, "--random-weights",
                             "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line, deadline = "", time.time() + 120
        while "serving" not in line and time.time() < deadline:
            line = proc.stdout.readline()
        yield proc, line.strip().split(" on ")[1]
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_server_killed_mid_request_raises_a_retryable_error():
    """tools/serve.py killed with SIGKILL while it generates: ServerUnavailable naming it, for the orchestrator to
    requeue the prompts on another worker."""
    with _serve_subprocess("--model", "tiny") as (proc, url):
        gen = RemoteGenerate([url])
        assert gen.versions() == {url: 0}
        started = time.time()
        threading.Timer(1.0, lambda: os.kill(proc.pid, signal.SIGKILL)).start()
        with pytest.raises(ServerUnavailable) as err:
            gen([[1, 2, 3]] * 4, 8, Sampling(max_tokens=1000, temperature=1.0, seed=1))
        assert time.time() - started < 60
        assert url in str(err.value) and err.value.retryable and err.value.prompt_indices == [0, 1, 2, 3]


@pytest.mark.parametrize("nproc, extra", [(1, ["--rl-speculative"]),
                                          pytest.param(2, [], marks=pytest.mark.slow, id="dp2")],
                         ids=["1rank-speculative", "dp2"])
def test_rl_composer_generates_on_remote_servers(tmp_path, nproc, extra):
    """rl_composer.py --rl-remote-servers: a tools/serve.py server generates (with routing for replay; drafting
    with --rl-speculative, its acceptance logged), each step's weights are published to it by path, and its tokens
    carry the version the trainer just published. Under DP2 each rank sends its own share of the prompts."""
    from tests.unit.test_rl_composer import TINY, _prompts, _run

    arch = ["--model", "tiny", "--vocab-size", "32", "--seq-length", "64"]
    assert TINY[:6] == arch
    # --speculation always: 'auto' decodes a batch plainly when it measures no gain, and then logs no acceptance
    with _serve_subprocess(*arch, "--speculation", "always") as (_, url):
        logs, weights = str(tmp_path / "logs"), str(tmp_path / "weights")
        p = _run(TINY + ["--rl-prompts", _prompts(tmp_path, 4), "--rl-log-dir", logs, "--train-iters", "2",
                         "--rl-remote-servers", url, "--rl-remote-weights-dir", weights, "--rl-routing-replay",
                         *extra], nproc=nproc)
        trained = [json.loads(x) for x in open(os.path.join(logs, "trained_groups.jsonl"))]
        assert [r["step"] for r in trained] == [1, 1, 2, 2]
        assert all(r["policy_versions"] == [r["step"] - 1] for r in trained)  # the server's tokens, its version
        assert RemoteGenerate([url]).versions() == {url: 2}  # the weights after the last step
        assert os.listdir(weights) == ["v2"]  # older versions removed
        agreement = [float(x.split("routing replay agreement: ")[1].split(" ")[0])
                     for x in p.stdout.splitlines() if "routing replay agreement" in x]
        assert len(agreement) == 2 and min(agreement) > 0.99  # the server routed as the trainer's weights do
        acceptance = [x for x in p.stdout.splitlines() if " iteration " in x and "mtp acceptance" in x]
        assert len(acceptance) == (2 if extra else 0)


def test_async_orchestrator_over_remote_servers_requeues_a_killed_servers_prompts(fleet):
    """The asynchronous orchestrator with RemoteFleet: 2 request slots on each of two servers (one in-process, one a
    tools/serve.py process SIGKILLed after the first step). Every prompt is trained once, every trained token's
    version (as the servers report it) is within --rl-max-staleness of its step, the dead server's prompts are
    requeued on the live one, and each publication reaches the live server by path."""
    from megatron_ext.rl.env import VOCAB, DigitEnv, digit_tasks
    from megatron_ext.rl.ledger import Ledger
    from megatron_ext.rl.orchestrator import Orchestrator, OrchestratorConfig
    from megatron_ext.rl.remote_fleet import RemoteFleet
    from megatron_ext.rl.rollout import EpisodeConfig
    from megatron_ext.rl.workers import WorkerConfig

    urls, _, jobs, save = fleet
    K, P = 1, 2
    tasks = digit_tasks("train", 10, seed=7)
    sampling = Sampling(max_tokens=6, temperature=1.0, stop_token_ids=(VOCAB.eos,))
    cfg = WorkerConfig(EpisodeConfig(2, sampling, 1, 6), env_timeout_s=30)
    logs = []
    with _serve_subprocess("--model", "tiny") as (proc, doomed):
        RemoteGenerate([urls[0], doomed]).reload(save, 0)  # both start from the same weights, version 0
        remote = RemoteFleet([urls[0], doomed], 4, cfg, DigitEnv, path_of=lambda v: save,
                             log=lambda *a, **k: logs.append(a[0]))
        assert remote.server_of == [urls[0], doomed, urls[0], doomed]
        ledger = Ledger([t["id"] for t in tasks])
        ocfg = OrchestratorConfig(P, K, prompts_per_request=1, requests_per_worker=1, poll_s=0.01)
        orch = Orchestrator(ocfg, remote, ledger, {t["id"]: t for t in tasks}, version=0, weights=dict,
                            log=lambda *a, **k: None)
        before = jobs[0][0]
        trained, metrics, step = [], [], 0
        try:
            while (out := orch.next_batch(step)) is not None:
                groups, m = out
                metrics.append(m)
                for g in groups:
                    assert len(g.rollouts) == 2
                    for r in g.rollouts:
                        assert r.versions and all(0 <= step - v <= K for v in r.versions), (step, r.versions)
                    trained.append(g.prompt_id)
                step += 1
                stats = orch.publish(step)
                if step == 1:  # mid-run: publish dispatched step 2's prompts, some to each server
                    assert doomed in [remote.server_of[f.worker] for f in orch.inflight.values()]
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
                assert stats["publish bytes"] > 0
                assert RemoteGenerate([urls[0]]).versions() == {urls[0]: step}
        finally:
            remote.close()
    assert sorted(trained) == sorted(t["id"] for t in tasks)  # each prompt once, none dropped
    assert step == 5 and max(m["staleness max"] for m in metrics) <= K
    assert sum(m["requeued prompts"] for m in metrics) >= 1
    assert remote.dead == {doomed} and remote.server_of == [urls[0]] * 4
    assert any(f"remote server {doomed} is down" in line for line in logs)
    assert jobs[0][0] - before >= 2 * len(tasks) // 2  # the live server generated at least its share


@pytest.mark.slow  # 23 s; the asynchronous orchestrator over remote servers stays in the default suite (above)
def test_rl_composer_async_over_remote_servers(tmp_path, capsys):
    """rl_composer.py --rl-remote-servers URL --rl-rollout-workers 2 --rl-max-staleness 1: the asynchronous loop on
    a tools/serve.py server (no Ray): each prompt trained once, every trained token's version (the server's) within
    the bound, each step's weights reloaded by path."""
    from megatron_ext.rl.env import digit_tasks
    from megatron_ext.rl.ledger import trained_counts
    from tests.unit.test_rl_composer import TINY, _prompts, _run

    with _serve_subprocess(*TINY[:6]) as (_, url):
        logs, weights = str(tmp_path / "logs"), str(tmp_path / "weights")
        p = _run(TINY + ["--rl-prompts", _prompts(tmp_path, 6), "--rl-log-dir", logs, "--train-iters", "100",
                         "--rl-remote-servers", url, "--rl-remote-weights-dir", weights,
                         "--rl-rollout-workers", "2", "--rl-max-staleness", "1"])
        assert "asynchronous RL: 2 rollout workers over 1 remote server(s), --rl-max-staleness 1" in p.stdout
        assert "all 6 prompts of --rl-prompts trained once: stopping at iteration 3" in p.stdout
        assert trained_counts(logs) == {t["id"]: 1 for t in digit_tasks("train", 6, seed=7)}
        trained = [json.loads(x) for x in open(os.path.join(logs, "trained_groups.jsonl"))]
        assert [r["step"] for r in trained] == [1, 1, 2, 2, 3, 3]
        assert all(r["step"] - 2 <= v <= r["step"] - 1 for r in trained for v in r["policy_versions"]), trained
        staleness = [float(x.split("staleness max: ")[1].split()[0]) for x in p.stdout.splitlines()
                     if "staleness max" in x]
        assert len(staleness) == 3 and max(staleness) <= 1
        assert RemoteGenerate([url]).versions() == {url: 3} and os.listdir(weights) == ["v3"]
    import rl_composer  # its flag checks, in this process: they run before any process group

    assert rl_composer.main(TINY + ["--rl-prompts", _prompts(tmp_path, 2), "--rl-remote-servers",
                                    "http://127.0.0.1:1", "--rl-remote-weights-dir", weights,
                                    "--rl-rollout-workers", "2", "--ray-address", "auto"]) == 2
    assert "drop --ray-address" in capsys.readouterr().err
