"""Device and backend choice, and the one place that adapts Megatron-Core to a machine without CUDA.

Megatron-Core 0.16.1 assumes CUDA, Transformer Engine and NCCL in a handful of places (DESIGN.md section 4).
Each bridge is keyed on what is missing, on its own: a GPU node with Transformer Engine and apex gets none and
runs Megatron-Core untouched; a GPU node without Transformer Engine gets only the TE bridge (Megatron-Core's
router otherwise calls an undefined `te_general_gemm`) and one line naming the fast paths that are off; without
CUDA (or with MEGATRON_EXT_FORCE_CPU=1, which makes an installed TE/apex count as missing too) `install()`
bridges every gap so that the very same model, schedules and optimizer run on the CPU with gloo:

* `torch.cuda` entry points that Megatron-Core calls unconditionally get CPU stand-ins (current device,
  streams, events, synchronisation, RNG state, memory statistics);
* a `TorchFunctionMode` maps any CUDA device argument (``"cuda"``, ``cuda:N``, a bare index) to the CPU and
  reports CPU tensors under their CUDA type names, which covers every hard-coded ``device="cuda"`` at once;
* Transformer-Engine-only branches that are taken although TE is absent are switched off;
* gloo's ``all_to_all_single`` gets its split sizes as lists;
* the distributed optimizer's reshardable checkpoint loads with torch's Adam (no TE/apex fused Adam);
* torch.compile (Megatron-Core's ``jit_fuser``) is switched off: ~20 s of CPU compilation per process, no gain.

`install()` is idempotent and cheap. A process that has imported `megatron_ext` calls it the moment Megatron-Core
has loaded (an import hook in `megatron_ext/__init__.py`), or at once if Megatron-Core was loaded first; one that
never loads Megatron-Core (task generators, reports, `--help`) is left alone and starts ~3.5 s sooner.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: "_CudaToCpuMode | None" = None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def bridge_needed() -> bool:
    """True when Megatron-Core must be adapted: no usable CUDA device in this process."""
    if os.environ.get("MEGATRON_EXT_FORCE_CPU") == "1":
        return True
    return not cuda_available()


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def module_importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def apex_installed() -> bool:
    return importlib.util.find_spec("apex") is not None


def te_available() -> bool:
    """Whether Transformer Engine can be used: installed, and a GPU in use (TE does not run on a CPU, nor under
    MEGATRON_EXT_FORCE_CPU)."""
    return not bridge_needed() and te_installed()


@functools.lru_cache(maxsize=None)
def grad_accum_fusion_kernel() -> bool:
    """Whether apex's `fused_weight_gradient_mlp_cuda` imports: Megatron's own ColumnParallelLinear (GPTModel's
    output layer, under either spec) raises with gradient-accumulation fusion on and this kernel missing; TE's
    linears fuse without it."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def fused_optimizer_available() -> bool:
    """Whether Megatron-Core's fused Adam (TE's, else apex's) can run; otherwise torch's AdamW steps."""
    return not bridge_needed() and (te_installed() or apex_installed())


def needed_bridges(cuda: bool, te: bool, apex: bool) -> list[str]:
    """Which bridges a process needs, from what it has: "cuda" (no usable GPU: torch.cuda stand-ins, the device
    mode, gloo's all-to-all), "te" (TE-only branches off), "torch_optimizer" (torch's Adam behind the
    distributed optimizer). `cuda` False also counts TE and apex as missing: neither runs on host tensors."""
    te, apex = te and cuda, apex and cuda
    return [name for name, missing in (("cuda", not cuda), ("te", not te), ("torch_optimizer", not (te or apex)))
            if missing]


def fast_paths_off(te: bool, apex: bool) -> list[str]:
    """What a GPU process runs without, given which of Transformer Engine and apex it has."""
    off = []
    if not te:
        off += ["FP8 (--fp8-format)", "--transformer-impl transformer_engine (fused attention, fused norm+linear)",
                "context parallelism through TE attention (the local all-gather path is used)",
                "TE grouped-GEMM experts (--moe-grouped-gemm)", "fused MoE router/permute kernels",
                "TE gradient-accumulation fusion"]
    if not (te or apex):
        off.append("fused Adam (torch's AdamW steps)")
    return off


def device() -> torch.device:
    if bridge_needed():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def dist_backend() -> str:
    return "gloo" if bridge_needed() else "nccl"


def default_transformer_impl() -> str:
    return "transformer_engine" if te_available() else "local"


def is_bridged() -> bool:
    return _INSTALLED and _MODE is not None


