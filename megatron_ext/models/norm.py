"""RMSNorm that works under sequence parallelism.

Megatron-Core's local norm (`WrappedTorchNorm`) refuses sequence parallelism because it cannot mark its weight:
under SP each tensor-parallel rank normalises a different slice of the sequence, so the weight's gradient is a
partial sum that `finalize_model_grads` must all-reduce across the TP group. It does that for every parameter
flagged ``sequence_parallel``, which is all this module adds.
"""

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"this backend implements RMSNorm only, not {config.normalization}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as the HF reference does, then return to the input dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
