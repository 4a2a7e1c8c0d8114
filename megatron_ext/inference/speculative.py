"""MTP speculative decoding: the MTP layers draft the next tokens, one main-model forward verifies them.

With D drafting layers, MTP layer k (0-based) at the newest position combines layer k-1's output there (the
main model's hidden state for k = 0) with the embedding of the token k positions ahead, so a chain of D MTP
forwards drafts D tokens. One main forward over [the newest token, d_1 .. d_D] then yields the main model's
distribution at every one of those positions. Greedy: drafts are kept while they equal the main model's argmax,
and the argmax after the last kept one comes for free, so the output is token-for-token that of plain greedy
decoding. Sampling: draft d_i ~ q_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
a token is drawn from max(0, p_i - q_i) normalised and the round ends; if all are kept, one more token is drawn
from p_{D+1}. This leaves the output distributed exactly as the main model's (standard speculative sampling).
Log-probabilities returned are the main model's, as in plain generation: `logprobs` under its raw distribution,
`sampled_logprobs` under its sampling distribution (which the accepted-or-resampled token follows exactly).
Routing, when asked for, is the main model's: the prompt's from the prefill, each emitted token's from the
verify forward that fed it once its prefix was final (a rejected draft's rows are dropped), and the last token's
from one more forward of it.

Caches: the main model's and each MTP layer's latent caches only ever hold positions whose inputs are final
(emitted tokens); rows written from drafts lie beyond that frontier and are overwritten by the next round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_ext import platform
from megatron_ext.inference.engine import Completion, InferenceEngine, SamplingParams, _finished, sampling_probs


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
                         stats: SpeculationStats | None = None, depth: Optional[int] = None,
                         on_token: Optional[Callable[[int, int, float], None]] = None) -> Completion:
    """Generate for one prompt with `depth` MTP layers drafting (default: all the model has); `on_token(0,
    token_id, logprob)` is called as each token is emitted."""
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
            return _Speculation(engine, prompt, params, stats, depth, on_token).run()
    finally:
        model.train(was_training)


class _Speculation:
    """One request's state. tokens[:L] are known (prompt and emitted); the main cache and the main hidden
    states cover positions < L - 1; MTP layer k's cache covers positions < fed[k]. inputs[k, j] is MTP layer
    k's hidden input at position j (the main model's final hidden state for k = 0, layer k-1's output else)."""

    def __init__(self, engine: InferenceEngine, prompt: list[int], params: SamplingParams, stats, depth: int,
                 on_token=None):
        self.engine, self.params, self.stats, self.depth, self.on_token = engine, params, stats, depth, on_token
        self.vocab = engine.vocab_size
        n = len(prompt)
        max_len = n + params.max_tokens + depth + 1
        if max_len > engine.model.max_sequence_length:
            raise ValueError(f"prompt + max_tokens exceeds the model's {engine.model.max_sequence_length}")
        self.dev = engine.device
        if any(r is not None for r in engine.recurrent):
            raise ValueError("MTP speculative decoding is not supported for Kimi Linear (KDA) models: rejected "
                             "draft tokens cannot be taken back out of a recurrent state; generate without "
                             "speculation")
        self.main_cache = engine.new_cache(len(engine.layers), 1, max_len)
        self.mtp_cache = engine.new_cache(depth, 1, max_len)
        self.inputs = torch.empty(depth, max_len, engine.config.hidden_size, dtype=engine.dtype, device=self.dev)
        self.fed = [0] * depth
        self.generator = engine.generator(engine.agreed_seed(params.seed))
        self.tokens = list(prompt)
        self.out = Completion(prompt_ids=list(prompt))
        self.routing: Optional[list[torch.Tensor]] = [] if params.return_routing else None  # [positions, L, k]

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.dev)

    def _positions(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.dev).unsqueeze(0)

    def _main(self, tokens: list[int], start: int, keep: Optional[int] = None):
        """Main-model forward of `tokens` at positions start..; records the routing of the first `keep` of them
        (default: all) once the caller knows how many are final (see _keep_routing)."""
        routing = [] if self.routing is not None else None
        logits, hidden = self.engine.forward_with_hidden(self._tensor([tokens]), self._positions(start, start + len(tokens)),
                                                         self.main_cache, self._tensor([start]), routing)
        self.stats.main_forwards += 1
        self._pending = torch.stack(routing, dim=1) if routing is not None else None
        return logits, hidden

    def _keep_routing(self, count: int):
        if self._pending is not None and count > 0:
            self.routing.append(self._pending[:count])

    def run(self) -> Completion:
        engine, n = self.engine, len(self.tokens)
        logits, hidden = self._main(self.tokens, 0)
        self._keep_routing(n)
        self.inputs[0, :n] = hidden[:, 0]
        last = logits[0, -1, : self.vocab]
        done = self._emit(self._pick(last), last)
        while not done:
            done = self._round()
        if self.routing is not None:  # the newest token's experts: one more forward of it
            L = len(self.tokens)
            self._main(self.tokens[L - 1:], L - 1)
            self._keep_routing(1)
            self.out.routing = torch.cat(self.routing).to(torch.int16).cpu()
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
        sampled = 0.0 if self.params.temperature == 0 else sampling_probs(main_logits, self.params)[token].log()
        values = torch.stack((torch.log_softmax(main_logits.double(), -1)[token],
                              torch.as_tensor(sampled, dtype=torch.float64, device=main_logits.device))).tolist()
        out.logprobs.append(values[0])
        out.sampled_logprobs.append(values[1])
        out.versions.append(self.engine.weights_version)
        self.tokens.append(token)
        self.stats.tokens += 1
        if self.on_token is not None:
            self.on_token(0, token, values[0])
        return _finished(out, self.params, self.engine.detokenize)

    def _draft(self) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """D drafts (and their distributions when sampling), feeding each MTP layer every position since its
        cache's frontier up to the newest one, L - 2."""
        engine, L = self.engine, len(self.tokens)
        drafts, dists = [], []
        for k in range(self.depth):
            start = self.fed[k]
            ahead = (self.tokens + drafts)[start + k + 1: L + k]  # token j + k + 1 for positions j in [start, L-1)
            out = engine.mtp_hidden(k, self.inputs[k, start: L - 1].unsqueeze(1), self._tensor([ahead]),
                                    self._positions(start, L - 1), self.mtp_cache, self._tensor([start]))
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
        L = len(self.tokens)
        done = self._verify()
        # positions L-1 .. len-2 were fed with their final tokens (the newest is fed next round, or at the end)
        self._keep_routing(len(self.tokens) - L)
        return done

    def _verify(self) -> bool:
        params, L = self.params, len(self.tokens)
        drafts, dists = self._draft()
        logits, hidden = self._main([self.tokens[L - 1]] + drafts, L - 1)
        self.inputs[0, L - 1: L + len(drafts)] = hidden[:, 0]  # rows past the accepted drafts are redone later
        logits = logits[0, :, : self.vocab]
        for i, (d, q) in enumerate(zip(drafts, dists)):
            p_logits = logits[i]
            if params.temperature == 0:
                target = int(p_logits.argmax())
                accepted = target == d
            else:
                p = sampling_probs(p_logits, params)
                u = torch.rand(1, generator=self.generator, dtype=torch.float64, device=self.dev)
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
