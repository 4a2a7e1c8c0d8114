"""MTP speculative decoding: the MTP layer drafts the token after next, one main-model forward verifies it.

Each verify step feeds the main model [the newest token, the draft] and so yields the main model's
distribution at both positions. Greedy: the draft is kept when it equals the main model's argmax, and the
argmax after it comes for free, so the output is token-for-token that of plain greedy decoding. Sampling: the
draft d ~ q is kept with probability min(1, p(d)/q(d)), otherwise a token is drawn from max(0, p - q)
normalised; this leaves the output distributed exactly as the main model's (standard speculative sampling).
Depth is one draft token per step (the first MTP layer), as DeepSeek-V3 and Kimi K2 ship one MTP module.
Log-probabilities returned are the main model's, as in plain generation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.inference.engine import Completion, InferenceEngine, LatentCache, SamplingParams, sampling_probs


@dataclass
class SpeculationStats:
    drafted: int = 0
    accepted: int = 0
    main_forwards: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.main_forwards, 1)


def _draw(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


@torch.no_grad()
def generate_speculative(engine: InferenceEngine, prompt: list[int], params: SamplingParams,
                         stats: SpeculationStats | None = None) -> Completion:
    model = engine.model
    if getattr(model, "mtp", None) is None:
        raise ValueError("speculative decoding needs a model with MTP layers (--mtp-num-layers >= 1)")
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    params.validate(engine.vocab_size)
    stats = stats if stats is not None else SpeculationStats()
    was_training = model.training
    model.eval()
    try:
        return _speculate(engine, prompt, params, stats)
    finally:
        model.train(was_training)


def _speculate(engine: InferenceEngine, prompt: list[int], params: SamplingParams, stats) -> Completion:
    cfg = engine.config
    vocab = engine.vocab_size
    n = len(prompt)
    max_len = n + params.max_tokens + 2
    if max_len > engine.model.max_sequence_length:
        raise ValueError(f"prompt + max_tokens exceeds the model's {engine.model.max_sequence_length}")
    dtype = engine.model.embedding.word_embeddings.weight.dtype
    main_cache = LatentCache(len(engine.layers), 1, max_len, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, dtype, "cpu")
    mtp_cache = LatentCache(1, 1, max_len, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, dtype, "cpu")
    g = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    out = Completion(prompt_ids=list(prompt))

    # Invariant: the main cache holds positions < L-1, hiddens[j] is the main model's final hidden state at j for
    # j < L-1, and tokens[L-1] (L = len(tokens)) is known but not yet through the main model.
    logits, hidden = engine.forward_with_hidden(torch.tensor([prompt]), torch.arange(n).unsqueeze(0), main_cache,
                                                torch.tensor([0]))
    stats.main_forwards += 1
    tokens = list(prompt)
    hiddens = [hidden[j] for j in range(n)]
    mtp_fed = 0  # MTP positions below this are in the MTP cache

    def emit(token: int, main_logits: torch.Tensor) -> bool:
        out.token_ids.append(token)
        out.logprobs.append(float(torch.log_softmax(main_logits.double(), -1)[token]))
        tokens.append(token)
        stats.tokens += 1
        if token in params.stop_token_ids:
            out.finish_reason = "stop"
            return True
        return len(out.token_ids) >= params.max_tokens

    last = logits[0, -1, :vocab]
    if emit(_draw(sampling_probs(last, params), g), last):
        return _finish(engine, out)
    while True:
        L = len(tokens)
        # draft tokens[L] with MTP position L-2 (main hidden h_{L-2} + embedding of tokens[L-1]); feed every
        # MTP position whose inputs became final since the last draft
        pos = torch.arange(mtp_fed, L - 1)
        h = torch.stack([hiddens[j] for j in pos.tolist()])
        q_logits = engine.mtp_forward(h, torch.tensor([tokens[mtp_fed + 1: L]]), pos.unsqueeze(0), mtp_cache,
                                      torch.tensor([mtp_fed]))[0, -1, :vocab]
        mtp_fed = L - 1
        q = sampling_probs(q_logits, params)
        d = _draw(q, g)
        stats.drafted += 1
        # verify: one main forward over [tokens[L-1], d] at positions L-1, L
        logits, hidden = engine.forward_with_hidden(torch.tensor([[tokens[L - 1], d]]), torch.tensor([[L - 1, L]]),
                                                    main_cache, torch.tensor([L - 1]))
        stats.main_forwards += 1
        p_d, p_after = logits[0, 0, :vocab], logits[0, 1, :vocab]
        p = sampling_probs(p_d, params)
        if params.temperature == 0:
            accepted = int(p.argmax()) == d
        else:
            accepted = bool(torch.rand(1, generator=g, dtype=torch.float64) < min(1.0, float(p[d] / q[d])))
        hiddens = hiddens[: L - 1] + [hidden[0]]
        if accepted:
            stats.accepted += 1
            hiddens.append(hidden[1])
            if emit(d, p_d) or emit(_draw(sampling_probs(p_after, params), g), p_after):
                break
        else:
            residual = (p - q).clamp(min=0)
            if params.temperature == 0:
                token = int(p.argmax())
            else:
                token = _draw(residual / residual.sum() if residual.sum() > 0 else p, g)
            if emit(token, p_d):
                break
    return _finish(engine, out)


def _finish(engine: InferenceEngine, out: Completion) -> Completion:
    if engine.detokenize is not None:
        out.text = engine.detokenize(out.token_ids)
    return out
