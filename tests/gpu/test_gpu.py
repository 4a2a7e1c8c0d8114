"""Checks that need a CUDA GPU (tests/gpu/run.sh runs them on one; skipped elsewhere): bf16 training on the GPU,
resume, HF import/export and engine greedy decoding against transformers on the same weights, the server, and
with Transformer Engine its backend, the checkpoint layout shared with the local backend, and FP8.

Each test runs in-process on a one-rank NCCL group, as `python pretrain_composer.py` does."""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import pretrain_composer as entry  # noqa: E402
from megatron_ext import platform  # noqa: E402
from tests.tb import scalars  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
        "--seq-length", "64", "--log-interval", "10"]
needs_te = pytest.mark.skipif(not platform.te_available(), reason="Transformer Engine is not installed")


def _train(tmp_path, name, *flags):
    tb = str(tmp_path / f"tb_{name}")
    code = entry.main(TINY + ["--tensorboard-dir", tb, *flags])
    assert code == 0, f"{name}: exit code {code}"
    return scalars(tb)["lm loss"]


def test_the_gpu_path_is_taken():
    assert not platform.bridge_needed() and not platform.is_bridged()
    assert platform.device().type == "cuda" and platform.dist_backend() == "nccl"


def test_bf16_training_loss_falls_on_the_gpu(tmp_path):
    torch.cuda.reset_peak_memory_stats()
    loss = _train(tmp_path, "bf16", "--bf16", "--train-iters", "100")
    assert torch.cuda.max_memory_allocated() > 0  # the model and its batches lived on the GPU
    # the same run on the CPU (bf16, 2026-12-04): 6.92 over iterations 1-10, 6.10 over 91-100; on the H200 the
    # first 40 iterations matched it (6.755 vs 6.750 over 31-40), where 40 iterations had been asked to fall by 1.0
    first = sum(loss[i] for i in range(1, 11)) / 10
    last = sum(loss[i] for i in range(91, 101)) / 10
    assert last < first - 0.5, (first, last)


def test_resume_continues_the_run(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["--train-iters", "8", "--lr-warmup-iters", "2"]
    full = _train(tmp_path, "full", *common)
    _train(tmp_path, "first", *common, "--save", save, "--save-interval", "4", "--exit-interval", "4")
    resumed = _train(tmp_path, "resumed", *common, "--save", save, "--load", save)
    assert set(resumed) == {5, 6, 7, 8}
    for it in resumed:  # GPU kernels (atomics in embedding backward) are not bit-reproducible
        assert resumed[it] == pytest.approx(full[it], rel=1e-3), it


def _hf_import(tmp_path):
    from megatron_ext.convert.streaming import import_hf
    from megatron_ext.training.initialize import destroy
    from tests.parity.hf_fixtures import make_hf_model, save_hf

    hf = make_hf_model("qlora_groups").float().eval()
    hf_dir = save_hf(hf, str(tmp_path / "hf"))
    save = str(tmp_path / "mg")
    import_hf(hf_dir, save, log=lambda *a, **k: None)
    destroy()
    return hf, hf_dir, save


def _megatron_model(hf_dir, save, extra=()):
    from megatron_ext.arguments import parse_args
    from megatron_ext.convert.hf import preset_from_config, read_config
    from megatron_ext.training.checkpointing import load_checkpoint
    from megatron_ext.training.initialize import initialize_distributed
    from megatron_ext.training.step import build_model

    arch = preset_from_config(read_config(hf_dir)[1])
    args = parse_args(["--model", "tiny", "--mock-data", "--load", save, *extra], world_size=1, base_arch=arch)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False)
    load_checkpoint(args, model, None, None, log=lambda *a, **k: None)
    return args, model[0].eval()


