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

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_ext.inference.engine import Completion, InferenceEngine, SamplingParams, _finished, sampling_probs


@dataclass
class SpeculationStats:
    drafted: int = 0  # drafts checked against the main model (a draft after a rejected one is not checked)
    accepted: int = 0
    main_forwards: int = 0
    tokens: int = 0
    checked_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    plan: Optional["SpeculationPlan"] = None  # the latest step-aside decision (policy "auto")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.main_forwards, 1)

    def acceptance_by_depth(self, depth: int, min_checked: int) -> list[Optional[float]]:
        """The acceptance rate of each draft position given the earlier ones were accepted; None where fewer
        than `min_checked` drafts were checked there."""
        return [self.accepted_by_depth[i] / self.checked_by_depth[i]
                if i < len(self.checked_by_depth) and self.checked_by_depth[i] >= min_checked else None
                for i in range(depth)]

    def count(self, depth: int, accepted: bool):
        while len(self.checked_by_depth) <= depth:
            self.checked_by_depth.append(0)
            self.accepted_by_depth.append(0)
        self.drafted += 1
        self.checked_by_depth[depth] += 1
        if accepted:
            self.accepted += 1
            self.accepted_by_depth[depth] += 1


log = logging.getLogger(__name__)

# drafts checked at a position before its observed acceptance replaces the prior (every draft accepted)
MIN_CHECKED = 32
# the expected speed-up drafting must beat: the measured costs leave out a round's host-side work (acceptance,
# emitting, cache bookkeeping), which on the 2-core CPU VM made an expected 1.05x run at 0.88x (4-layer stand-in,
# docs/benchmarks.md); speculation that does not clearly pay steps aside
SPECULATION_MARGIN = 1.2
# the margin where the host-side work of a plain step and of a round was measured too (real generations timed,
# `measure_host_work`; `plan_speculation` always measures it), so that only timing noise, the context length and
# (batched) the rows' own acceptance runs are left out
HOST_MEASURED_MARGIN = 1.1
# the decoding paths whose costs are measured apart: one sequence (`generate_speculative`) and rows decoded
# together (inference/speculative_batch.py)
PATHS = ("single", "batched")
# runs `rows` greedy samples of one prompt by the batched speculation (set by inference/speculative_batch.py, which
# builds on this module: the one-way import keeps the package free of cycles)
BATCHED_ROUNDS: Optional[Callable] = None


@dataclass
class DraftCosts:
    """Seconds, for a batch of rows at a short context, of a plain decode step (one token per row and its
    logits), of a verify forward (each row's newest token and `depth` drafts) and of one MTP layer's draft (one
    position per row and its logits)."""
    main: float
    verify: float
    draft: float
    # host-side work beyond those forwards, per plain step (picking and appending the token) and per round
    # (the drafts' feeding, acceptance, emitting, cache bookkeeping), where it was measured (`host_measured`)
    main_host: float = 0.0
    round_host: float = 0.0
    host_measured: bool = False

    @property
    def margin(self) -> float:
        """The expected speed-up drafting must beat: smaller where the host-side work was measured."""
        return HOST_MEASURED_MARGIN if self.host_measured else SPECULATION_MARGIN

    def speedup(self, acceptance: list[float]) -> float:
        """Expected tokens per second of speculation over plain decoding: a round emits the accepted run of
        drafts and one more token (1 + a1 + a1 a2 + ...) and costs one verify forward, a draft per layer and its
        host-side work; a plain step costs a forward and its own."""
        tokens, run = 1.0, 1.0
        for a in acceptance:
            run *= a
            tokens += run
        return tokens * (self.main + self.main_host) / (self.verify + len(acceptance) * self.draft
                                                         + self.round_host)


@dataclass
class SpeculationPlan:
    speculate: bool
    speedup: float  # expected, from the costs and the acceptance below
    acceptance: list[float]  # per draft position: observed (>= MIN_CHECKED drafts) or the prior 1.0
    costs: DraftCosts
    batch: int = 1  # the batch bucket the costs were measured at


def batch_bucket(rows: int) -> int:
    """The batch size whose costs stand for a batch of `rows` (the next power of two, at most 64): costs are
    measured once per bucket, not once per batch size."""
    return min(1 << max(rows - 1, 0).bit_length(), 64)


