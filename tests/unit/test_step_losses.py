"""The logged step losses are read back to the host once per step, not once per loss (each read is a device sync
on a GPU), with the same values as one division per loss."""

import torch

from megatron_ext.arguments import parse_args
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import _token_means

READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy)


class _Reads(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_token_means_read_back_once_for_all_losses():
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    try:
        g = torch.Generator().manual_seed(0)
        names = ["lm loss", "mtp_1 loss", "z loss"]
        outputs = [{n: torch.stack([torch.rand(1, generator=g)[0] * 100, torch.tensor(37.0 + i)]) for n in names}
                   for i in range(4)]
        with _Reads() as reads:
            got = _token_means(outputs)
        assert reads.names == ["tolist"]
        for n in names:
            s = torch.stack([o[n] for o in outputs]).sum(0).float()
            assert got[n] == float(s[0] / s[1])  # the same float32 division as one read per loss made
        assert _token_means([]) == {}
    finally:
        destroy()
