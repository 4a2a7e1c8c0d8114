"""Episodes: prompts through an injected generate function and environments into scored groups.

Rollout code never imports the inference engine: it takes `generate(prompts, n, sampling) -> samples[i][j]` (the
j-th of n samples for prompt i). `EngineGenerate` adapts the local engine (megatron_ext/inference, ENGINE_API);
tests use a fake. Turns are appended to one token sequence: environment tokens (prompt, observations) as
environment segments, the sampler's tokens as model segments, exactly as produced.
"""

from __future__ import annotations

import collections
import math

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from megatron_ext.rl.advantage import group_advantages
from megatron_ext.rl.env import Environment
from megatron_ext.rl.types import Group, Reward, Rollout, Sample, Segment


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    return_routing: bool = False


class GenerateFn(Protocol):
    def __call__(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]: ...


class EngineGenerate:
    """GenerateFn on the local InferenceEngine (ENGINE_API): `generate_groups` shares one prefill per prompt;
    sample j of prompt i draws with seed + i * n + j, so a step's samples are reproducible.

    With `speculative`, every sample is decoded with MTP drafting, all samples of the call batched together
    (inference/speculative_batch.py; `draft_depth` MTP layers, default all): lossless, i.e. the main model's
    distribution (greedy: the very tokens of plain decoding), with the main model's raw and sampled
    log-probabilities, versions and routing for every token; the same seeds. `pop_speculation()` returns the drafts
    accepted and proposed since its last call (and starts acceptance over). `speculation_policy` "auto": a call
    whose batch is not expected to gain from drafting (costs measured per batch size, acceptance observed since
    the last pop) is decoded plainly, the same tokens; "always": every call drafts."""

    def __init__(self, engine, speculative: bool = False, draft_depth: Optional[int] = None,
                 speculation_policy: str = "always"):
        self.engine, self.speculative, self.draft_depth = engine, speculative, draft_depth
        if speculation_policy not in ("auto", "always"):
            raise ValueError(f"speculation policy must be 'auto' or 'always', got {speculation_policy!r}")
        self.speculation_policy = speculation_policy
        self.stats = None
        self.batch_rows: collections.Counter = collections.Counter()  # rows of an engine batch -> batches
        self.step_rows: collections.Counter = collections.Counter()  # continuous: rows decoding -> decode steps
        self._continuous, self._calls = None, {}
        if speculative:
            from megatron_ext.inference.speculative import SpeculationStats

            if not engine.mtp_layers:
                raise ValueError("speculative rollouts need a model with MTP layers (--mtp-num-layers >= 1)")
            self.stats = SpeculationStats()

    def __call__(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        return self.many([(prompts, n, sampling)])[0]

    @property
    def max_sequence_length(self) -> int:
        """Prompt + new tokens one sequence may hold (the engine refuses more)."""
        return self.engine.model.max_sequence_length

    def many(self, calls: list[tuple[list[list[int]], int, Sampling]]) -> list[list[list[Sample]]]:
        """Several generate calls (each `(prompts, n, sampling)`) as one engine batch: a multi-turn episode's next
        turns, or the turns of several requests a rollout worker holds. Each call keeps its own seeds, so its
        samples are those it would draw alone; `batch_rows` counts the engine batches by their rows."""
        prompts, counts, params = self._request(calls)
        self.batch_rows[sum(counts)] += 1
        if self.speculative:
            flat = self._speculative(prompts, counts, params)
        else:
            flat = self.engine.generate_groups(prompts, counts, params)
        return self._split(calls, flat)

    # continuous batching (rl/workers.py, --rl-continuous-batching): calls join the decode batch between steps
    def submit(self, calls: list[tuple[list[list[int]], int, Sampling]]) -> int:
        """Add several generate calls to the running decode batch (their prompts are prefilled now); returns a
        ticket that `advance` hands back with their samples once all of their rows have finished."""
        if self.speculative:
            raise ValueError("continuous batching decodes without MTP speculation (drop --rl-speculative or "
                             "--rl-continuous-batching)")
        if self._continuous is None:
            self._continuous = self.engine.continuous()
        prompts, counts, params = self._request(calls)
        ticket = self._continuous.add(prompts, counts, params)
        self._calls[ticket] = calls
        return ticket

    def advance(self) -> dict[int, list[list[list[Sample]]]]:
        """One decode step of every row in flight; the tickets it completed, each with what `many` would return
        for its calls. `step_rows` counts the decode steps by the rows they decoded."""
        if self._continuous is None or not self._continuous.decoding:
            return {}
        self.step_rows[self._continuous.decoding] += 1
        done = self._continuous.step()
        return {t: self._split(self._calls.pop(t), groups) for t, groups in done.items()}

    @property
    def decoding(self) -> int:
        """Rows in the continuous decode batch now."""
        return 0 if self._continuous is None else self._continuous.decoding

    def reset(self):
        """Drop the continuous batch (after a failure inside it: its rows are lost)."""
        self._continuous, self._calls = None, {}

    @staticmethod
    def _request(calls) -> tuple[list[list[int]], list[int], list]:
        """(prompts, samples per prompt, SamplingParams per prompt) of several calls; sample j of prompt i of a
        call with seed s draws with s + i * n + j."""
        from megatron_ext.inference.engine import SamplingParams

        prompts, counts, params = [], [], []
        for p, n, sampling in calls:
            base = SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
                                  stop_token_ids=tuple(sampling.stop_token_ids),
                                  return_routing=sampling.return_routing)
            for i in range(len(p)):
                params.append(base if sampling.seed is None else
                              SamplingParams(**{**vars(base), "seed": sampling.seed + i * n}))
            prompts += p
            counts += [n] * len(p)
        return prompts, counts, params

    def _split(self, calls, flat) -> list[list[list[Sample]]]:
        out, k = [], 0
        for p, _, _ in calls:
            out.append([[self._sample(c) for c in g] for g in flat[k:k + len(p)]])
            k += len(p)
        return out

    def _speculative(self, prompts, n, params):
        from megatron_ext.inference.speculative_batch import generate_speculative_groups

        return generate_speculative_groups(self.engine, prompts, n, params, self.stats, self.draft_depth,
                                           policy=self.speculation_policy)

    def pop_speculation(self) -> dict[str, int]:
        """Drafts proposed and accepted, main-model forwards and tokens since the last call (zeros without
        speculation); resets the counts."""
        if self.stats is None:
            return {"drafted": 0, "accepted": 0, "main_forwards": 0, "tokens": 0}
        s = self.stats
        out = {"drafted": s.drafted, "accepted": s.accepted, "main_forwards": s.main_forwards, "tokens": s.tokens}
        self.stats = type(s)()
        return out

    @staticmethod
    def _sample(c) -> Sample:
        routing = None if c.routing is None else c.routing.cpu().numpy()
        return Sample(list(c.token_ids), list(c.logprobs), list(c.sampled_logprobs), list(c.versions),
                      c.finish_reason, routing)


