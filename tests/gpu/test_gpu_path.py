"""Issue 27's GPU checks (tests/gpu/run.sh runs them step by step on one GPU; skipped elsewhere): kernels that
import, every tensor on the GPU after the build, the TE config of every preset, TE vs local parity on identical
weights (loss and every gradient), and one K2.5-width MoE layer's activation memory per token for the planner."""


import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from megatron_ext import platform  # noqa: E402
from megatron_ext.arguments import parse_args  # noqa: E402
from megatron_ext.training.initialize import destroy, initialize_distributed  # noqa: E402

needs_te = pytest.mark.skipif(not platform.te_available(), reason="Transformer Engine is not installed")
IMPLS = ["local", pytest.param("transformer_engine", marks=needs_te)]


def test_versions_and_kernels():
    """One line per optional kernel, so the log says which fast paths this machine has."""
    import importlib

    found = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
             "capability": ".".join(map(str, torch.cuda.get_device_capability()))}
    for name in ("transformer_engine", "megatron.core", "fla", "deep_ep", "apex"):
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "present")
        except Exception as e:  # noqa: BLE001 (any import failure means: not usable here)
            found[name] = f"absent ({type(e).__name__})"
    found["apex fused_weight_gradient_mlp_cuda"] = platform.grad_accum_fusion_kernel()
    from megatron.core.transformer.moe import moe_utils

    found["TE fused permute"] = getattr(moe_utils, "fused_permute", None) is not None
    for key, value in found.items():
        print(f"KERNEL {key}: {value}")
    assert found["megatron.core"] != "absent"


@pytest.mark.parametrize("impl", IMPLS)
def test_every_tensor_is_on_the_gpu_after_the_build(impl):
    from megatron_ext.training.step import build_model

    args = parse_args(["--model", "tiny", "--transformer-impl", impl, "--bf16"], world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)[0]
        tensors = dict(model.named_parameters())
        tensors.update(model.named_buffers())
        host = sorted(n for n, t in tensors.items() if t.device.type != "cuda")
        assert not host, f"{len(host)} of {len(tensors)} not on cuda: {host[:8]}"
    finally:
        destroy()


@needs_te
@pytest.mark.parametrize("preset", ["tiny", "tiny-no-qlora", "tiny-kimi-linear", "kimi-k2.5", "kimi-linear-48b"])
def test_te_config_builds_for_every_preset(preset):
    """MLATransformerConfig's own checks with the real TE (RoPE fusion only for YaRN); small presets are built."""
    from megatron_ext.models.provider import model_provider, transformer_config

    args = parse_args(["--model", preset, "--transformer-impl", "transformer_engine", "--bf16"], world_size=1)
    config = transformer_config(args)
    assert config.apply_rope_fusion == (args.arch.rope_type == "yarn")
    if preset.startswith("tiny"):
        initialize_distributed(args)
        try:
            model_provider(args, config=config)
        finally:
            destroy()


def _loss_and_grads(impl: str, bf16: bool, tokens: torch.Tensor):
    from megatron_ext.testing import init_layout_invariant_
    from megatron_ext.training.step import build_model

    flags = ["--model", "tiny", "--transformer-impl", impl, "--mtp-num-layers", "0", "--num-experts", "0"]
    args = parse_args(flags + (["--bf16"] if bf16 else []), world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)[0]
        init_layout_invariant_(model, seed=5)  # the same values under both key layouts (models/te_layout.py)
        pos = torch.arange(tokens.size(1), device="cuda").expand_as(tokens)
        loss = model(tokens, pos, None, labels=tokens.roll(-1, 1)).float().mean()
        loss.backward()
        from megatron_ext.testing import gather_full_gradients

        return float(loss), {k: g.float().cpu() for k, g in gather_full_gradients(model).items()}
    finally:
        destroy()


@needs_te
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_te_and_local_agree_on_loss_and_every_gradient(bf16):
    """Identical weights under both backends. NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1 (run.sh) makes TE print which
    attention backend it picks for MLA's 192/128 query/value head dims."""
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    local_loss, local = _loss_and_grads("local", bf16, tokens)
    te_loss, te = _loss_and_grads("transformer_engine", bf16, tokens)
    tol = 2e-2 if bf16 else 1e-4
    print(f"PARITY {'bf16' if bf16 else 'fp32'} loss local {local_loss:.6f} te {te_loss:.6f}")
    assert te_loss == pytest.approx(local_loss, rel=tol)
    assert te.keys() == local.keys()
    worst = max(((te[k] - local[k]).norm() / local[k].norm().clamp_min(1e-12)).item() for k in local)
    print(f"PARITY {'bf16' if bf16 else 'fp32'} worst relative gradient difference {worst:.2e}")
    bad = [k for k in local if (te[k] - local[k]).norm() > (5 * tol) * local[k].norm().clamp_min(1e-12)]
    assert not bad, bad[:5]


def test_k25_width_moe_layer_activation_memory_per_token():
    """One K2.5-width MoE layer (hidden 7168, experts of 2048, top-8 of 48: one EP8 rank's experts) on 4096
    tokens: measured activation bytes per token next to the planner's, to calibrate planning.py."""
    from megatron_ext import planning
    from megatron_ext.models.presets import KIMI_K2_5
    from megatron_ext.training.step import build_model

    flags = ["--model", "tiny", "--bf16", "--num-layers", "1", "--first-k-dense-replace", "0", "--hidden-size", "7168",
             "--num-attention-heads", "64", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
             "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--num-experts", "48", "--moe-router-topk", "8",
             "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size", "2048", "--mtp-num-layers", "0",
             "--seq-length", "4096", "--max-position-embeddings", "4096"]
    if platform.te_available():
        flags += ["--transformer-impl", "transformer_engine"]
    args = parse_args(flags, world_size=1)
    initialize_distributed(args)
    try:
        model = build_model(args, wrap_ddp=False)[0]
        tokens = torch.randint(0, 1000, (1, 4096), device="cuda")
        pos = torch.arange(4096, device="cuda").unsqueeze(0)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(tokens, pos, None, labels=tokens).float().mean()
        after_forward = torch.cuda.memory_allocated()
        loss.backward()
        peak = torch.cuda.max_memory_allocated()
        per_token_saved = (after_forward - before) / 4096
        per_token_peak = (peak - before) / 4096
        shape = planning.ModelShape(KIMI_K2_5.replace(num_experts=48))
        planned = shape.activation_bytes(True, "none", 1)
        print(f"MOE-LAYER saved {per_token_saved / 1024:.1f} KiB/token, peak {per_token_peak / 1024:.1f} KiB/token, "
              f"planner {planned / 1024:.1f} KiB/token (layer only; the logits of the small vocabulary add a little)")
        assert 0.5 * planned < per_token_saved < 2.0 * planned
    finally:
        destroy()