def measure_draft_costs(engine: InferenceEngine, depth: int, repeats: int = 7, context: int = 32,
                        batch: int = 1, host: Optional[str] = None) -> DraftCosts:
    """Time a plain step, a verify forward and a draft of `batch` rows on scratch caches (medians of `repeats`
    rounds after a warm-up, the three interleaved so that load from other processes hits them alike); with
    `host` ("single": one sequence, `generate_speculative`; "batched": `batch` rows, `generate_speculative_groups`),
    also that path's host-side work of a plain step and of a round (`measure_host_work`)."""
    dev = engine.device
    ids = (torch.arange(context + depth + 1, device=dev) * 7919 % engine.vocab_size).unsqueeze(0).repeat(batch, 1)
    ids = (ids + torch.arange(batch, device=dev).unsqueeze(1) * 104729) % engine.vocab_size  # rows route apart
    main_cache = engine.new_cache(len(engine.layers), batch, context + depth + 2)
    mtp_cache = engine.new_cache(depth, batch, context + depth + 2)

    def positions(start, count):
        return torch.arange(start, start + count, device=dev).unsqueeze(0).expand(batch, -1)

    def at(n):
        return torch.full((batch,), n, dtype=torch.long, device=dev)

    with torch.inference_mode(), engine.generating():
        hidden = engine.hidden(ids[:, :context], positions(0, context), main_cache, at(0), host_lengths=[0] * batch)
        runs = {
            "main": lambda: engine.logits(engine.hidden(ids[:, context: context + 1], positions(context, 1),
                                                        main_cache, at(context), host_lengths=[context] * batch)),
            "verify": lambda: engine.logits(engine.hidden(ids[:, context: context + depth + 1],
                                                          positions(context, depth + 1), main_cache, at(context),
                                                          host_lengths=[context] * batch)),
            "draft": lambda: engine.logits(engine.mtp_hidden(0, hidden[-1:], ids[:, context: context + 1],
                                                             positions(context - 1, 1), mtp_cache,
                                                             at(context - 1))),
        }
        times = {name: [] for name in runs}
        for i in range(repeats + 1):
            for name, run in runs.items():
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                run()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
    costs = DraftCosts(**{name: statistics.median(t) for name, t in times.items()})
    if host is not None:
        if host not in PATHS:
            raise ValueError(f"host must be one of {PATHS}, got {host!r}")
        if host == "single" and batch != 1:
            raise ValueError("the single path decodes one sequence: its host-side work is measured at batch 1")
        # what the path's caches hold beyond the prompt (the batched one pads draft spans: 3 depth + 2)
        room = engine.model.max_sequence_length - context - (depth + 1 if host == "single" else 3 * depth + 2)
        step, round_ = measure_host_work(engine, depth, ids[0, :context].tolist(), tokens=max(1, min(16, room - 1)),
                                         rows=batch, batched=host == "batched")
        costs.main_host = max(0.0, step - costs.main)
        costs.round_host = max(0.0, round_ - costs.verify - depth * costs.draft)
        costs.host_measured = True
    return costs


def measure_host_work(engine: InferenceEngine, depth: int, prompt: list[int], tokens: int = 16,
                      repeats: int = 3, rows: int = 1, batched: bool = False) -> tuple[float, float]:
    """(seconds per plain decode step, seconds per speculative round) of real greedy generations of `tokens`
    tokens after the first on `prompt`, everything they do on the host included: each the difference between a
    generation of 1 + `tokens` tokens and one of 1 token (the prompt's forward), medians of `repeats` after a
    warm-up, the four interleaved. The forwards alone are timed by `measure_draft_costs`; the difference is what
    a round adds on the host (which made an expected 1.05x run at 0.88x where it was left out). `batched`: `rows`
    samples of the prompt decoded together, plainly (`generate_groups`) and by the batched speculation
    (inference/speculative_batch.py), whose rounds do per-row work on the host; greedy rows stay identical, so
    every round holds all of them. Otherwise one sequence (`generate`, `generate_speculative`)."""
    if not batched and rows != 1:
        raise ValueError("one sequence's host work is measured for rows=1 (batched=True for more)")
    if batched and BATCHED_ROUNDS is None:
        raise RuntimeError("the batched path's rounds are run by megatron_ext.inference.speculative_batch: import it")

    full, first = (SamplingParams(max_tokens=n, temperature=0.0) for n in (1 + tokens, 1))

    def plain(params):
        if batched:
            engine.generate_groups([prompt], rows, params)
        else:
            engine.generate([prompt], params)
        return tokens

    def speculative(params):
        stats = SpeculationStats()
        with engine.generating():
            if batched:
                BATCHED_ROUNDS(engine, prompt, rows, params, stats, depth)
            else:
                _Speculation(engine, prompt, params, stats, depth).run()
        # rounds: one verify forward of every row each, after the prompt's one forward
        return (stats.main_forwards - 1) // rows

    per = {plain: [], speculative: []}
    for i in range(repeats + 1):
        for run in per:
            t0 = time.perf_counter()
            run(first)
            t1 = time.perf_counter()
            count = run(full)
            t2 = time.perf_counter()
            if i and count > 0:  # the first repeat warms up
                per[run].append(max(0.0, (t2 - t1) - (t1 - t0)) / count)
    return statistics.median(per[plain]), statistics.median(per[speculative])


