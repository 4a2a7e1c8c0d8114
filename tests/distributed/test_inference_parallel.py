"""Generation with the model split over tensor- or expert-parallel gloo ranks equals one-rank generation.

Every layout starts from the same layout-invariant weights (megatron_ext.testing); each rank runs the same
requests on its shard and must return exactly what the other ranks return, and what one rank holding the whole
model returns (token ids equal, log-probabilities within 1e-5 in fp32).
"""

import json
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.harness import _free_port, invariant_model, join

BASE = ["--model", "tiny", "--mock-data", "--seed", "5"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "ep2": ["--expert-model-parallel-size", "2"],
}
PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 97], [93, 238, 46, 264, 338]]


def _requests(engine):
    """Every request kind the engine serves; returns JSON-able results."""
    from megatron_ext.inference.engine import SamplingParams
    from megatron_ext.inference.speculative import SpeculationStats, generate_speculative

    def pack(completions):
        return [{"ids": c.token_ids, "logprobs": c.logprobs, "sampled_logprobs": c.sampled_logprobs,
                 "routing": c.routing.tolist() if c.routing is not None else None} for c in completions]

    stats = SpeculationStats()
    return {
        "greedy_batch": pack(engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0,
                                                                     return_routing=True))),
        "sampled_seeded": pack(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=8, top_k=20, seed=3))),
        "sampled_unseeded": pack(engine.generate(PROMPTS[:1], SamplingParams(max_tokens=8))),
        "speculative_greedy": pack([generate_speculative(engine, p, SamplingParams(max_tokens=8, temperature=0.0),
                                                         stats) for p in PROMPTS]),
        "speculative_sampled": pack([generate_speculative(engine, PROMPTS[0],
                                                          SamplingParams(max_tokens=8, seed=4, return_routing=True))]),
        "groups": pack([c for g in engine.generate_groups(PROMPTS[1:], 2, SamplingParams(
            max_tokens=6, temperature=0.9, top_p=0.9, seed=6, return_routing=True)) for c in g]),
        "teacher_forced": engine.forward(torch.tensor([PROMPTS[0]]), torch.arange(len(PROMPTS[0])).unsqueeze(0),
                                         engine.new_cache(len(engine.layers), 1, 16), torch.tensor([0]))[0].tolist(),
    }


def _worker(rank: int, world: int, port: int, flags: list[str], out_dir: str):
    join(rank, world, port)
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.training.initialize import destroy

    _, model = invariant_model(flags, world, seed=2)
    torch.manual_seed(1000 + rank)  # ranks' global generators drift apart in real jobs; requests must not care
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(_requests(InferenceEngine(model)), f)
    destroy()


def _run(flags: list[str], world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, _free_port(), flags, tmp), nprocs=world, join=True,
                           start_method="spawn")
        results = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                results.append(json.load(f))
        return results


@pytest.fixture(scope="module")
def reference():
    return _run(BASE, world=1)[0]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parallel_generation_matches_one_rank(layout, reference):
    ranks = _run(BASE + LAYOUTS[layout], world=2)
    assert ranks[0] == ranks[1], "ranks of one model-parallel group returned different results"
    got = ranks[0]
    torch.testing.assert_close(torch.tensor(got["teacher_forced"]), torch.tensor(reference["teacher_forced"]),
                               rtol=1e-5, atol=1e-5)
    for kind in ("greedy_batch", "sampled_seeded", "speculative_greedy", "speculative_sampled", "groups"):
        for mine, want in zip(got[kind], reference[kind], strict=True):
            assert mine["ids"] == want["ids"], kind
            assert mine["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), kind
            assert mine["sampled_logprobs"] == pytest.approx(want["sampled_logprobs"], abs=1e-5), kind
            assert mine["routing"] == want["routing"], kind
    for spec, plain in zip(got["speculative_greedy"], got["greedy_batch"], strict=True):
        assert spec["ids"] == plain["ids"]
        assert spec["logprobs"] == pytest.approx(plain["logprobs"], abs=1e-5)
    # without a seed each request draws one; the ranks agreed on it (results compared equal above)
    assert len(got["sampled_unseeded"][0]["ids"]) == 8


def _serving_worker(rank: int, world: int, port: int, flags: list[str], out_dir: str):
    join(rank, world, port)
    import urllib.error
    import urllib.request

    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.inference.reload import CheckpointReload
    from megatron_ext.inference.server import ModelParallelServing, ModelService, serve
    from megatron_ext.training.initialize import destroy

    args, model = invariant_model(flags, world, seed=2)
    reloader = CheckpointReload(args, model)
    reloader.validate = lambda path: path  # the checks themselves are tested on one rank (tests/unit/test_server.py)

    def load(path):  # rank 0 overwrites its weights as a load does; rank 1 fails on "bad"
        if path == "bad" and rank == 1:
            raise OSError("rank one's disk failed")
        if path == "bad":
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()

    reloader.load = load
    service = ModelService(InferenceEngine(model), "tiny", reload=reloader, peers=ModelParallelServing(heartbeat=0.2))
    if rank != 0:
        service.peers.follow(service)
        destroy()
        return
    server = serve(service, "127.0.0.1", 0)
    service.peers.keep_alive(service)
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def post(body, path="/v1/completions"):
        request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    greedy = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "logprobs": 1}
    results = {"first": post(greedy)}
    import time

    time.sleep(0.6)  # idle: heartbeats keep the other rank in step
    results["bad"] = post({"prompt": [10 ** 9], "max_tokens": 4})  # an id outside the vocabulary: 400
    results["sampled"] = post({"prompt": PROMPTS[1], "max_tokens": 6})  # unseeded: the ranks agree on a seed
    results["speculative"] = post(dict(greedy, speculative=True))
    results["n"] = post(dict(greedy, n=2, temperature=1.0, seed=3))
    results["n_alone"] = [post(dict(greedy, temperature=1.0, seed=3 + j)) for j in range(2)]
    results["reload_bad"] = post({"load": "bad"}, "/v1/reload")  # fails on rank 1 only: reported, all restore
    results["after_bad"] = post(greedy)
    results["reload_good"] = post({"load": "good"}, "/v1/reload")
    results["again"] = post(greedy)
    server.shutdown()
    service.peers.stop(service)
    with open(os.path.join(out_dir, "served.json"), "w") as f:
        json.dump(results, f)
    destroy()