# --------------------------------------------------------------------------------------------------------
# The bridges
# --------------------------------------------------------------------------------------------------------


def is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # A bare integer is a CUDA ordinal in torch's device grammar.
    return isinstance(dev, int) and not isinstance(dev, bool)


_CPU = torch.device("cpu")


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and is_cuda_device(dev):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)  # pinned memory only speeds host-to-GPU copies
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.device and args and is_cuda_device(args[0]):
            return _CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # Megatron's optimizers accept only 'torch.cuda.*Tensor' parameters; CPU stands in for CUDA.
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        return func(*args, **kwargs)


class _CpuEvent:
    """Stand-in for `torch.cuda.Event`: CPU work is synchronous, so an event is a timestamp."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._t - self._t) * 1000.0


class _CpuStream:
    """Stand-in for `torch.cuda.Stream`: one in-order CPU stream."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = _CPU

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, _CpuStream)

    def __hash__(self):
        return 0


_STREAM = _CpuStream()


def _returning(value):
    """A fresh function object per patched name: torch._dynamo rejects one object registered under two names."""
    return lambda *args, **kwargs: value


def _patch_torch_cuda():
    cuda = torch.cuda
    # A device object rather than ordinal 0: `device=torch.cuda.current_device()` then means the CPU on its own,
    # also where no TorchFunctionMode is active (autograd runs custom backward functions outside it).
    cuda.current_device = _returning(_CPU)
    cuda.set_device = _returning(None)
    cuda.synchronize = _returning(None)
    cuda.empty_cache = _returning(None)
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _STREAM
    cuda.default_stream = lambda device=None: _STREAM
    cuda.set_stream = _returning(None)
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.memory_allocated = _returning(0)
    cuda.max_memory_allocated = _returning(0)
    cuda.memory_reserved = _returning(0)
    cuda.max_memory_reserved = _returning(0)
    cuda.reset_peak_memory_stats = _returning(None)
    cuda.memory_stats = lambda device=None: {}
    # Megatron's RNG tracker forks "the CUDA generator" around tensor-parallel regions; on the CPU the
    # generator that dropout and init actually draw from is the default CPU generator.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = _returning(None)  # torch.manual_seed calls it after seeding the CPU generator
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.random.manual_seed = cuda.manual_seed


def _patch_megatron_core():
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def _bridge_missing_te():
    """Transformer Engine absent (or unusable without CUDA): switch off the TE-only branches Megatron-Core takes
    anyway. Both modules guard them with a flag that is set although TE is absent (its classes are mocks), or
    reference a name (`te_general_gemm`) that only exists with TE."""
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.moe import moe_utils

    mla.HAVE_TE = False
    moe_utils.HAVE_TE = False  # TE installed but unusable (forced CPU): its fused kernels want CUDA tensors
    moe_utils.te_general_gemm = None
    # Selective recomputation (`CheckpointWithoutOutput`, constructed with fp8=False, takes that for FP8 on) enters
    # TE's FP8 and recompute contexts, which are only imported with TE: without TE there is no FP8 to track.
    from megatron.core.tensor_parallel import random as mrandom

    if not te_available():
        mrandom.FP8GlobalStateManager = _NoFP8
        mrandom.activation_recompute_forward = lambda activation_recompute=False, recompute_phase=False: \
            contextlib.nullcontext()
        mrandom.fp8_autocast = lambda enabled=False, fp8_recipe=None, **kwargs: contextlib.nullcontext()


class _NoFP8:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def _bridge_torch_optimizer():
    """No fused Adam usable (no TE/apex, or no CUDA for them): torch's, as Megatron-Core picks without either."""
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # installed but unusable on host tensors (MEGATRON_EXT_FORCE_CPU)
        mopt.Adam, mopt.SGD = torch.optim.AdamW, torch.optim.SGD
        distrib_optimizer.Adam, distrib_optimizer.HAVE_APEX_OR_TE = torch.optim.Adam, False
    _patch_distributed_optimizer_step_state()