@dataclass
class EpisodeConfig:
    group_size: int
    sampling: Sampling
    max_turns: int = 1
    max_response_length: int = 0  # total model tokens of an episode (0: sampling.max_tokens)


def concurrently(fn: Callable, items: list, workers: int) -> list:
    """[fn(x) for x in items], at most `workers` calls at a time in threads (1: one after another, in this thread).
    For environment calls, which mostly wait on sandboxed processes (a tool's command, the grading tests): a turn's
    episodes overlap instead of queueing, so generation (on the GPU, or the other ranks' CPU work) does not wait
    for their sum. Every call has returned before this does; the first failure (in item order) is then raised."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(workers, len(items)), thread_name_prefix="env") as pool:
        futures = [pool.submit(fn, x) for x in items]
        done = [f.exception() for f in futures]  # waits for every call, so none is still running on a raise
    for f, error in zip(futures, done):
        if error is not None:
            raise error
    return [f.result() for f in futures]


def run_groups(tasks: list[dict], make_env: Callable[[], Environment], generate: GenerateFn, cfg: EpisodeConfig,
               std_normalize: bool = False) -> list[Group]:
    """G episodes per task, scored; advantages filled in from the (KL-free) rewards.

    An episode is one sequence, or a chain of sequences when the environment restarts it (`StepResult.restart`,
    self-summarisation: the model's turn closes the sequence and the observation is the next one's prompt). Every
    sequence is a rollout with the episode's sample_index and final reward; turns and the token budget count over
    the whole episode. When anything raises, environments with a `close()` (sandboxes) are closed first.
    Environment calls (reset, step, score) of different episodes run `make_env.concurrency` at a time (an
    attribute of the factory, e.g. the coding environment's --env-concurrency; absent: 1), each episode's own calls
    in order."""
    envs: list[list[Environment]] = []
    try:
        for _ in tasks:
            envs.append([make_env() for _ in range(cfg.group_size)])
        return _episodes(tasks, envs, generate, cfg, std_normalize, max(1, int(getattr(make_env, "concurrency", 1))))
    except BaseException:
        for env in (e for row in envs for e in row):
            if hasattr(env, "close"):
                env.close()
        raise


def _episodes(tasks: list[dict], envs: list[list[Environment]], generate: GenerateFn, cfg: EpisodeConfig,
              std_normalize: bool, workers: int = 1) -> list[Group]:
    g = cfg.group_size
    pairs = [(i, j) for i in range(len(tasks)) for j in range(g)]
    opened = concurrently(lambda ij: envs[ij[0]][ij[1]].reset(tasks[ij[0]]), pairs, workers)
    prompts = [opened[i * g] for i in range(len(tasks))]  # every episode of a task starts from the same prompt
    budget = cfg.max_response_length or cfg.sampling.max_tokens
    first = generate(prompts, g, cfg.sampling)
    # chains[i][j]: the sequences of episode j of task i, each a list of segments; finish and routing per sequence
    chains = [[[[Segment.environment(prompts[i])]] for _ in range(g)] for i in range(len(tasks))]
    finish: list[list[list[str]]] = [[[] for _ in range(g)] for _ in tasks]
    routing: list[list[list[Optional[np.ndarray]]]] = [[[] for _ in range(g)] for _ in tasks]

    def used(i: int, j: int) -> int:
        return sum(len(s.token_ids) for seq in chains[i][j] for s in seq if s.trainable)

    # a multi-turn sequence grows by its observations: it ends ("length") when the generator's context has no room
    # for another turn, and a turn asks for at most the room left (the engine refuses a request that cannot fit)
    context = getattr(generate, "max_sequence_length", None)

    def room(i: int, j: int, observation: list[int], restart: bool) -> Optional[int]:
        if context is None:
            return None
        held = 0 if restart else sum(len(s.token_ids) for s in chains[i][j][-1])
        return context - held - len(observation)

    active = [(i, j, first[i][j]) for i in range(len(tasks)) for j in range(g)]
    turn = 0
    while active:
        turn += 1
        follow = []
        results = concurrently(lambda a: envs[a[0]][a[1]].step(a[2].token_ids), active, workers)
        for (i, j, sample), result in zip(active, results):
            chains[i][j][-1].append(Segment.model(sample))
            restart = bool(getattr(result, "restart", False))
            left = None if result.done else room(i, j, result.observation, restart)
            ended = sample.finish_reason if result.done else \
                "length" if turn >= cfg.max_turns or used(i, j) >= budget or (left is not None and left < 1) \
                else None
            if ended is not None or restart:  # this sequence is complete
                finish[i][j].append(ended or sample.finish_reason)
                routing[i][j].append(sample.routing)  # the last sample's routing covers its whole context
            if ended is not None:
                continue
            if restart:
                chains[i][j].append([Segment.environment(result.observation)])
            else:
                chains[i][j][-1].append(Segment.environment(result.observation))
            follow.append((i, j))
        if not follow:
            break
        calls = []
        for i, j in follow:
            ctx = [t for s in chains[i][j][-1] for t in s.token_ids]
            left = budget - used(i, j) if context is None else min(budget - used(i, j), context - len(ctx))
            sampling = Sampling(**{**vars(cfg.sampling), "max_tokens": min(cfg.sampling.max_tokens, left),
                                   "seed": None if cfg.sampling.seed is None else cfg.sampling.seed + 7919 * turn + i * g + j})
            calls.append(([ctx], 1, sampling))
        many = getattr(generate, "many", None)  # the turn's episodes in one batch where the generator can
        outs = many(calls) if many is not None else [generate(*c) for c in calls]
        active = [(i, j, out[0][0]) for (i, j), out in zip(follow, outs)]
    rewards = concurrently(lambda ij: _as_reward(envs[ij[0]][ij[1]].score()), pairs, workers)
    groups = []
    for i, t in enumerate(tasks):
        rollouts = []
        for j in range(g):
            reward = rewards[i * g + j]
            for k, (segments, fin, rt) in enumerate(zip(chains[i][j], finish[i][j], routing[i][j])):
                rollouts.append(Rollout(t["id"], j, segments, "error" if reward.error else fin, reward, rt, k))
        grp = Group(t["id"], rollouts)
        grp.set_advantages(group_advantages(grp.episode_rewards(), std_normalize))
        groups.append(grp)
    return groups


def _as_reward(score) -> Reward:
    """An environment's score as a Reward: anything with `parts`, `total` and optionally `error` (env.Rubric's
    Reward, the coding environment's Score)."""
    if not isinstance(score, Reward):
        try:
            score = Reward(dict(score.parts), float(score.total), getattr(score, "error", None))
        except AttributeError:
            raise TypeError(f"Environment.score() returned {type(score).__name__}; it needs .parts and .total") \
                from None
    return finite_reward(score)


def finite_reward(reward: Reward) -> Reward:
    """A NaN/Inf total or part is the sample's error (total 0), as a reward function that raised: trained as a
    failed sample, never as a NaN that skips the step and still logs the group as trained."""
    bad = {k: v for k, v in reward.parts.items() if not math.isfinite(v)}
    if math.isfinite(reward.total) and not bad:
        return reward
    what = ", ".join(f"{k}={v}" for k, v in bad.items()) or f"total={reward.total}"
    return Reward(reward.parts, 0.0, error=(reward.error + "; " if reward.error else "") + f"non-finite reward: {what}")


def reference_groups(tasks: list[dict], make_env: Callable[[], Environment]) -> list[Group]:
    """Each task's reference answer as a one-sample group with advantage 1: the GRPO loss then reduces to
    cross-entropy on the answer (the supervised warm-up); scored by the environment like any rollout."""
    groups = []
    for t in tasks:
        env = make_env()
        prompt = env.reset(t)
        answer = env.reference(t)
        env.step(answer)
        sample = Sample(answer, [0.0] * len(answer), [0.0] * len(answer), [0] * len(answer), "stop")
        groups.append(Group(t["id"], [Rollout(t["id"], 0, [Segment.environment(prompt), Segment.model(sample)],
                                              "stop", _as_reward(env.score()))], [1.0]))
    return groups
