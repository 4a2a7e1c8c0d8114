"""The CPU bridge: idempotent, complete for what Megatron-Core calls, and off when CUDA is present."""

import os
import subprocess
import sys
import time

import pytest
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


def test_megatron_core_is_loaded_only_when_used_and_bridged_as_soon_as_it_is():
    """Importing megatron_ext and a tool's own modules loads neither torch nor Megatron-Core (a task generator's
    `--help` starts in ~0.1 s, not ~5 s); the first import of Megatron-Core, from any module, is followed at once
    by the bridges; Megatron-Core keeps its own loader. Imported the other way round, the bridges come at once."""
    code = (
        "import sys\n"
        "import megatron_ext\n"
        "from megatron_ext.env import agent_tasks, grading\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "assert not loaded, loaded[:5]\n"
        "from megatron_ext import platform\n"
        "assert not platform.is_bridged() and 'megatron.core' not in sys.modules\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "assert platform.is_bridged()\n"
        "import torch\n"
        "assert torch.zeros(1, device='cuda').device.type == 'cpu' == torch.cuda.current_device().type\n"
        "import megatron.core as core\n"
        "assert core.__loader__ is core.__spec__.loader and type(core.__loader__).__name__ == 'SourceFileLoader'\n"
        "assert not any(type(f).__name__ == '_AfterImport' for f in sys.meta_path)\n"
        "print('lazy ok')\n"
    )
    first = ("import megatron.core.parallel_state, sys\n"
             "import megatron_ext\n"
             "from megatron_ext import platform\n"
             "import torch\n"
             "assert platform.is_bridged() and torch.zeros(1, device='cuda').device.type == 'cpu'\n"
             "print('eager ok')\n")
    for snippet, said in ((code, "lazy ok"), (first, "eager ok")):
        env = {k: v for k, v in os.environ.items() if k != "MEGATRON_EXT_FORCE_CPU"}
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", snippet], capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0 and said in out.stdout, out.stderr[-3000:]


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


def test_no_cuda_bridge_when_cuda_is_present():
    """With CUDA but without Transformer Engine and apex (checked in a fresh process): torch.cuda untouched and no
    device mode, but the TE bridge is on (the router's `te_general_gemm` NameError) and one line says which fast
    paths are off."""
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "before = torch.cuda.current_device\n"
        "from megatron_ext import platform\n"
        "assert platform.install() is False\n"
        "assert platform.install() is False\n"
        "assert not platform.bridge_needed() and platform.dist_backend() == 'nccl'\n"
        "assert torch.cuda.current_device is before\n"
        "from torch.overrides import _get_current_function_mode_stack as s\n"
        "assert not s()\n"
        "import megatron.core.transformer.moe.moe_utils as u\n"
        "import megatron.core.transformer.multi_latent_attention as m\n"
        "assert u.te_general_gemm is None and m.HAVE_TE is False\n"
        "print('untouched')\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "untouched" in out.stdout
    notes = [line for line in out.stdout.splitlines() if "fast paths off" in line]
    assert len(notes) == 1, out.stdout
    assert "without Transformer Engine and apex" in notes[0] and "FP8" in notes[0] and "fused Adam" in notes[0]


def test_bridges_keyed_on_what_is_missing():
    assert platform.needed_bridges(cuda=True, te=True, apex=True) == []
    assert platform.needed_bridges(cuda=True, te=False, apex=True) == ["te"]
    assert platform.needed_bridges(cuda=True, te=True, apex=False) == []
    assert platform.needed_bridges(cuda=True, te=False, apex=False) == ["te", "torch_optimizer"]
    # without a usable GPU, installed TE/apex count as missing too
    assert platform.needed_bridges(cuda=False, te=True, apex=True) == ["cuda", "te", "torch_optimizer"]
    assert "fused Adam (torch's AdamW steps)" not in platform.fast_paths_off(te=False, apex=True)
    assert platform.fast_paths_off(te=True, apex=True) == []


