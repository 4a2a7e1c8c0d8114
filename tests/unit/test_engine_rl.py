"""The engine API RL sampling relies on (docs/design-notes.md, "Inference for RL and serving"): per-row sampling
parameters, raw and sampled log-probabilities, groups sharing one prefill, finished rows leaving the batch,
routing as Megatron-Core's router chooses it, in-process weight updates, padded-vocabulary masking."""

import dataclasses
import math

import pytest
import torch

from megatron_ext.arguments import parse_args
from megatron_ext.inference.engine import InferenceEngine, SamplingParams, model_weights, sampling_probs
from megatron_ext.testing import init_layout_invariant_
from megatron_ext.training.initialize import destroy, initialize_distributed
from megatron_ext.training.step import build_model


def _model(args, seed):
    model = build_model(args, wrap_ddp=False, init_fn=lambda m: init_layout_invariant_(m, seed=seed))[0]
    model.eval()
    return model


@pytest.fixture(scope="module")
def setup():
    args = parse_args(["--model", "tiny", "--mock-data"], world_size=1)
    initialize_distributed(args)
    model = _model(args, seed=3)
    yield InferenceEngine(model), model, args
    destroy()


def _prompt(seed, n):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _teacher_forced(model, ids):
    """(log p of ids[t+1] under the training forward in fp32, logits [len(ids), vocab]) of the full sequence."""
    tokens, pos = torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0)
    with torch.no_grad():
        trainer = -model(tokens[:, :-1], pos[:, :-1], None, labels=tokens[:, 1:])[0]
        hidden = model.decoder(model.embedding(tokens, pos), attention_mask=None)
        logits = model.output_layer(hidden)[0][:, 0].float()
    return trainer, logits


def test_logprobs_raw_and_sampled_match_the_trainer_and_the_sampling_distribution(setup):
    eng, model, _ = setup
    rows = [SamplingParams(max_tokens=6, temperature=0.7, top_k=40, seed=1),
            SamplingParams(max_tokens=6, temperature=1.3, top_p=0.8, seed=2),
            SamplingParams(max_tokens=6, temperature=0.0)]
    prompts = [_prompt(0, 5), _prompt(1, 8), _prompt(2, 3)]
    for prompt, params, out in zip(prompts, rows, eng.generate(prompts, rows)):
        trainer, logits = _teacher_forced(model, prompt + out.token_ids)
        n = len(prompt)
        assert out.logprobs == pytest.approx(trainer[n - 1:].tolist(), abs=1e-5)  # the raw distribution
        q = sampling_probs(logits[n - 1: -1], params)
        expected = q.gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1).log()
        assert out.sampled_logprobs == pytest.approx(expected.tolist(), abs=1e-5)
        if params.temperature == 0:
            assert out.sampled_logprobs == [0.0] * len(out.token_ids)
        else:  # temperature and truncation change the distribution: the two must differ
            assert max(abs(a - b) for a, b in zip(out.logprobs, out.sampled_logprobs)) > 1e-3
        assert out.versions == [eng.weights_version] * len(out.token_ids)


def test_per_row_params_equal_each_row_alone(setup):
    eng, _, _ = setup
    prompts = [_prompt(3, 4), _prompt(4, 7), _prompt(5, 5), _prompt(6, 2)]
    rows = [SamplingParams(max_tokens=3, temperature=0.0),
            SamplingParams(max_tokens=9, temperature=1.0, top_k=5, seed=7),
            SamplingParams(max_tokens=7, temperature=0.5, top_p=0.5, seed=8),
            SamplingParams(max_tokens=8, temperature=2.0, seed=9)]
    alone = [eng.generate([p], r)[0] for p, r in zip(prompts, rows)]
    # a stop id the last row draws on its own: the batch must stop that row there too
    rows[3] = dataclasses.replace(rows[3], stop_token_ids=(alone[3].token_ids[2],))
    alone[3] = eng.generate([prompts[3]], rows[3])[0]
    together = eng.generate(prompts, rows)
    for got, want, params in zip(together, alone, rows):
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert got.sampled_logprobs == pytest.approx(want.sampled_logprobs, abs=1e-5)
    assert [len(c.token_ids) for c in together[:3]] == [3, 9, 7]
    assert together[3].finish_reason == "stop" and len(together[3].token_ids) <= 3