def test_tensor_parallel_server_serves_what_one_rank_generates(reference):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_serving_worker, args=(2, _free_port(), BASE + LAYOUTS["tp2"], tmp), nprocs=2,
                           join=True, start_method="spawn")
        with open(os.path.join(tmp, "served.json")) as f:
            results = json.load(f)
    want = reference["greedy_batch"][0]
    for key in ("first", "speculative", "after_bad", "again"):
        status, body = results[key]
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == want["ids"], key
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"], abs=1e-5), key
    status, body = results["reload_bad"]
    assert status == 500 and "rank 1: OSError: rank one's disk failed" in body["error"]["message"]
    assert results["after_bad"][1]["weights_version"] == 0
    assert results["reload_good"] == [200, {"status": "ok", "weights_version": 1, "load": "good"}]
    assert results["again"][1]["weights_version"] == 1
    assert [c["token_ids"] for c in results["n"][1]["choices"]] == [
        r[1]["choices"][0]["token_ids"] for r in results["n_alone"]]
    assert results["bad"][0] == 400 and "outside the vocabulary" in results["bad"][1]["error"]["message"]
    assert results["sampled"][0] == 200 and len(results["sampled"][1]["choices"][0]["token_ids"]) == 6


def _kernel_worker(rank: int, world: int, port: int, flags: list[str], out_dir: str):
    """Rank 0 finds oneDNN slow, rank 1 torch's BLAS (each slowed by 2 ms a call): alone they would choose
    differently; the engine makes them agree."""
    import time

    import torch.nn.functional as F

    from megatron_ext import platform
    from megatron_ext.inference.engine import InferenceEngine
    from megatron_ext.training.initialize import destroy

    join(rank, world, port)
    _, model = invariant_model(flags, world, seed=2)
    platform.ONEDNN_LINEAR_MIN_BYTES = 0  # the tiny model's weights are all below the real threshold
    if rank == 0:
        real = torch.ops.mkldnn._linear_pointwise
        torch.ops.mkldnn._linear_pointwise = lambda *a: (time.sleep(2e-3), real(*a))[1]
        alone = platform.choose_cpu_linear([torch.randn(64, 64)])
        torch.ops.mkldnn._linear_pointwise = real
    else:
        real = F.linear
        F.linear = lambda *a: (time.sleep(2e-3), real(*a))[1]
        alone = platform.choose_cpu_linear([torch.randn(64, 64)])
        F.linear = real
    mine = platform.CPU_LINEAR_CHOICE
    platform.CPU_LINEAR_CHOICE = None
    if rank == 0:
        torch.ops.mkldnn._linear_pointwise = lambda *a: (time.sleep(2e-3), real(*a))[1]
    else:
        F.linear = lambda *a: (time.sleep(2e-3), real(*a))[1]
    engine = InferenceEngine(model)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"alone": mine, "agreed": platform.CPU_LINEAR_CHOICE, "note": engine.cpu_linear_note,
                   "line": alone}, f)
    destroy()


def test_tensor_parallel_ranks_agree_on_the_cpu_kernel():
    """Each rank times the CPU kernels on its own shard; ranks that would choose differently (one finds oneDNN
    faster, the other torch's BLAS) agree on torch's BLAS, so that products every rank repeats give the same
    bits on each."""
    import platform as host

    from megatron_ext import platform

    if host.machine().lower() not in ("x86_64", "amd64") or not platform.CPU_LINEAR_ONEDNN \
            or os.environ.get("MEGATRON_EXT_CPU_LINEAR", "auto") != "auto":
        pytest.skip("the kernel is measured on x86 CPUs with MEGATRON_EXT_CPU_LINEAR=auto")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_kernel_worker, args=(2, _free_port(), BASE + LAYOUTS["tp2"], tmp), nprocs=2, join=True,
                           start_method="spawn")
        ranks = []
        for rank in range(2):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    assert [r["alone"] for r in ranks] == ["blas", "onednn"], ranks
    assert [r["agreed"] for r in ranks] == ["blas", "blas"], ranks
    assert "through torch BLAS" in ranks[0]["note"]
    assert ranks[1]["note"].endswith("torch's BLAS, as another rank of its model-parallel groups chose "
                                     "(MEGATRON_EXT_CPU_LINEAR=onednn|blas fixes the choice)"), ranks[1]["note"]