def test_force_cpu_takes_the_cpu_path_everywhere():
    """MEGATRON_EXT_FORCE_CPU=1 on a GPU machine with TE installed: CPU device, gloo, local backend, TE refused,
    every bridge on (checked in a fresh process with CUDA and TE pretended present)."""
    code = (
        "import importlib.util, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: object() if n == 'transformer_engine' else real(n, *a)\n"
        "from megatron_ext import platform\n"
        "assert platform.install() is True and platform.te_installed()\n"
        "assert platform.device() == torch.device('cpu') and platform.dist_backend() == 'gloo'\n"
        "assert not platform.te_available() and platform.default_transformer_impl() == 'local'\n"
        "assert torch.zeros(1, device='cuda').device.type == 'cpu'\n"
        "from megatron_ext.arguments import parse_args, ArgumentError\n"
        "try:\n"
        "    parse_args(['--transformer-impl', 'transformer_engine'], world_size=1)\n"
        "except ArgumentError as e:\n"
        "    print('refused:', e)\n"
    )
    env = dict(os.environ, MEGATRON_EXT_FORCE_CPU="1")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert "refused: --transformer-impl transformer_engine needs" in out.stdout


def _thread_counts(code: str) -> list[int]:
    """Runs `code` in a fresh process with two intra-op threads; the counts it printed after 'threads'."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert out.returncode == 0, out.stderr[-3000:]
    return [int(x) for x in out.stdout.split("threads")[1].split()]


def test_one_rank_object_collectives_match_torchs_and_stay_in_the_callers_thread():
    """The bridged object collectives of a one-rank group give what torch's give (copies, not the objects),
    without the process group's worker threads; groups of several ranks still go to torch."""
    import torch.distributed as dist

    names = ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list")
    assert all(getattr(getattr(dist, n), "_megatron_ext_bridge", False) for n in names)
    code = (
        "import os, torch, torch.distributed as dist\n"
        "from megatron_ext import platform\n"
        "platform.install()\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29500 + os.getpid() % 1000))\n"
        "dist.init_process_group.__wrapped__('gloo', rank=0, world_size=1)  # its workers not given one thread\n"
        "obj = {'a': [1, 2], 't': torch.arange(3)}\n"
        "def same(x, y):\n"
        "    assert repr(x) == repr(y), (x, y)\n"
        "for fn in ('bridged', 'torch'):\n"
        "    f = (lambda n: getattr(dist, n)) if fn == 'bridged' else (lambda n: getattr(dist, n).__wrapped__)\n"
        "    a = [None]; f('all_gather_object')(a, obj); assert a[0] is not obj; same(a[0], obj)\n"
        "    g = [None]; f('gather_object')(obj, g, dst=0); assert g[0] is not obj; same(g[0], obj)\n"
        "    s = [None]; f('scatter_object_list')(s, [obj], src=0); same(s[0], obj)\n"
        "    b = [obj]; f('broadcast_object_list')(b, src=0); same(b[0], obj)\n"
        "torch.bmm(torch.randn(4, 1, 16), torch.randn(4, 16, 32))\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "big = {'x': list(range(200000))}\n"
        "for _ in range(4):\n"
        "    out = [None]; dist.all_gather_object(out, big); assert out[0] == big\n"
        "bridged = len(os.listdir('/proc/self/task'))\n"
        "for _ in range(4):\n"
        "    out = [None]; dist.all_gather_object.__wrapped__(out, big); assert out[0] == big\n"
        "print('threads', before, bridged, len(os.listdir('/proc/self/task')), flush=True)\n"
        "os._exit(0)  # gloo's worker threads can abort the interpreter's exit ('terminate called without an active "
        "exception', once in CI); the exit is not under test\n"
    )
    before, bridged, theirs = _thread_counts(code)
    assert bridged == before  # no OpenMP team started by a gloo worker thread
    assert theirs > bridged  # torch's own path through gloo does start one (what the check detects)