def _patch_distributed_optimizer_step_state():
    """Loading a fully reshardable distributed-optimizer checkpoint without TE/apex.

    torch's Adam keeps a per-parameter ``step`` tensor; Megatron-Core saves ``step`` once in the common state
    and restores it from there, but its per-parameter copy loop also expects ``step`` among the loaded tensors.
    The parameter's own ``step`` is passed through instead (the common one overwrites it).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_megatron_ext_bridge", False):
        return

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = dict(tensors, step=step)
        return original(self, model_param, tensors)

    _set_main_param_and_optimizer_states._megatron_ext_bridge = True
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _patch_gloo_all_to_all():
    original = dist.all_to_all_single
    if getattr(original, "_megatron_ext_bridge", False):
        return

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        # gloo wants Python lists; Megatron's alltoall dispatcher hands it tensors.
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    all_to_all_single._megatron_ext_bridge = True
    dist.all_to_all_single = all_to_all_single


def _patch_single_rank_object_collectives():
    """Object collectives (`all_gather_object`, `gather_object`, `scatter_object_list`, `broadcast_object_list`)
    over a one-rank group, done in the caller's thread: a pickle round trip as torch's own, or nothing for a
    broadcast from oneself. Through gloo the pickled bytes are copied by one of the process group's worker threads;
    with intra-op threads > 1 that copy starts a second OpenMP thread team, and from then on libgomp, seeing more
    threads than CPUs, stops spin-waiting between parallel regions for the rest of the process: every small
    parallel op (bmm, softmax) then costs a thread wake-up (9 -> 85 us measured on a 2-core VM). Megatron-Core's
    dist_checkpointing and torch.distributed.checkpoint exchange their metadata and plans this way at every save
    and load, so a one-process run (tests, benchmarks, a CPU server) ran its small ops ~10x slower after its
    first checkpoint. Groups of several ranks go to torch unchanged (torchrun's ranks run one thread each)."""
    import inspect
    import pickle

    def copy(obj):
        return pickle.loads(pickle.dumps(obj))

    def alone(group) -> bool:
        return dist.is_initialized() and dist.get_world_size(group) == 1

    def all_gather_object(a):
        a["object_list"][0] = copy(a["obj"])

    def gather_object(a):
        if a.get("object_gather_list") is not None:
            a["object_gather_list"][0] = copy(a["obj"])

    def scatter_object_list(a):
        a["scatter_object_output_list"][0] = copy(a["scatter_object_input_list"][0])

    def broadcast_object_list(a):
        pass

    def bridge(name, local, needs):
        original = getattr(dist, name)
        if getattr(original, "_megatron_ext_bridge", False):
            return
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(*args, **kwargs):
            a = signature.bind(*args, **kwargs).arguments
            if alone(a.get("group")) and all(len(a.get(k) or ()) == 1 for k in needs):
                return local(a)
            return original(*args, **kwargs)

        collective._megatron_ext_bridge = True
        setattr(dist, name, collective)

    bridge("all_gather_object", all_gather_object, ("object_list",))
    bridge("gather_object", gather_object, ())
    bridge("scatter_object_list", scatter_object_list, ("scatter_object_output_list", "scatter_object_input_list"))
    bridge("broadcast_object_list", broadcast_object_list, ("object_list",))


def _quiet_gloo_workers(group) -> None:
    """Give each gloo worker thread of `group` one intra-op thread. A worker thread sets its OpenMP thread count
    from torch's at its first parallel ATen op (a copy inside all_gather, a flatten) and keeps it; with more
    than one, that op starts an OpenMP team of the worker's own, and libgomp, then managing more threads than
    there are CPUs, stops spin-waiting between parallel regions for the whole process: every small parallel op
    of the main thread (bmm, softmax) pays a thread wake-up from then on (9 -> 85 us on a 2-core VM, a tiny
    model's decode step 3x slower after its first data-parallel step or checkpoint). So, right after the group
    is made, its members run a few overlapping all_gathers while torch's thread count is 1, which the workers
    take as theirs; the caller's count is restored after. Only where it matters: members of a gloo group in a
    process running more than one intra-op thread (torchrun's ranks default to one)."""
    if group is None or torch.get_num_threads() <= 1 or not dist.is_initialized():
        return
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0 or dist.get_backend(group) != "gloo":
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        size = dist.get_world_size(group)
        x = torch.zeros(1 << 18)  # past ATen's grain size: the copy is a parallel op
        works = [dist.all_gather([torch.empty_like(x) for _ in range(size)], x, group=group, async_op=True)
                 for _ in range(8)]  # overlapping: every worker thread of the group takes some
        for work in works:
            work.wait()
    finally:
        torch.set_num_threads(threads)


def _patch_gloo_worker_threads():
    for name in ("init_process_group", "new_group"):
        original = getattr(dist, name)
        if getattr(original, "_megatron_ext_bridge", False):
            continue

        def made(*args, _original=original, _name=name, **kwargs):
            out = _original(*args, **kwargs)
            _quiet_gloo_workers(dist.group.WORLD if _name == "init_process_group" else out)
            return out

        functools.update_wrapper(made, original)
        made._megatron_ext_bridge = True
        setattr(dist, name, made)


def install() -> bool:
    """Bridge Megatron-Core to what this process lacks (see `needed_bridges`). Returns whether the CUDA->CPU
    bridges are active. Safe to call any number of times; with CUDA, TE and apex present it does nothing at all.
    """
    global _INSTALLED, _MODE
    if _INSTALLED:
        return _MODE is not None
    _INSTALLED = True
    cuda = not bridge_needed()
    bridges = needed_bridges(cuda, te_installed(), apex_installed())
    if not bridges:
        return False
    import megatron.core  # noqa: F401  (torch._dynamo indexes torch.cuda on first import; let it see the originals)

    if "te" in bridges:
        _bridge_missing_te()
    if "torch_optimizer" in bridges:
        _bridge_torch_optimizer()
    if cuda:
        if os.environ.get("RANK", "0") == "0":
            off = fast_paths_off(te_installed(), apex_installed())
            print("megatron_ext: CUDA without " + " and ".join(
                n for n, have in (("Transformer Engine", te_installed()), ("apex", apex_installed())) if not have)
                + "; fast paths off: " + "; ".join(off) + " (pip install -e .[gpu] to get them)", flush=True)
        return False
    _patch_torch_cuda()
    _patch_gloo_all_to_all()
    _patch_single_rank_object_collectives()
    _patch_gloo_worker_threads()
    if os.environ.get("MEGATRON_EXT_CPU_COMPILE") != "1":
        # Megatron-Core wraps its fused kernels in torch.compile; on a CPU that costs ~20 s of compilation per
        # process for no gain at development sizes. MEGATRON_EXT_CPU_COMPILE=1 keeps it.
        torch._dynamo.config.disable = True
    _patch_megatron_core()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    return True


# Matrix products for inference on an x86 CPU. Torch's CPU BLAS is MKL, and on an AMD EPYC (32 MiB L3) MKL's fp32
# products by weights read from memory (not cache) measured as fast as oneDNN's inner product at ~288 KiB and up to
# 3.4x slower for bigger weights, at 1 and 8 rows (`benchmarks/decode_throughput.py --only floor`,
# docs/benchmarks.md): MKL read a decode step's weights at ~15 GB/s, oneDNN at ~30 GB/s. On an Intel Xeon whose
# L3 holds a tiny model's weights (480 MiB) it was the other way round: MKL 34 GB/s, oneDNN 19 GB/s. So which
# kernel a process uses is measured, not assumed: `choose_cpu_linear` times one-row products by the engine's own
# decode weights through both, once per process (MEGATRON_EXT_CPU_LINEAR=auto, the default), and `onednn` or
# `blas` fixes the choice. Smaller weights stay on F.linear (oneDNN's ~12-15 us per call is more than the
# product). The oneDNN op is the one Inductor's CPU backend calls (`mkldnn::_linear_pointwise`), on plain dense
# weights: no packed copy, so in-place weight updates show through. It has no backward, so it is used only where
# no gradient is recorded (inference mode, no_grad). Results agree with F.linear up to fp32 summation order.
ONEDNN_LINEAR_MIN_BYTES = 192 * 1024
CPU_LINEAR_MODES = ("auto", "onednn", "blas")


def _cpu_linear_mode() -> str:
    mode = os.environ.get("MEGATRON_EXT_CPU_LINEAR", "auto")
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"MEGATRON_EXT_CPU_LINEAR={mode!r}: use one of {', '.join(CPU_LINEAR_MODES)} (auto, the "
                         "default, measures which kernel is faster for the engine's weights on this CPU)")
    return mode


