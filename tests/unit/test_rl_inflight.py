"""In-flight weight updates: a batch that swaps weights between decode steps keeps going; tokens after the swap
carry the new version and their log-probabilities are the new weights' (teacher-forced), tokens before it the
old ones'."""

import pytest

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams, model_weights
from megatron_ext.training.initialize import destroy, initialize_distributed
from tests.unit.test_engine_rl import _model, _teacher_forced


@pytest.fixture(scope="module")
def models():
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    yield _model(args, 3), _model(args, 4), _model(args, 3)
    destroy()


def test_swap_between_decode_steps_tags_and_scores_later_tokens_with_the_new_weights(models):
    served, new, old = models
    eng = InferenceEngine(served, weights_version=5)
    new_weights = {k: v.clone() for k, v in model_weights(new).items()}
    steps = []

    def between_steps():
        steps.append(len(steps))
        if len(steps) == 3:  # after the third sampled token of the batch: swap to version 6
            eng.update_weights(new_weights.items(), version=6)
            return True
        return False

    eng.between_steps = between_steps
    prompts = [[5, 9, 13, 2], [7, 1]]
    params = [SamplingParams(max_tokens=7, temperature=1.0, seed=11), SamplingParams(max_tokens=7, temperature=1.0,
                                                                                      seed=12)]
    out = eng.generate(prompts, params)
    for prompt, c in zip(prompts, out):
        assert c.versions == [5, 5, 5, 6, 6, 6, 6]
        ids = prompt + c.token_ids
        lp_old, lp_new = _teacher_forced(old, ids)[0].tolist(), _teacher_forced(new, ids)[0].tolist()
        n = len(prompt)
        assert c.logprobs[:3] == pytest.approx(lp_old[n - 1: n + 2], abs=1e-5)
        assert c.logprobs[3:] == pytest.approx(lp_new[n + 2:], abs=1e-5)
        # the two policies differ on these tokens: the check above can tell them apart
        assert max(abs(a - b) for a, b in zip(lp_old[n + 2:], lp_new[n + 2:])) > 1e-3
    assert eng.weights_version == 6
