"""Device placement of the inference engine, checked on a CPU-only machine (issue 13 item 1).

`SecondDevice` plays the accelerator: the model's parameters and buffers, and tensors created with an explicit
`device=`, live "on the device"; tensors created without one live "on the host"; every result inherits its
operands' place. An op that mixes a host tensor (other than a 0-dim one, which CUDA accepts) with a device tensor
raises, as it would on a GPU, so a prompt, mask, position, cache or sampling tensor the engine builds on the host
by mistake fails here.
"""

import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model

_FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full,
              torch.randint, torch.rand, torch.randn, torch.randperm, torch.eye, torch.linspace}


class MixedDevices(AssertionError):
    pass


class _Tensors:
    """A set of live tensors by identity (tensors compare elementwise, so WeakSet cannot hold them)."""

    def __init__(self):
        self._refs = {}

    def add(self, t: torch.Tensor):
        self._refs[id(t)] = weakref.ref(t)

    def discard(self, t: torch.Tensor):
        self._refs.pop(id(t), None)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


class SecondDevice(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.device, self.host = _Tensors(), _Tensors()
        for t in list(model.parameters()) + list(model.buffers()):
            self.device.add(t)
        self.checked = 0

    def _place(self, result, on_device: bool):
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor):
                (self.device if on_device else self.host).add(t)
                (self.host if on_device else self.device).discard(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if t in self.device]
        on_host = [t for t in tensors if t in self.host and t.dim() > 0]
        if on_device and on_host and func is not torch.Tensor.copy_:
            raise MixedDevices(f"{getattr(func, '__name__', func)}: host tensor(s) {[tuple(t.shape) for t in on_host]} "
                               f"meet device tensor(s) {[tuple(t.shape) for t in on_device]}")
        result = func(*args, **kwargs)
        self.checked += 1
        if func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item):
            self._place(result, on_device=False)
        elif func is torch.Tensor.to and (len(args) > 1 or "device" in kwargs):
            self._place(result, on_device=True)
        elif func in _FACTORIES or not tensors:
            self._place(result, on_device=kwargs.get("device") is not None)
        else:
            self._place(result, on_device=bool(on_device))
        return result


@pytest.fixture(scope="module")
def model():
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=3))[0]
    model.eval()
    yield model
    destroy()


def test_the_mode_catches_a_host_tensor_meeting_the_model(model):
    emb = model.embedding.word_embeddings.weight
    with SecondDevice(model):
        ids = torch.tensor([[1, 2]])
        with pytest.raises(MixedDevices, match="embedding"):
            torch.nn.functional.embedding(ids, emb)
        ok = torch.tensor([[1, 2]], device=emb.device)
        assert torch.nn.functional.embedding(ok, emb).shape == (1, 2, emb.size(1))


@pytest.mark.parametrize("kind", ["batch", "groups", "speculative", "speculative groups"])
def test_engine_keeps_every_tensor_on_the_model_device(model, kind):
    from megatron_ext.inference.speculative import generate_speculative
    from megatron_ext.inference.speculative_batch import generate_speculative_groups

    engine = InferenceEngine(model)  # fresh: no tables cached from other tests
    rows = [SamplingParams(max_tokens=5, temperature=0.0, return_routing=True),
            SamplingParams(max_tokens=3, temperature=0.9, top_k=20, top_p=0.9, seed=1, return_routing=True)]
    mode = SecondDevice(model)
    with mode:
        if kind == "batch":
            outs = engine.generate([[1, 2, 3], [4, 5]], rows)
        elif kind == "groups":
            outs = [c for g in engine.generate_groups([[1, 2, 3], [4, 5]], 2, rows) for c in g]
        elif kind == "speculative groups":
            outs = [c for g in generate_speculative_groups(engine, [[1, 2, 3], [4, 5]], 2, rows) for c in g]
        else:
            outs = [generate_speculative(engine, [1, 2, 3], r) for r in rows]
    expected = [r for r in rows for _ in range(2)] if kind in ("groups", "speculative groups") else rows
    assert mode.checked > 100 and [len(c.token_ids) for c in outs] == [r.max_tokens for r in expected]


def test_generators_are_made_on_the_model_device(model, monkeypatch):
    engine = InferenceEngine(model)
    assert engine.generator(3).device == engine.device
    made = []
    monkeypatch.setattr(engine, "generator", lambda seed: made.append(seed) or torch.Generator().manual_seed(seed))
    engine.generate([[1, 2]], SamplingParams(max_tokens=2, seed=7))
    assert made == [7]  # every sampling generator comes from engine.generator


@pytest.mark.parametrize("backend, where", [("nccl", "meta"), ("gloo", "cpu")])
def test_seed_agreement_all_reduces_a_tensor_of_the_backends_device(model, monkeypatch, backend, where):
    """NCCL rejects host tensors, gloo wants them: the drawn seeds travel on the group backend's device (the
    model stands on the meta device here, as a GPU would be a device other than the host)."""
    import torch.distributed as dist

    class Reduced(Exception):
        pass

    def all_reduce(tensor, op=None, group=None):
        seen.append((group, tensor.device.type, tuple(tensor.shape), op))
        if tensor.device.type == "meta":
            raise Reduced  # a meta tensor has no values to read back

    engine = InferenceEngine(model)
    engine.groups.tp = "tp group"
    seen = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(InferenceEngine, "device", property(lambda self: torch.device("meta")))
    try:
        seeds = engine.agreed_seeds([None, 5, None])
        assert seeds[1] == 5 and all(isinstance(s, int) and s >= 0 for s in seeds)
    except Reduced:
        pass
    assert seen == [("tp group", where, (2,), dist.ReduceOp.MAX)]  # one all-reduce for all the missing seeds
