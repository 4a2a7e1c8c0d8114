"""The CPU bridge: idempotent, complete for what Megatron-Core calls, and off when CUDA is present."""

import subprocess
import sys

import torch

import megatron_ext
from megatron_ext import platform


def test_install_is_idempotent():
    assert platform.install() == platform.is_bridged()
    mode_count = sum(isinstance(m, platform._CudaToCpuMode) for m in platform._active_modes())
    assert platform.install() == platform.is_bridged()
    import importlib

    importlib.reload(megatron_ext)
    assert sum(isinstance(m, platform._CudaToCpuMode) for m in platform._active_modes()) == mode_count == 1


def test_cpu_choices():
    assert platform.bridge_needed()
    assert platform.device() == torch.device("cpu")
    assert platform.dist_backend() == "gloo"
    assert platform.default_transformer_impl() == "local"


def test_cuda_devices_map_to_cpu():
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.arange(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.zeros(2).cuda().device.type == "cpu"
    assert torch.zeros(2).to("cuda").device.type == "cpu"
    assert torch.zeros(2).type() == "torch.cuda.FloatTensor"
    with torch.device("cuda"):
        assert torch.empty(1).device.type == "cpu"


def test_cuda_runtime_stand_ins():
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        pass
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_rng_state_is_the_cpu_generator():
    from megatron.core.tensor_parallel import random as mrandom

    state = torch.cuda.get_rng_state()
    a = torch.rand(3)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    torch.cuda.manual_seed(5)
    b = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(2), b)


def test_te_only_branches_are_off():
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    assert multi_latent_attention.HAVE_TE is False
    assert moe_utils.te_general_gemm is None


def test_no_bridge_when_cuda_is_present():
    """With CUDA available, install() must not touch torch.cuda or Megatron-Core (checked in a fresh process)."""
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "before = torch.cuda.current_device\n"
        "from megatron_ext import platform\n"
        "assert platform.install() is False\n"
        "assert not platform.bridge_needed() and platform.dist_backend() == 'nccl'\n"
        "assert torch.cuda.current_device is before\n"
        "from torch.overrides import _get_current_function_mode_stack as s\n"
        "assert not s()\n"
        "import megatron.core.transformer.moe.moe_utils as u\n"
        "assert not hasattr(u, 'te_general_gemm')\n"
        "print('untouched')\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "untouched" in out.stdout