@pytest.mark.parametrize("impl", ["local", pytest.param("transformer_engine", marks=needs_te)])
def test_hf_import_export_and_engine_greedy_equals_transformers_generate(tmp_path, impl):
    """Under TE the engine must read the norms TE fuses into linear_q_up_proj / linear_kv_up_proj / a dense
    layer's linear_fc1 (`layer_norm_weight`), and TE's grouped experts."""
    from megatron_ext.convert.streaming import export_hf
    from megatron_ext.inference.engine import InferenceEngine, SamplingParams
    from megatron_ext.training.initialize import destroy
    from tests.parity.hf_fixtures import all_tensors

    hf, hf_dir, save = _hf_import(tmp_path)
    try:
        args, model = _megatron_model(hf_dir, save, ["--transformer-impl", impl])
        assert next(model.parameters()).device.type == "cuda"
        prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            pos = torch.arange(12, device="cuda").unsqueeze(0)
            ours = model(prompt.cuda(), pos, None)[..., :hf.config.vocab_size].float().cpu()
        hf = hf.cuda()
        with torch.no_grad():
            ref = hf(prompt.cuda()).logits.float().cpu()
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-3
        engine = InferenceEngine(model)
        got = engine.generate([prompt[0].tolist()], SamplingParams(max_tokens=16, temperature=0.0))[0].token_ids
        want = hf.generate(prompt.cuda(), do_sample=False, max_new_tokens=16, min_new_tokens=16)[0, 12:].tolist()
        assert got == want
    finally:
        destroy()
    out = str(tmp_path / "hf_out")
    export_hf(save, out, log=lambda *a, **k: None)
    destroy()
    a, b = all_tensors(hf_dir), all_tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_server_answers_on_the_gpu():
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-u", "tools/serve.py", "--model", "tiny",
                             "--random-weights", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, deadline = [], time.time() + 180
        while time.time() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "serving" in line or not line:
                break
        assert "serving" in lines[-1], "".join(lines[-20:])
        url = lines[-1].strip().split(" on ")[1]
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"prompt": [1, 2, 3],
                                                                                 "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        assert len(body["choices"][0]["token_ids"]) == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@needs_te
@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["adam", "distributed"])
def test_transformer_engine_backend_trains(tmp_path, optimizer):
    loss = _train(tmp_path, "te", "--transformer-impl", "transformer_engine", "--bf16", "--train-iters", "10",
                  "--log-interval", "1", *optimizer)
    assert all(v == v for v in loss.values()) and loss[10] < loss[1] - 0.3, (loss[1], loss[10])


@needs_te
def test_te_grouped_gemm_with_overlap_and_recomputation_saves_and_resumes(tmp_path):
    flags = ["--transformer-impl", "transformer_engine", "--bf16", "--moe-grouped-gemm", "--moe-permute-fusion",
             "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
             "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "moe_act", "layernorm",
             "--train-iters", "10", "--lr-warmup-iters", "2"]
    save = str(tmp_path / "ckpt")
    full = _train(tmp_path, "te_grouped", *flags)
    _train(tmp_path, "te_grouped_first", *flags, "--save", save, "--save-interval", "5", "--exit-interval", "5")
    resumed = _train(tmp_path, "te_grouped_resumed", *flags, "--save", save, "--load", save)
    assert full[10] < full[1] - 0.3, (full[1], full[10])
    assert set(resumed) == {6, 7, 8, 9, 10}
    for it in resumed:  # the overlapped parameter gather is forced before the save (issue 27 item 6)
        assert resumed[it] == pytest.approx(full[it], rel=1e-3), it


@needs_te
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_fp8_trains_or_is_refused_by_name(tmp_path, recipe):
    from megatron_ext import gpu

    problem = gpu.fp8_support_error(recipe, gpu.compute_capability())
    flags = ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe,
             "--train-iters", "10"]
    if problem:
        assert entry.main(TINY + flags) == 2  # refused up front, naming the flag
        return
    loss = _train(tmp_path, f"fp8_{recipe}", *flags)
    assert all(v == v for v in loss.values()) and loss[10] < loss[1], (loss[1], loss[10])