def test_finished_rows_leave_the_decode_batch(setup, monkeypatch):
    eng, _, _ = setup
    batches = []
    hidden = eng.hidden

    def counting(tokens, *args, **kwargs):
        batches.append(tuple(tokens.shape))
        return hidden(tokens, *args, **kwargs)

    monkeypatch.setattr(eng, "hidden", counting)
    rows = [SamplingParams(max_tokens=2, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.0),
            SamplingParams(max_tokens=4, temperature=0.0, return_routing=True)]
    eng.generate([[1, 2, 3], [4, 5], [6]], rows)
    # prefill; decode steps feed tokens 1..5 of the longest row. The 2-token row is fed once (its first token);
    # the routing row is fed all 4 of its tokens (the last one only for its experts), the 6-token row 5.
    assert batches == [(3, 3), (3, 1), (2, 1), (2, 1), (2, 1), (1, 1)]


def test_groups_share_one_prefill_and_equal_separate_generation(setup):
    eng, model, _ = setup
    prompts = [_prompt(10, 6), _prompt(11, 3)]
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=20),
              SamplingParams(max_tokens=4, temperature=0.8, top_k=30, seed=40)]
    before = eng.prefill_tokens
    groups = eng.generate_groups(prompts, 3, params)
    assert eng.prefill_tokens - before == 6 + 3  # each prompt prefilled once, not 3 times
    assert [len(g) for g in groups] == [3, 3]
    for prompt, p, group in zip(prompts, params, groups):
        for j, sample in enumerate(group):
            alone = eng.generate([prompt], dataclasses.replace(p, seed=p.seed + j))[0]
            assert sample.prompt_ids == prompt and sample.token_ids == alone.token_ids
            assert sample.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert len({tuple(s.token_ids) for s in group}) > 1  # different seeds, different samples
        trainer, _ = _teacher_forced(model, prompt + group[1].token_ids)
        assert group[1].logprobs == pytest.approx(trainer[len(prompt) - 1:].tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="n must be"):
        eng.generate_groups(prompts, 0, params[0])


@pytest.fixture
def recording_routers(setup):
    """Megatron-Core's RouterReplay on every decoder router, recording what the router chooses."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    _, model, _ = setup
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    before = list(RouterReplay.global_router_replay_instances)
    for router in routers:
        router.router_replay = RouterReplay()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    yield routers
    for router in routers:
        router.router_replay = None
    RouterReplay.global_router_replay_instances[:] = before


def _megatron_routing(model, routers, ids):
    """[len(ids), MoE layers, topk]: what Megatron-Core's routers record in a teacher-forced forward."""
    _teacher_forced(model, ids)
    return torch.stack([r.router_replay.get_recorded_indices() for r in routers], dim=1)


@pytest.mark.parametrize("mode", ["batch", "group", "speculative"])
def test_routing_equals_megatrons_router_choices(setup, recording_routers, mode):
    from megatron_ext.inference.speculative import generate_speculative

    eng, model, _ = setup
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=3, return_routing=True)
    prompts = [_prompt(30, 5), _prompt(31, 9)]
    if mode == "batch":
        outs = eng.generate(prompts, params)
    elif mode == "group":
        outs = [c for g in eng.generate_groups(prompts, 2, params) for c in g]
    else:
        outs = [generate_speculative(eng, p, dataclasses.replace(params, temperature=t))
                for p in prompts for t in (0.0, 1.0)]
    for out in outs:
        ids = out.prompt_ids + out.token_ids
        assert out.routing.dtype == torch.int16 and out.routing.shape[0] == len(ids)
        assert torch.equal(out.routing.long(), _megatron_routing(model, recording_routers, ids))
        replay = out.routing_for_replay()
        assert len(replay) == len(recording_routers) and replay[0].shape == (len(ids), eng.config.moe_router_topk)


