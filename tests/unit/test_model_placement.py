"""The model reaches the device in model_provider, for every user of it: built on the host (Megatron-Core
0.16.1 creates the router weight on the CPU, and so are the local spec's norms and our replicated down
projections), then moved by the production code to 'the GPU', here the meta device."""

import contextlib

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.models.provider import model_provider
from megatron_ext.testing import meta_device_as_gpu
from megatron_ext.training.initialize import destroy, initialize_distributed


@contextlib.contextmanager
def _initialized(flags):
    args = parse_args(["--model", "tiny", "--mock-data", "--seq-length", "32", *flags], world_size=1)
    initialize_distributed(args)
    try:
        yield args
    finally:
        destroy()


def _placement(model):
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {name: t.device.type for name, t in tensors.items()}


@pytest.mark.parametrize("flags", [["--num-experts", "0"], [], ["--model", "tiny-kimi-linear"]],
                         ids=["dense", "moe", "kimi-linear"])
def test_model_provider_moves_a_host_built_model_to_the_device(flags):
    """Built on the host (as Megatron-Core 0.16.1 builds the router weight, local norms and our replicated down
    projections whatever the config says), then moved by the production code to 'the GPU' (meta here)."""
    with _initialized(flags) as args, meta_device_as_gpu():
        model = model_provider(args)
    placement = _placement(model)
    left = sorted(name for name, kind in placement.items() if kind != "meta")
    assert not left, f"{len(left)} of {len(placement)} tensors left on the host: {left[:8]}"
    assert any("router.weight" in n for n in placement) or not args.arch.num_experts


def test_every_model_provider_user_gets_a_device_model():
    """serve, the RL reference model, rollout workers and the swarm's pinned policy build through
    build_model(wrap_ddp=False), which has no DDP buffer to carry host tensors to the GPU."""
    from megatron_ext.training.step import build_model

    with _initialized(["--num-experts", "0"]) as args, meta_device_as_gpu():
        model = build_model(args, wrap_ddp=False)[0]
    assert set(_placement(model).values()) == {"meta"}


def test_a_shape_only_model_stays_on_the_meta_device():
    """Converters and planners build under torch.device('meta') on a host machine: nothing to move, and moving
    would fail (a meta tensor has no data to copy)."""
    with _initialized([]) as args, torch.device("meta"):
        model = model_provider(args)
    assert {p.device.type for p in model.parameters()} == {"meta"}