def plan_speculation(engine: InferenceEngine, depth: int, stats: Optional[SpeculationStats] = None,
                     rows: int = 1, path: str = "batched") -> SpeculationPlan:
    """Whether drafting `depth` tokens per round is expected to beat plain decoding (by the costs' margin) on
    this engine for a batch of `rows` sequences: its draft and verify costs against a plain step (measured once
    per engine, path, depth and batch bucket, `engine.draft_costs[(depth, bucket, path)]`: a batched verify costs
    relatively less where a step is bound by reading weights, more where it is bound by arithmetic), and the
    acceptance `stats` observed so far at each draft position (the prior: every draft accepted, so that a model
    is only decoded plainly from the start when even perfect drafts cannot pay). Ranks that cooperate on a
    request agree (speculate only if all expect it to pay). One log line when the decision for a (depth,
    bucket) changes. The host-side work of the path's plain steps and rounds is measured too and counted
    (`measure_host_work`): `path` "single" (one sequence, `generate_speculative`) or "batched" (rows decoded
    together, `generate_speculative_groups`: the server's and RL's), whose rounds differ in what they do per row."""
    if path not in PATHS:
        raise ValueError(f"speculation path must be one of {PATHS}, got {path!r}")
    key = (depth, batch_bucket(rows), path)
    costs = engine.draft_costs.get(key)
    if costs is None:
        costs = engine.draft_costs[key] = measure_draft_costs(engine, depth, batch=key[1], host=path)
    observed = (stats or SpeculationStats()).acceptance_by_depth(depth, MIN_CHECKED)
    acceptance = [1.0 if a is None else a for a in observed]
    speedup = costs.speedup(acceptance)
    speculate = speedup > costs.margin
    groups = [g for g in (engine.groups.tp, engine.groups.ep) if g is not None]
    if groups:
        flag = torch.tensor([int(speculate)], device=engine.collective_device(groups[0]))
        for group in groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        speculate = bool(flag.item())
    plan = SpeculationPlan(speculate, speedup, acceptance, costs, key[1])
    if engine.speculation_decisions.get(key) != speculate:
        engine.speculation_decisions[key] = speculate
        log.warning(describe_plan(plan, depth))
    return plan


def describe_plan(plan: SpeculationPlan, depth: int) -> str:
    c = plan.costs
    acceptance = ", ".join(f"{a:.2f}" for a in plan.acceptance)
    rows = f" at batch {plan.batch}" if plan.batch > 1 else ""
    return (f"speculative decoding{rows} {'on' if plan.speculate else 'off (decoding plainly)'}: {depth} draft(s) "
            f"per round expected {plan.speedup:.2f}x plain (needs > {c.margin}x; "
            f"step {c.main * 1e3:.2f} ms, "
            f"verify {c.verify * 1e3:.2f} ms, "
            f"draft {c.draft * 1e3:.2f} ms, "
            + (f"host work per step {c.main_host * 1e3:.2f} ms and per round {c.round_host * 1e3:.2f} ms, "
               if c.host_measured else "")
            + f"acceptance by position {acceptance})")