def test_a_checkpoint_load_leaves_one_process_runs_with_spinning_openmp_threads(tmp_path):
    """A save and two loads in one process with two intra-op threads (a test run, a benchmark, a CPU server):
    dist_checkpointing's metadata exchange no longer runs ATen copies in gloo's worker threads, each of which
    would start an OpenMP team of its own (one more OS thread per team) and turn libgomp's spin-waiting off for
    the rest of the process (small ops ~10x slower). The weights loaded are the ones saved."""
    code = (
        "import os, sys, torch\n"
        "torch.set_num_threads(2)\n"
        "from megatron_ext.arguments import parse_args\n"
        "from megatron_ext.training.initialize import initialize_distributed\n"
        "from megatron_ext.training.step import build_model\n"
        "from megatron_ext.training.checkpointing import load_weights, save_checkpoint\n"
        "def main():\n"
        f"    save = {str(tmp_path / 'ckpt')!r}\n"
        "    args = parse_args(['--model', 'tiny', '--mock-data', '--save', save], world_size=1)\n"
        "    initialize_distributed(args)\n"
        "    model = build_model(args, wrap_ddp=False)\n"
        "    torch.bmm(torch.randn(4, 1, 16), torch.randn(4, 16, 32))\n"
        "    before = len(os.listdir('/proc/self/task'))\n"
        "    save_checkpoint(args, 1, model, None, None)\n"
        "    want = {k: v.clone() for k, v in model[0].state_dict().items() if torch.is_tensor(v)}\n"
        "    for p in model[0].parameters():\n"
        "        p.data.zero_()\n"
        "    for _ in range(2):\n"
        "        load_weights(args, model, save, log=lambda *a, **k: None)\n"
        "    got = model[0].state_dict()\n"
        "    assert all(torch.equal(got[k], v) for k, v in want.items())\n"
        "    print('threads', before, len(os.listdir('/proc/self/task')))\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    script = tmp_path / "load.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = map(int, out.stdout.split("threads")[1].split())
    assert after <= before, out.stdout  # (a thread of the save may have ended meanwhile)


def test_gloo_worker_threads_start_no_openmp_team_of_their_own():
    """Collectives of data-parallel training (all_gathers whose copies run in gloo's worker threads) in a process
    with two intra-op threads: on groups made through the bridge the workers run those copies on one thread, so
    no OpenMP team of theirs appears (which would turn libgomp's spin-waiting off for the process); a group
    made by torch's own new_group does start one (what the check detects)."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "torch.set_num_threads(2)\n"
        "from megatron.core import parallel_state as ps\n"
        "from megatron_ext.arguments import parse_args\n"
        "from megatron_ext.training.initialize import initialize_distributed\n"
        "initialize_distributed(parse_args(['--model', 'tiny', '--mock-data'], world_size=1))\n"
        "assert torch.get_num_threads() == 2\n"
        "torch.bmm(torch.randn(4, 1, 16), torch.randn(4, 16, 32))\n"
        "def gathers(group):\n"
        "    x = torch.randn(1 << 18)\n"
        "    for w in [dist.all_gather([torch.empty_like(x)], x, group=group, async_op=True) for _ in range(8)]:\n"
        "        w.wait()\n"
        "count = lambda: len(os.listdir('/proc/self/task'))\n"
        "before = count()\n"
        "for g in (None, ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),\n"
        "          ps.get_tensor_model_parallel_group(), ps.get_expert_data_parallel_group()):\n"
        "    gathers(g)\n"
        "ours = count()\n"
        "plain = dist.new_group.__wrapped__([0])\n"
        "made = count()\n"
        "gathers(plain)\n"
        "print('threads', before, ours, made, count(), flush=True)\n"
        "os._exit(0)  # (torch's group is left to the exit)\n"
    )
    before, ours, made, theirs = _thread_counts(code)
    assert ours == before
    assert theirs > made  # torch's own group: a worker's OpenMP team


def test_linear_sends_only_big_fp32_products_without_gradients_to_onednn(monkeypatch):
    """`platform.linear` is F.linear up to fp32 summation order. oneDNN takes a product only for an fp32,
    contiguous weight of at least ONEDNN_LINEAR_MIN_BYTES while no gradient is recorded (the op has no
    backward); everything else, training included, stays on F.linear. MEGATRON_EXT_CPU_LINEAR=blas turns it
    off for a process."""
    import platform as host

    import torch.nn.functional as F

    if host.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        assert not platform.CPU_LINEAR_ONEDNN
        return
    assert platform.CPU_LINEAR_ONEDNN
    monkeypatch.setattr(platform, "CPU_LINEAR_CHOICE", "onednn")  # whatever an engine measured on this CPU
    g = torch.Generator().manual_seed(0)
    big = torch.nn.Parameter(torch.randn(512, 256, generator=g))  # 512 KiB
    small = torch.randn(32, 256, generator=g)
    x = torch.randn(3, 2, 256, generator=g)
    with torch.inference_mode():
        assert platform.onednn_linear(big) and not platform.onednn_linear(small)
        assert not platform.onednn_linear(big.detach().bfloat16()) and not platform.onednn_linear(big.detach().t())
        torch.testing.assert_close(platform.linear(x, big), F.linear(x, big), rtol=1e-5, atol=1e-4)  # |y| ~ 16
        torch.testing.assert_close(platform.linear(x[0, 0], big), F.linear(x[0, 0], big), rtol=1e-5, atol=1e-4)
        with torch.profiler.profile() as prof:
            platform.linear(x, big)
            platform.linear(x, small)
        ops = [e.name for e in prof.events()]
        assert ops.count("mkldnn::_linear_pointwise") == 1 and "aten::linear" in ops
    assert not platform.onednn_linear(big)  # gradients recorded: F.linear, which has a backward
    y = platform.linear(x, big)
    y.sum().backward()
    torch.testing.assert_close(big.grad, x.reshape(-1, 256).sum(0).expand(512, -1))
    code = "from megatron_ext import platform; print(platform.CPU_LINEAR_ONEDNN)"
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MEGATRON_EXT_CPU_LINEAR": "blas"})
    assert off.stdout.strip() == "False", off.stderr[-2000:]


def _cpu_linear_in_a_process(code, mode):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_EXT_CPU_LINEAR"}
    if mode is not None:
        env["MEGATRON_EXT_CPU_LINEAR"] = mode
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_cpu_linear_kernel_is_the_one_measured_faster_once_per_process(monkeypatch):
    """MEGATRON_EXT_CPU_LINEAR=auto (the default): the first `choose_cpu_linear` times one-row products by the
    given weights through oneDNN and torch's BLAS and keeps the faster for the process (oneDNN only when at least
    5 % faster); later calls measure nothing. A slowed kernel loses; `onednn`/`blas` fix the choice without
    measuring; anything else is refused with the values to use."""
    import platform as host

    import torch.nn.functional as F

    if host.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN products are for x86 CPUs")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(512, 256, generator=g) for _ in range(4)] + [torch.randn(16, 16, generator=g)]
    real_linear = F.linear

    def slow_linear(x, w, *rest):
        time.sleep(2e-3)
        return real_linear(x, w, *rest)

    for slowed, expected in (("blas", "onednn"), ("onednn", "blas")):
        monkeypatch.setattr(platform, "CPU_LINEAR_CHOICE", None)
        with monkeypatch.context() as m:
            if slowed == "blas":
                m.setattr(F, "linear", slow_linear)
            else:
                real = torch.ops.mkldnn._linear_pointwise
                m.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: (time.sleep(2e-3), real(*a))[1])
            line = platform.choose_cpu_linear(weights, rounds=3)
        assert platform.CPU_LINEAR_CHOICE == expected, line
        assert "2.1 MB of the engine's weights" in line  # the four big weights; the small one is never oneDNN's
        assert ("through oneDNN" if expected == "onednn" else "through torch BLAS") in line
        assert platform.choose_cpu_linear(weights) is None and platform.CPU_LINEAR_CHOICE == expected
        with torch.inference_mode():
            assert platform.onednn_linear(weights[0]) == (expected == "onednn")

    code = ("from megatron_ext import platform; import torch; w = [torch.randn(512, 256)]; "
            "print(platform.CPU_LINEAR_CHOICE, platform.choose_cpu_linear(w) is None, platform.CPU_LINEAR_CHOICE)")
    assert _cpu_linear_in_a_process(code, "onednn").stdout.split() == ["onednn", "True", "onednn"]
    assert _cpu_linear_in_a_process(code, "blas").stdout.split() == ["blas", "True", "blas"]
    out = _cpu_linear_in_a_process(code, None).stdout.split()
    assert out[:2] == ["None", "False"] and out[2] in ("onednn", "blas")
    bad = _cpu_linear_in_a_process(code, "mkl")
    assert bad.returncode != 0 and "MEGATRON_EXT_CPU_LINEAR='mkl': use one of auto, onednn, blas" in bad.stderr
