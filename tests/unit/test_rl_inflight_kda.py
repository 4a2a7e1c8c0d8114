"""In-flight weight swap on the Kimi Linear hybrid (KDA recurrent states, MoE): the re-encoded cache of rows of
unequal lengths keeps padding out of the KDA states, and the recorded routing is the new weights' for every position,
so the whole sequence's log-probabilities and experts after the swap are a teacher-forced forward's."""

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams, model_weights
from megatron_ext.training.initialize import destroy, initialize_distributed
from tests.unit.test_engine_rl import _model, _teacher_forced


@pytest.fixture(scope="module")
def models():
    args = parse_args(["--model", "tiny-kimi-linear", "--mock-data"], world_size=1)
    initialize_distributed(args)
    yield _model(args, 3), _model(args, 4)
    destroy()


def _routing(model, ids):
    """[len(ids), MoE layers, topk]: the experts Megatron-Core's routers choose in a teacher-forced forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    before = list(RouterReplay.global_router_replay_instances)
    try:
        for router in routers:
            router.router_replay = RouterReplay()
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        _teacher_forced(model, ids)
        return torch.stack([r.router_replay.get_recorded_indices() for r in routers], dim=1)
    finally:
        for router in routers:
            router.router_replay = None
        RouterReplay.global_router_replay_instances[:] = before


def test_kda_swap_reencodes_without_padding_and_rerecords_routing(models):
    served, new = models
    eng = InferenceEngine(served, weights_version=0)
    new_weights = {k: v.clone() for k, v in model_weights(new).items()}
    calls = []

    def between_steps():
        calls.append(1)
        if len(calls) == 2:
            eng.update_weights(new_weights.items(), version=1)
            return True
        return False

    eng.between_steps = between_steps
    prompts = [[5, 9, 13, 2, 8, 3], [7, 1]]  # unequal: the short row is right-padded when re-encoded
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, return_routing=True) for s in (11, 12)]
    out = eng.generate(prompts, params)
    for prompt, c in zip(prompts, out):
        assert c.versions == [0, 0, 1, 1, 1, 1]
        lp_new = _teacher_forced(new, prompt + c.token_ids)[0].tolist()
        assert c.logprobs[2:] == pytest.approx(lp_new[len(prompt) + 1:], abs=1e-5)
    for prompt, c in zip(prompts, out):
        assert torch.equal(c.routing.long(), _routing(new, prompt + c.token_ids))