@needs_te
def test_a_local_checkpoint_loads_under_transformer_engine_and_back(tmp_path):
    """The TE layout shared by both backends (models/te_layout.py): same weights, same losses, both ways."""
    from megatron_ext.arguments import parse_args
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron_ext.training.initialize import destroy, initialize_distributed
    from megatron_ext.training.step import build_model

    args = parse_args(["--model", "tiny", "--no-save-optim", "--transformer-impl", "local"], world_size=1)
    initialize_distributed(args)
    try:
        tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()

        def losses(model):
            model.eval()
            with torch.no_grad():
                pos = torch.arange(32, device="cuda").expand_as(tokens)
                return model(tokens, pos, None, labels=tokens.roll(-1, 1)).float()

        local = build_model(args, wrap_ddp=False)
        init_layout_invariant_(local[0], seed=3)
        save_checkpoint(argparse.Namespace(**{**vars(args), "save": str(tmp_path / "local")}), 1, local, None, None)
        te_args = argparse.Namespace(**{**vars(args), "transformer_impl": "transformer_engine", "finetune": True,
                                        "load": str(tmp_path / "local"), "save": str(tmp_path / "te")})
        te = build_model(te_args, wrap_ddp=False)
        load_checkpoint(te_args, te, None, None, log=lambda *a, **k: None)
        assert torch.allclose(losses(te[0]), losses(local[0]), rtol=1e-3, atol=1e-3)
        save_checkpoint(te_args, 2, te, None, None)
        back_args = argparse.Namespace(**{**vars(args), "load": str(tmp_path / "te"), "finetune": True})
        back = build_model(back_args, wrap_ddp=False)
        load_checkpoint(back_args, back, None, None, log=lambda *a, **k: None)
        assert torch.equal(losses(back[0]), losses(local[0]))
    finally:
        destroy()


def test_decode_speed_against_transformers_on_the_gpu(tmp_path):
    """Issue 32's (a) on the GPU: our engine's greedy decoding ÷ transformers `generate` on the same weights (fp32,
    batch 1, both on the GPU), which must produce the same tokens, with the one-row weight-read floor timed with
    synchronisation; the benchmark's line goes into the summary (DECODE)."""
    from tests.unit.data_fixtures import load_tool

    bench = load_tool("decode_throughput", "benchmarks")
    opts = bench.parser().parse_args(["--only", "a", "--tokens", "64", "--repeats", "3"])
    line, figure = bench.versus_transformers(opts, str(tmp_path))
    print("DECODE " + line, flush=True)
    assert "same tokens: True" in line, line
    assert figure.lo > 0 and "weight-read floor" in line


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rl_composer_trains_on_the_gpu(tmp_path, precision):
    """rl_composer.py's synchronous GRPO on the GPU (no Ray: the trainer samples with its own engine between
    steps), with routing replay: the digit task, 3 steps of 2 prompts x 4 samples; every prompt trained once, the
    rewards parsed from the sampled tokens, log-probabilities <= 0, and the sampler's log-probabilities against
    the trainer's (mismatch_max; fp32: within 1e-3, bf16 printed) with the replayed experts the trainer's own."""
    from megatron_ext.rl.env import digit_tasks, write_prompts

    prompts, logs = str(tmp_path / "prompts.jsonl"), str(tmp_path / "logs")
    write_prompts(prompts, digit_tasks("train", 6, seed=7))
    flags = ["--model", "tiny", "--vocab-size", "32", "--seq-length", "64", "--micro-batch-size", "4",
             "--grpo-group-size", "4", "--grpo-prompts-per-step", "2", "--grpo-max-response-length", "8",
             "--lr", "1e-3", "--rl-prompts", prompts, "--rl-log-dir", logs, "--train-iters", "10",
             "--rl-routing-replay"] + (["--bf16"] if precision == "bf16" else [])
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-W", "ignore", "rl_composer.py", *flags], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "all 6 prompts of --rl-prompts trained once: stopping at iteration 3" in p.stdout, p.stdout[-3000:]
    steps = [line for line in p.stdout.splitlines() if "mismatch_max" in line]
    mismatch = [float(line.split("mismatch_max: ")[1].split()[0]) for line in steps]
    agreement = [float(line.split("routing replay agreement: ")[1].split()[0]) for line in steps]
    print(f"RL-GPU {precision}: mismatch_max {max(mismatch):.2e}, routing replay agreement {min(agreement):.4f}")
    assert len(steps) == 3
    if precision == "fp32":
        assert max(mismatch) < 1e-3 and min(agreement) > 0.999
    trained = [json.loads(line) for line in open(os.path.join(logs, "trained_groups.jsonl"))]
    assert sorted(r["prompt_id"] for r in trained) == sorted(t["id"] for t in digit_tasks("train", 6, seed=7))
    rollouts = [json.loads(line) for line in open(os.path.join(logs, "rollouts.jsonl"))]
    assert len(rollouts) == 24 and all(lp <= 0 for r in rollouts for lp in r["logprobs"])
    assert all(r["reward_error"] is None and "exact" in r["reward_parts"] for r in rollouts)