def _draw(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def pick(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """A token from the main model's logits: the argmax when greedy, else a draw from the sampling distribution."""
    if params.temperature == 0:
        return int(logits.argmax())
    return _draw(sampling_probs(logits, params), generator)


def draft_depth(engine: InferenceEngine, depth: Optional[int]) -> int:
    """The MTP layers drafting: `depth`, or all the model has; refused without MTP layers or beyond them."""
    layers = len(engine.mtp_layers)
    if layers == 0:
        raise ValueError("speculative decoding needs a model with MTP layers (--mtp-num-layers >= 1)")
    depth = layers if depth is None else depth
    if not 1 <= depth <= layers:
        raise ValueError(f"draft depth must be between 1 and the model's {layers} MTP layer(s), got {depth}")
    return depth


def append_token(out: Completion, token: int, main_logits: torch.Tensor, params: SamplingParams, version: int,
                 detokenize) -> tuple[bool, float]:
    """Append a token with the main model's raw and sampled log-probabilities and the weights version; (True when
    generation is over (stop id, stop string or max_tokens), the raw log-probability)."""
    out.token_ids.append(token)
    sampled = 0.0 if params.temperature == 0 else sampling_probs(main_logits, params)[token].log()
    values = torch.stack((torch.log_softmax(main_logits.double(), -1)[token],
                          torch.as_tensor(sampled, dtype=torch.float64, device=main_logits.device))).tolist()
    out.logprobs.append(values[0])
    out.sampled_logprobs.append(values[1])
    out.versions.append(version)
    return _finished(out, params, detokenize), values[0]


def verify_drafts(drafts: list[int], dists: list[Optional[torch.Tensor]], logits: torch.Tensor,
                  params: SamplingParams, generator, count: Callable[[int, bool], None],
                  emit: Callable[[int, torch.Tensor], bool]) -> bool:
    """Accept or reject the drafts against the main model's logits [D + 1, vocab] at their positions, emitting
    each accepted draft, then the resampled token at the first rejection or the bonus token after the last draft
    (greedy: the argmax); `count(depth, accepted)` per checked draft. True when generation is over."""
    for i, (d, q) in enumerate(zip(drafts, dists)):
        p_logits = logits[i]
        if params.temperature == 0:
            target = int(p_logits.argmax())
            accepted = target == d
        else:
            p = sampling_probs(p_logits, params)
            u = torch.rand(1, generator=generator, dtype=torch.float64, device=logits.device)
            accepted = bool(u < min(1.0, float(p[d] / q[d])))
        count(i, accepted)
        if not accepted:
            if params.temperature > 0:
                residual = (p - q).clamp(min=0)
                target = _draw(residual / residual.sum() if residual.sum() > 0 else p, generator)
            return emit(target, p_logits)
        if emit(d, p_logits):
            return True
    last = logits[len(drafts)]
    return emit(pick(last, params, generator), last)


@torch.inference_mode()
def generate_speculative(engine: InferenceEngine, prompt: list[int], params: SamplingParams,
                         stats: SpeculationStats | None = None, depth: Optional[int] = None,
                         on_token: Optional[Callable[[int, int, float], None]] = None,
                         policy: str = "always") -> Completion:
    """Generate for one prompt with `depth` MTP layers drafting (default: all the model has); `on_token(0,
    token_id, logprob)` is called as each token is emitted. `policy` "auto": decode plainly instead when
    drafting is not expected to pay (`plan_speculation`; the plan is left in `stats.plan`), "always": draft."""
    if policy not in ("auto", "always"):
        raise ValueError(f"speculation policy must be 'auto' or 'always', got {policy!r}")
    depth = draft_depth(engine, depth)
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    params.validate(engine.vocab_size)
    bad = [t for t in prompt if not 0 <= t < engine.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {engine.vocab_size})")
    if any(r is not None for r in engine.recurrent):
        raise ValueError("MTP speculative decoding is not supported for Kimi Linear (KDA) models: rejected draft "
                         "tokens cannot be taken back out of a recurrent state; generate without speculation")
    stats = stats if stats is not None else SpeculationStats()
    if policy == "auto":
        stats.plan = plan_speculation(engine, depth, stats, path="single")
        if not stats.plan.speculate:
            return engine.generate([prompt], params, on_token)[0]
    with engine.generating():
        return _Speculation(engine, prompt, params, stats, depth, on_token).run()


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
        done = self._emit(pick(last, self.params, self.generator), last)
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

    def _emit(self, token: int, main_logits: torch.Tensor) -> bool:
        """Append a token; True when generation is over (stop id, stop string or max_tokens)."""
        done, logprob = append_token(self.out, token, main_logits, self.params, self.engine.weights_version,
                                     self.engine.detokenize)
        self.tokens.append(token)
        self.stats.tokens += 1
        if self.on_token is not None:
            self.on_token(0, token, logprob)
        return done

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
        L = len(self.tokens)
        drafts, dists = self._draft()
        logits, hidden = self._main([self.tokens[L - 1]] + drafts, L - 1)
        self.inputs[0, L - 1: L + len(drafts)] = hidden[:, 0]  # rows past the accepted drafts are redone later
        return verify_drafts(drafts, dists, logits[0, :, : self.vocab], self.params, self.generator,
                             self.stats.count, self._emit)