def test_update_weights_in_process(setup):
    eng, model, args = setup
    other = _model(args, seed=11)
    prompt = _prompt(50, 6)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = InferenceEngine(other).generate([prompt], params)[0]
    fresh = _model(args, seed=3)  # a copy of the engine's weights, to restore them afterwards
    engine = InferenceEngine(model, weights_version=4)
    before = engine.generate([prompt], params)[0]
    assert before.token_ids != want.token_ids or before.logprobs != pytest.approx(want.logprobs, abs=1e-5)

    weights = model_weights(model)
    snapshot = {k: v.clone() for k, v in weights.items()}
    bad = dict(model_weights(other))
    name = "decoder.layers.1.mlp.router.weight"
    bad[name] = torch.zeros(bad[name].shape[0] + 1, bad[name].shape[1])
    with pytest.raises(ValueError, match=f"shape mismatch.*{name}"):
        engine.update_weights(bad.items())
    with pytest.raises(ValueError, match="does not have"):
        engine.update_weights(list(model_weights(other).items()) + [("decoder.layers.99.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="not given"):
        engine.update_weights([(k, v) for k, v in model_weights(other).items() if "embedding" not in k])
    assert all(torch.equal(weights[k], snapshot[k]) for k in weights)  # nothing was copied
    assert engine.weights_version == 4

    assert engine.update_weights(other) == 5  # a module, as the trainer holds it
    got = engine.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
    assert got.versions == [5] * len(got.token_ids)
    assert "decoder.layers.1.mlp.router.expert_bias" in weights  # persistent buffers travel too
    # (name, tensor) pairs with the DDP wrapper's prefix, an explicit version
    assert engine.update_weights([("module." + k, v) for k, v in model_weights(fresh).items()], version=9) == 9
    assert engine.generate([prompt], params)[0].token_ids == before.token_ids


def test_padded_vocabulary_ids_are_never_sampled(setup):
    eng, model, _ = setup
    engine = InferenceEngine(model, vocab_size=100)
    outs = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=12, temperature=5.0, seed=1))
    assert all(0 <= t < 100 for c in outs for t in c.token_ids)
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0]
    _, logits = _teacher_forced(model, [5, 6, 7] + greedy.token_ids)
    raw = torch.log_softmax(logits[2:-1, :100].double(), -1)
    assert greedy.token_ids == raw.argmax(-1).tolist()
    assert greedy.logprobs == pytest.approx(raw.max(-1).values.tolist(), abs=1e-5)  # normalised over 100 ids
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[100]], SamplingParams())
    with pytest.raises(ValueError, match="does not fit"):
        InferenceEngine(model, vocab_size=model.vocab_size + 1)


def test_groups_of_different_sizes_and_token_callbacks(setup):
    eng, _, _ = setup
    prompts = [_prompt(60, 4), _prompt(61, 6)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2)
    seen = []
    groups = eng.generate_groups(prompts, [1, 3], params, on_token=lambda row, token, lp: seen.append((row, token, lp)))
    assert [len(g) for g in groups] == [1, 3]
    flat = [c for g in groups for c in g]
    for row, c in enumerate(flat):
        mine = [(t, lp) for r, t, lp in seen if r == row]
        assert [t for t, _ in mine] == c.token_ids and [lp for _, lp in mine] == c.logprobs
    assert groups[1][2].token_ids == eng.generate([prompts[1]], dataclasses.replace(params, seed=4))[0].token_ids


def _reference_distribution(logits, temperature, top_k, top_p):
    """Temperature, top-k, top-p written out token by token (no shared code with the engine)."""
    if temperature == 0:
        out = [0.0] * len(logits)
        out[max(range(len(logits)), key=lambda i: logits[i])] = 1.0
        return out
    scores = [x / temperature for x in logits]
    keep = set(range(len(scores)))
    if top_k:
        kth = sorted(scores, reverse=True)[top_k - 1]
        keep = {i for i in keep if scores[i] >= kth}
    if top_p < 1:
        z = sum(math.exp(scores[i]) for i in keep)
        chosen, mass = set(), 0.0
        for i in sorted(keep, key=lambda i: -scores[i]):
            if mass >= top_p:
                break
            chosen.add(i)
            mass += math.exp(scores[i]) / z
        keep = chosen
    z = sum(math.exp(scores[i]) for i in keep)
    return [math.exp(scores[i]) / z if i in keep else 0.0 for i in range(len(scores))]


