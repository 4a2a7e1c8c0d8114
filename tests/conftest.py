import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


@pytest.fixture(autouse=True)
def _fresh_aux_loss_scale():
    """A backward pass outside Megatron-Core's pipeline schedule (several unit tests) leaves the MoE aux-loss
    scale a 0-d tensor, into which the schedule later copies a [1]-shaped one and fails; every test leaves it as
    it found it. The MTP loss scale likewise: a schedule leaves it a [1]-shaped tensor on the device it ran on
    (the host here), which a later test's backward on another device (the meta-device placement test) meets."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    saved = MoEAuxLossAutoScaler.main_loss_backward_scale, MTPLossAutoScaler.main_loss_backward_scale
    yield
    MoEAuxLossAutoScaler.main_loss_backward_scale, MTPLossAutoScaler.main_loss_backward_scale = saved
