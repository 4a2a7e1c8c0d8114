"""MTP speculative decoding: the MTP layers draft the next tokens, one main-model forward verifies them.

With D drafting layers, MTP layer k (0-based) at the newest position combines layer k-1's output there (the
main model's hidden state for k = 0) with the embedding of the token k positions ahead, so a chain of D MTP
forwards drafts D tokens. One main forward over [the newest token, d_1 .. d_D] then yields the main model's
distribution at every one of those positions. Greedy: drafts are kept while they equal the main model's argmax,
and the argmax after the last kept one comes for free, so the output is token-for-token that of plain greedy
decoding. Sampling: draft d_i ~ q_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
a token is drawn from max(0, p_i - q_i) normalised and the round ends; if all are kept, one more token is drawn
from p_{D+1}. This leaves the output distributed exactly as the main model's (standard speculative sampling).
Log-probabilities returned are the main model's, as in plain generation.

Caches: the main model's and each MTP layer's latent caches only ever hold positions whose inputs are final
(emitted tokens); rows written from drafts lie beyond that frontier and are overwritten by the next round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_ext import platform
from megatron_ext.inference.engine import Completion, InferenceEngine, SamplingParams, sampling_probs


@dataclass
class SpeculationStats:
    drafted: int = 0  # drafts checked against the main model (a draft after a rejected one is not checked)
    accepted: int = 0
    main_forwards: int = 0
    tokens: int = 0
    checked_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.main_forwards, 1)

    def count(self, depth: int, accepted: bool):
        while len(self.checked_by_depth) <= depth:
            self.checked_by_depth.append(0)
            self.accepted_by_depth.append(0)
        self.drafted += 1
        self.checked_by_depth[depth] += 1
        if accepted:
            self.accepted += 1
            self.accepted_by_depth[depth] += 1


def _draw(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


@torch.inference_mode()
def generate_speculative(engine: InferenceEngine, prompt: list[int], params: SamplingParams,
                         stats: SpeculationStats | None = None, depth: Optional[int] = None) -> Completion:
    """Generate for one prompt with `depth` MTP layers drafting (default: all the model has)."""
    layers = len(engine.mtp_layers)
    if layers == 0:
        raise ValueError("speculative decoding needs a model with MTP layers (--mtp-num-layers >= 1)")
    depth = layers if depth is None else depth
    if not 1 <= depth <= layers:
        raise ValueError(f"draft depth must be between 1 and the model's {layers} MTP layer(s), got {depth}")
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    params.validate(engine.vocab_size)
    bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {engine.vocab_size})")
    stats = stats if stats is not None else SpeculationStats()
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with platform.without_device_mapping():
            return _Speculation(engine, prompt, params, stats, depth).run()
    finally:
        model.train(was_training)


class _Speculation:
    """One request's state. tokens[:L] are known (prompt and emitted); the main cache and the main hidden
    states cover positions < L - 1; MTP layer k's cache covers positions < fed[k]. inputs[k, j] is MTP layer
    k's hidden input at position j (the main model's final hidden state for k = 0, layer k-1's output else)."""

    def __init__(self, engine: InferenceEngine, prompt: list[int], params: SamplingParams, stats, depth: int):
        self.engine, self.params, self.stats, self.depth = engine, params, stats, depth
        self.vocab = engine.vocab_size
        n = len(prompt)
        max_len = n + params.max_tokens + depth + 1
        if max_len > engine.model.max_sequence_length:
            raise ValueError(f"prompt + max_tokens exceeds the model's {engine.model.max_sequence_length}")
        self.main_cache = engine.new_cache(len(engine.layers), 1, max_len)
        self.mtp_cache = engine.new_cache(depth, 1, max_len)
        self.inputs = torch.empty(depth, max_len, engine.config.hidden_size, dtype=engine.dtype, device=engine.device)
        self.fed = [0] * depth
        seed = engine.agreed_seed(params.seed)
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.tokens = list(prompt)
        self.out = Completion(prompt_ids=list(prompt))

    def run(self) -> Completion:
        engine, n = self.engine, len(self.tokens)
        hidden = engine.hidden(torch.tensor([self.tokens]), torch.arange(n).unsqueeze(0), self.main_cache,
                               torch.tensor([0]))
        self.stats.main_forwards += 1
        self.inputs[0, :n] = hidden[:, 0]
        last = engine.logits(hidden[-1:])[0, 0, : self.vocab]
        done = self._emit(self._pick(last), last)
        while not done:
            done = self._round()
        if engine.detokenize is not None and self.out.text is None:
            self.out.text = engine.detokenize(self.out.token_ids)
        return self.out

    def _pick(self, logits: torch.Tensor) -> int:
        if self.params.temperature == 0:
            return int(logits.argmax())
        return _draw(sampling_probs(logits, self.params), self.generator)

    def _emit(self, token: int, main_logits: torch.Tensor) -> bool:
        """Append a token; True when generation is over (stop id, stop string or max_tokens)."""
        out = self.out
        out.token_ids.append(token)
        out.logprobs.append(float(torch.log_softmax(main_logits.double(), -1)[token]))
        self.tokens.append(token)
        self.stats.tokens += 1
        if token in self.params.stop_token_ids:
            out.finish_reason = "stop"
            return True
        if self.params.stop and self.engine.detokenize is not None:
            text = self.engine.detokenize(out.token_ids)
            hit = [text.index(s) for s in self.params.stop if s in text]
            if hit:
                out.text, out.finish_reason = text[: min(hit)], "stop"
                return True
        return len(out.token_ids) >= self.params.max_tokens

    def _draft(self) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """D drafts (and their distributions when sampling), feeding each MTP layer every position since its
        cache's frontier up to the newest one, L - 2."""
        engine, L = self.engine, len(self.tokens)
        drafts, dists = [], []
        for k in range(self.depth):
            start = self.fed[k]
            ahead = (self.tokens + drafts)[start + k + 1: L + k]  # token j + k + 1 for positions j in [start, L-1)
            out = engine.mtp_hidden(k, self.inputs[k, start: L - 1].unsqueeze(1), torch.tensor([ahead]),
                                    torch.arange(start, L - 1).unsqueeze(0), self.mtp_cache, torch.tensor([start]))
            if k + 1 < self.depth:
                self.inputs[k + 1, start: L - 1] = out[:, 0]
            self.fed[k] = L - 1 - k  # later positions used a draft: recomputed next round
            logits = engine.logits(out[-1:])[0, 0, : self.vocab]
            if self.params.temperature == 0:
                drafts.append(int(logits.argmax()))
                dists.append(None)
            else:
                q = sampling_probs(logits, self.params)
                drafts.append(_draw(q, self.generator))
                dists.append(q)
        return drafts, dists

    def _round(self) -> bool:
        engine, params, L = self.engine, self.params, len(self.tokens)
        drafts, dists = self._draft()
        fed = [self.tokens[L - 1]] + drafts
        logits, hidden = engine.forward_with_hidden(torch.tensor([fed]), torch.arange(L - 1, L + len(drafts))
                                                    .unsqueeze(0), self.main_cache, torch.tensor([L - 1]))
        self.stats.main_forwards += 1
        self.inputs[0, L - 1: L + len(drafts)] = hidden[:, 0]  # rows past the accepted drafts are redone later
        logits = logits[0, :, : self.vocab]
        for i, (d, q) in enumerate(zip(drafts, dists)):
            p_logits = logits[i]
            if params.temperature == 0:
                target = int(p_logits.argmax())
                accepted = target == d
            else:
                p = sampling_probs(p_logits, params)
                u = torch.rand(1, generator=self.generator, dtype=torch.float64)
                accepted = bool(u < min(1.0, float(p[d] / q[d])))
            self.stats.count(i, accepted)
            if not accepted:
                if params.temperature > 0:
                    residual = (p - q).clamp(min=0)
                    target = _draw(residual / residual.sum() if residual.sum() > 0 else p, self.generator)
                return self._emit(target, p_logits)
            if self._emit(d, p_logits):
                return True
        return self._emit(self._pick(logits[len(drafts)]), logits[len(drafts)])
