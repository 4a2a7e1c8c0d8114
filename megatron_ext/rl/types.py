"""Typed records at each RL boundary: sample (sampler output) -> rollout (segments) -> group -> training sample.

A rollout is one token sequence built from segments, in order: environment segments (the prompt, tool
observations; never trained on) and model segments (exactly the ids the sampler produced, with its per-token
log-probabilities and the policy version that produced each token). A multi-turn episode appends its turns to
the same sequence, so one rollout is one training sequence and nothing is ever re-tokenised. An environment that
restarts an episode in a new sequence (self-summarisation) makes a chain: one rollout per sequence, all with the
episode's `sample_index` and final reward (`sequence_index` orders them); advantages are per episode, shared by
every sequence of the chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_ext.rl.advantage import group_advantages, kl_penalised

FINISH_REASONS = ("stop", "length", "error")


@dataclass
class Sample:
    """One completion from the sampler (what `GenerateFn` returns), before any environment sees it."""

    token_ids: list[int]
    logprobs: list[float]           # log p of each token under the raw distribution (temperature 1)
    sampled_logprobs: list[float]   # log q under the distribution actually sampled from
    versions: list[int]             # policy version that produced each token
    finish_reason: str              # "stop" | "length"
    routing: Optional[np.ndarray] = None  # int16 [len(prompt) + len(tokens), moe_layers, topk] when recorded

    def __post_init__(self):
        n = len(self.token_ids)
        for name in ("logprobs", "sampled_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Sample.{name} has {len(getattr(self, name))} entries for {n} tokens")


@dataclass
class Segment:
    """A run of tokens from one source. Environment segments carry no sampler data."""

    token_ids: list[int]
    trainable: bool                          # model tokens: in the loss; environment tokens: context only
    logprobs: list[float] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @classmethod
    def environment(cls, token_ids: list[int]) -> "Segment":
        return cls(list(token_ids), False)

    @classmethod
    def model(cls, sample: Sample) -> "Segment":
        return cls(list(sample.token_ids), True, list(sample.logprobs), list(sample.sampled_logprobs),
                   list(sample.versions))


@dataclass
class Reward:
    """Named reward parts, their weighted total, and the error of a reward function that raised (total 0)."""

    parts: dict[str, float]
    total: float
    error: Optional[str] = None


@dataclass
class Rollout:
    """One episode of one prompt: the token sequence as segments, how it ended, its reward."""

    prompt_id: str
    sample_index: int                # j of the group's G samples
    segments: list[Segment]
    finish_reason: str               # "stop" | "length" | "error"
    reward: Optional[Reward] = None
    routing: Optional[np.ndarray] = None  # [num_tokens, moe_layers, topk], row t = experts of token t
    sequence_index: int = 0          # position in the episode's chain of sequences (self-summarisation)

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def per_token(self) -> dict[str, np.ndarray]:
        """Flat per-token arrays: ids, loss mask (model tokens), sampler logprobs, sampled logprobs, versions
        (environment tokens get 0 logprobs and version -1)."""
        ids, mask, lp, slp, ver = [], [], [], [], []
        for s in self.segments:
            n = len(s.token_ids)
            ids += s.token_ids
            mask += [1.0 if s.trainable else 0.0] * n
            lp += s.logprobs if s.trainable else [0.0] * n
            slp += s.sampled_logprobs if s.trainable else [0.0] * n
            ver += s.versions if s.trainable else [-1] * n
        return {"token_ids": np.asarray(ids, np.int64), "loss_mask": np.asarray(mask, np.float32),
                "logprobs": np.asarray(lp, np.float32), "sampled_logprobs": np.asarray(slp, np.float32),
                "versions": np.asarray(ver, np.int64)}

    @property
    def response_length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.trainable)

    @property
    def versions(self) -> list[int]:
        return sorted({v for s in self.segments if s.trainable for v in s.versions})


@dataclass
class Group:
    """The G rollouts of one prompt; advantages are filled in once the group is scored (and KL-penalised)."""

    prompt_id: str
    rollouts: list[Rollout]
    advantages: Optional[list[float]] = None
    k1_sums: Optional[list[float]] = None            # per rollout: sum over its model tokens of log q - log p_ref
    penalised_rewards: Optional[list[float]] = None  # per rollout: its episode's reward - beta x the episode's k1

    @property
    def rewards(self) -> list[float]:
        return [r.reward.total for r in self.rollouts]

    def _episodes(self) -> dict[int, int]:
        """sample_index -> position among the group's episodes."""
        return {j: k for k, j in enumerate(sorted({r.sample_index for r in self.rollouts}))}

    def episode_rewards(self) -> np.ndarray:
        """One reward per episode (a chain's sequences share it), in sample_index order."""
        index = self._episodes()
        out = np.zeros(len(index))
        for r in self.rollouts:
            out[index[r.sample_index]] = r.reward.total
        return out

    def episode_sums(self, values) -> np.ndarray:
        """Per-rollout values summed over each episode's sequences, in sample_index order."""
        index = self._episodes()
        out = np.zeros(len(index))
        for r, v in zip(self.rollouts, values):
            out[index[r.sample_index]] += v
        return out

    def set_kl_penalty(self, k1_sums, beta: float, std_normalize: bool):
        """Fold the k1 KL into the rewards (summed over an episode's sequences) and recompute the advantages,
        keeping both for the logs: advantage = penalised reward - group mean is checkable from them."""
        index = self._episodes()
        penalised = kl_penalised(self.episode_rewards(), self.episode_sums(k1_sums), beta)
        self.k1_sums = [float(v) for v in k1_sums]
        self.penalised_rewards = [float(penalised[index[r.sample_index]]) for r in self.rollouts]
        self.set_advantages(group_advantages(penalised, std_normalize))

    def set_advantages(self, episode_advantages):
        """Every sequence of an episode gets the episode's advantage."""
        index = self._episodes()
        self.advantages = [float(episode_advantages[index[r.sample_index]]) for r in self.rollouts]


@dataclass
class TrainingSample:
    """What the trainer consumes: one rollout flattened, with its (scalar) advantage; never re-tokenised."""

    token_ids: np.ndarray        # [n] int64
    loss_mask: np.ndarray        # [n] 1 on model tokens
    logprobs: np.ndarray         # [n] sampler's raw logprobs (0 on environment tokens)
    advantage: float
    versions: np.ndarray         # [n] policy version per token (-1 on environment tokens)
    routing: Optional[np.ndarray] = None
    group_index: int = 0         # which group of the step, for group-level quantities (KL in the reward)

    @classmethod
    def from_rollout(cls, rollout: Rollout, advantage: float, group_index: int = 0,
                     tempered: bool = False) -> "TrainingSample":
        """`tempered`: the sampler's log-probabilities under the distribution it drew from (temperature != 1)
        rather than the model's raw ones."""
        t = rollout.per_token()
        logprobs = t["sampled_logprobs"] if tempered else t["logprobs"]
        return cls(t["token_ids"], t["loss_mask"], logprobs, float(advantage), t["versions"],
                   rollout.routing, group_index)

    @property
    def positions(self) -> int:
        """Input positions (every token but the last predicts the next)."""
        return len(self.token_ids) - 1
