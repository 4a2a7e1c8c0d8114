import os
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def _reset_loss_scales():
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # Megatron-Core's initial values
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0)


@pytest.fixture(autouse=True)
def _fresh_loss_scales():
    """Megatron-Core keeps the MoE aux-loss and MTP loss scales in class attributes that a schedule sets and a
    plain backward reads. A backward outside the schedule leaves the MoE scale a 0-d tensor, into which a later
    schedule copies a [1]-shaped one and fails; a schedule leaves the MTP scale a [1]-shaped tensor on its device,
    which a later backward on another device (the meta-device placement test) meets. Every test starts and ends
    with Megatron-Core's initial values, also after module-scoped fixtures that train."""
    _reset_loss_scales()
    yield
    _reset_loss_scales()