def _onednn_linear_available() -> bool:
    import platform as _host

    return (_cpu_linear_mode() != "blas" and _host.machine().lower() in ("x86_64", "amd64")
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


CPU_LINEAR_ONEDNN = _onednn_linear_available()  # oneDNN may take products in this process
# the process's choice: "onednn" or "blas"; None until `choose_cpu_linear` measured (oneDNN meanwhile, as it was)
CPU_LINEAR_CHOICE: Optional[str] = None if _cpu_linear_mode() == "auto" else _cpu_linear_mode()
CPU_LINEAR_MEASURE_MB = 256  # bytes of weights timed per kernel and round at most


def choose_cpu_linear(weights: list, rounds: int = 7, groups: tuple = ()) -> Optional[str]:
    """Where MEGATRON_EXT_CPU_LINEAR=auto and nothing was chosen yet in this process: time one-row products by
    `weights` (an engine's decode weights; those oneDNN would take, up to CPU_LINEAR_MEASURE_MB) through oneDNN
    and through F.linear, interleaved, `rounds` times after a warm-up, and keep oneDNN for the process only where
    its median is at least 5 % faster. `groups` (process groups whose ranks compute the same model together:
    tensor and expert parallel) then agree on one kernel, torch's BLAS if any rank chose it, so that replicated
    products give the same bits on every rank; every rank of them must call this. Returns a line saying what was
    measured and chosen (None: nothing measured or changed, e.g. a fixed choice or no weight big enough)."""
    global CPU_LINEAR_CHOICE
    if not CPU_LINEAR_ONEDNN or _cpu_linear_mode() != "auto":
        return None
    line = None
    if CPU_LINEAR_CHOICE is None:
        picked, total = [], 0
        with torch.inference_mode():
            for w in weights:
                w = w.detach()
                if onednn_linear(w) and total + w.numel() * 4 <= CPU_LINEAR_MEASURE_MB * 2 ** 20:
                    picked.append(w)
                    total += w.numel() * 4
            g = torch.Generator().manual_seed(0)  # the process's own generator is left as it was
            rows = [torch.randn(1, w.size(1), generator=g) for w in picked]
            kinds = {"onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                     "blas": torch.nn.functional.linear}
            times = {kind: [] for kind in kinds}
            with without_device_mapping():
                for _ in range(rounds + 1 if picked else 0):
                    for kind, product in kinds.items():
                        t = time.perf_counter()
                        for x, w in zip(rows, picked):
                            product(x, w)
                        times[kind].append(time.perf_counter() - t)
        if picked:
            ms = {kind: statistics.median(ts[1:]) * 1e3 for kind, ts in times.items()}
            CPU_LINEAR_CHOICE = "onednn" if ms["onednn"] < 0.95 * ms["blas"] else "blas"
            line = (f"one-row products by {total / 1e6:.1f} MB of the engine's weights took {ms['onednn']:.2f} ms "
                    f"with oneDNN, {ms['blas']:.2f} ms with torch's BLAS")
    if groups:
        vote = torch.tensor([1.0 if CPU_LINEAR_CHOICE == "blas" else 0.0])
        for group in groups:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
        agreed = "blas" if vote.item() > 0 else CPU_LINEAR_CHOICE
        if agreed != CPU_LINEAR_CHOICE:
            line = (line + "; " if line else "") + "torch's BLAS, as another rank of its model-parallel groups chose"
            CPU_LINEAR_CHOICE = agreed
    if line is None:
        return None
    return (f"CPU matrix products by weights of {ONEDNN_LINEAR_MIN_BYTES // 1024} KiB and more through "
            f"{'oneDNN' if CPU_LINEAR_CHOICE == 'onednn' else 'torch BLAS'}: {line} "
            "(MEGATRON_EXT_CPU_LINEAR=onednn|blas fixes the choice)")


def onednn_linear(weight: torch.Tensor) -> bool:
    """Whether `linear` sends products by `weight` to oneDNN (an x86 CPU where oneDNN was chosen or not yet
    measured, fp32, contiguous, at least ONEDNN_LINEAR_MIN_BYTES, no gradient being recorded)."""
    return (CPU_LINEAR_ONEDNN and CPU_LINEAR_CHOICE != "blas" and weight.dtype is torch.float32
            and not weight.is_cuda and weight.numel() * 4 >= ONEDNN_LINEAR_MIN_BYTES and not torch.is_grad_enabled()
            and weight.device.type == "cpu" and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias, through oneDNN where `onednn_linear(weight)` says so (x [..., in] in
    the weight's dtype)."""
    if onednn_linear(weight) and x.dtype is torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return torch.nn.functional.linear(x, weight)


@contextlib.contextmanager
def without_device_mapping():
    """Suspend the CUDA->CPU mode around hot code that never names a CUDA device (the inference engine's
    decoding loop): the mode's Python dispatch costs ~10 us per torch call, about 40 % of a tiny model's decode
    step on a CPU. A no-op when nothing is bridged or another mode is on top."""
    stack = _active_modes()
    if _MODE is None or not stack or not isinstance(stack[-1], _CudaToCpuMode):
        yield
        return
    from torch.overrides import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield


def ensure_mode_on_this_thread():
    """TorchFunctionModes are thread-local; threads that run Megatron-Core code call this first."""
    if _MODE is not None and not any(isinstance(m, _CudaToCpuMode) for m in _active_modes()):
        _CudaToCpuMode().__enter__()


def _active_modes():
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()