def test_row_sampling_distributions_match_a_direct_implementation():
    from megatron_ext.inference.engine import row_sampling_probs

    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    rows = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 8, 0.8), (0.0, 0, 1.0)]
    t, k, p = (torch.tensor(v, dtype=d) for v, d in zip(zip(*rows), (torch.float64, torch.long, torch.float64)))
    got = row_sampling_probs(logits, torch.where(t > 0, t, 1.0), k, p, t == 0)
    for row, (temperature, top_k, top_p) in enumerate(rows):
        want = _reference_distribution(logits[row].tolist(), temperature, top_k, top_p)
        assert got[row].tolist() == pytest.approx(want, abs=1e-12)
    plain = row_sampling_probs(logits[:2], torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long),
                               torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.bool))
    assert plain.tolist()[1] == pytest.approx(_reference_distribution(logits[1].tolist(), 1.0, 0, 1.0), abs=1e-12)


def test_multi_turn_rollouts_continue_each_episodes_cache(setup):
    """RL's multi-turn rollouts (rollout.run_groups through EngineGenerate, groups of 3, seeded sampling) with the
    engine's prefix store: every turn after the first prefills only the tokens its episode added (the last sampled
    token and the observation), and the groups are the ones a full prefill per turn gives: the same tokens,
    log-probabilities to 1e-5, rewards."""
    from megatron_ext.env.token_env import StepResult
    from megatron_ext.rl.rollout import EngineGenerate, EpisodeConfig, Sampling, run_groups
    from megatron_ext.rl.types import Reward

    eng, _, _ = setup

    class Echo:
        """Three turns; the observation is the model's last two tokens and the turn number; reward: tokens seen."""

        def reset(self, task):
            self.turns, self.seen = 0, 0
            return _prompt(task["seed"], 24)

        def step(self, tokens):
            self.turns, self.seen = self.turns + 1, self.seen + len(tokens)
            return StepResult([], True) if self.turns == 3 else StepResult(list(tokens[-2:]) + [self.turns], False)

        def score(self):
            return Reward({"seen": float(self.seen)}, float(self.seen))

    tasks = [{"id": "a", "seed": 10}, {"id": "b", "seed": 11}]
    cfg = EpisodeConfig(3, Sampling(max_tokens=5, temperature=1.0, seed=4), max_turns=3, max_response_length=15)
    runs = {}
    try:
        for mb in (0, 64):
            store = eng.enable_prefix_store(mb)
            before = eng.prefill_tokens
            runs[mb] = run_groups(tasks, Echo, EngineGenerate(eng), cfg), eng.prefill_tokens - before, store
    finally:
        eng.enable_prefix_store(0)
    (plain, plain_prefill, _), (cached, cached_prefill, store) = runs[0], runs[64]
    episodes = [(g, r) for g in cached for r in g.rollouts]
    later_turns = sum(1 for _, r in episodes for s in r.segments[2::2])  # observations after the first turn
    assert store.hits == later_turns == 2 * 3 * 2
    # turn 1: each task's prompt once (its 3 samples share it); later turns: the last token + a 3-token observation
    assert cached_prefill == 2 * 24 + later_turns * (1 + 3) < plain_prefill
    for a, b in zip(plain, cached):
        assert [r.reward.total for r in a.rollouts] == [r.reward.total for r in b.rollouts]
        for x, y in zip(a.rollouts, b.rollouts):
            assert [s.token_ids for s in x.segments] == [s.token_ids for s in y.segments]
            assert [lp for s in x.segments if s.trainable for lp in s.logprobs] == pytest.approx(
                [lp for s in y.segments if s.trainable for lp in s.logprobs], abs=1e-5)
