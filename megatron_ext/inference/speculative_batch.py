"""Batched MTP speculative decoding: many samples draft and verify together (speculative rollouts for RL).

The same algorithm as inference/speculative.py (read its docstring first), run for B rows at once: one batched
forward per MTP layer drafts every row's next token, one batched main-model forward verifies every row's
[newest token, D drafts], and each row accepts or rejects its drafts on its own (its own generator, drawing in the
order the one-sequence version draws, so each row's tokens equal `generate_speculative` on that sample with the
same seed). Rows differ in how much of their MTP caches is stale, so a draft forward feeds each row its own span
of positions, right-padded to the longest: padded positions lie beyond the row's frontier, where nothing real
attends to them, and are overwritten later (as draft rows are in the one-sequence version). The samples of a
prompt share one prefill (the prompt's caches forked n ways). Rows that finish leave the batch after the round;
a finished row that returns routing gets its last token's experts from one extra forward of every active row's
newest token (for the others it writes exactly what their next verify writes).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_ext.inference import speculative
from megatron_ext.inference.engine import Completion, InferenceEngine, SamplingParams, group_counts, sampling_probs
from megatron_ext.inference.speculative import (SpeculationStats, _draw, append_token, draft_depth, pick,
                                                plan_speculation, verify_drafts)


@torch.inference_mode()
def generate_speculative_groups(engine: InferenceEngine, prompts: list[list[int]], n: int | list[int],
                                params: SamplingParams | list[SamplingParams], stats: Optional[SpeculationStats] = None,
                                depth: Optional[int] = None,
                                on_token: Optional[Callable[[int, int, float], None]] = None,
                                policy: str = "always") -> list[list[Completion]]:
    """`n` samples of each prompt (or n[i] of prompt i) with MTP drafting, batched; sample j of a prompt whose
    params have seed s draws with seed s + j (as `generate_groups`); result[i][j]. `on_token(row, token_id,
    logprob)` is called as each token is emitted, rows numbered prompt by prompt, sample by sample. `policy`
    "auto": decode the batch plainly (`generate_groups`, the same tokens) when drafting is not expected to pay at
    this batch size (`plan_speculation` with costs measured per batch bucket; the plan is left in `stats.plan`),
    "always": draft."""
    if policy not in ("auto", "always"):
        raise ValueError(f"speculation policy must be 'auto' or 'always', got {policy!r}")
    depth = draft_depth(engine, depth)
    counts, per_prompt = group_counts(prompts, n, params)
    prompt_of = [i for i, c in enumerate(counts) for _ in range(c)]
    rows = [per_prompt[i] for i in prompt_of]
    engine.check_request([prompts[i] for i in prompt_of], rows)
    longest = max(len(p) for p in prompts) + max(r.max_tokens for r in rows) + depth + 1
    if longest > engine.model.max_sequence_length:
        raise ValueError(f"prompt + max_tokens exceeds the model's {engine.model.max_sequence_length}")
    seeds = engine.agreed_seeds([p.seed + j if p.seed is not None else None
                                 for p, c in zip(per_prompt, counts) for j in range(c)])
    stats = stats if stats is not None else SpeculationStats()
    if policy == "auto":
        stats.plan = plan_speculation(engine, depth, stats, rows=len(rows))
        if not stats.plan.speculate:
            return engine.generate_groups(prompts, n, params, on_token)
    with engine.generating():
        flat = _Rows(engine, prompts, counts, rows, seeds, stats, depth, on_token).run()
    starts = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return [flat[starts[i]: starts[i + 1]] for i in range(len(prompts))]


class _Rows:
    """Per row r: tokens[r] (prompt and emitted, L_r of them); the main cache covers positions < L_r - 1; MTP
    layer k's cache covers positions < fed[k][r]; inputs[k][b, j]: MTP layer k's hidden input at position j of the
    row in batch slot b. `slot[r]`: the batch slot of an active row."""

    def __init__(self, engine, prompts, counts, rows, seeds, stats, depth, on_token=None):
        self.engine, self.prompts, self.counts, self.rows, self.stats = engine, prompts, counts, rows, stats
        self.depth, self.on_token = depth, on_token
        self.prompt_of = [i for i, c in enumerate(counts) for _ in range(c)]
        self.vocab, self.dev = engine.vocab_size, engine.device
        B = len(rows)
        self.width = max(len(p) for p in prompts)
        # draft spans can reach 2 * depth past a row's frontier; padding to the batch's longest span adds the rest
        self.max_len = self.width + max(r.max_tokens for r in rows) + 3 * depth + 2
        self.generators = [engine.generator(s) for s in seeds]
        self.tokens = [list(prompts[i]) for i in self.prompt_of]
        self.out = [Completion(prompt_ids=list(prompts[i]), speculation={"drafted": 0, "accepted": 0,
                                                                        "verify_forwards": 0})
                    for i in self.prompt_of]
        self.fed = [[0] * B for _ in range(depth)]
        self.want_routing = any(p.return_routing for p in rows)
        self.routing: list[list[torch.Tensor]] = [[] for _ in range(B)]  # per row: [positions, layers, topk] parts

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.dev)

    def run(self) -> list[Completion]:
        eng, B = self.engine, len(self.rows)
        P, width = len(self.prompts), self.width
        lens = [len(p) for p in self.prompts]
        main = eng.new_cache(len(eng.layers), P, self.max_len)
        tokens = self._long([p + [0] * (width - len(p)) for p in self.prompts])
        positions = torch.arange(width, device=self.dev).unsqueeze(0).expand(P, -1).contiguous()
        routing = [] if self.want_routing else None
        logits, hidden = eng.forward_with_hidden(tokens, positions, main, self._long([0] * P), routing)
        self.stats.main_forwards += P
        counts = self._long(self.counts)
        self.main = main
        main.kv = [t.repeat_interleave(counts, dim=0) for t in main.kv]
        self.mtp = eng.new_cache(self.depth, B, self.max_len)
        self.inputs = torch.zeros(self.depth, B, self.max_len, eng.config.hidden_size, dtype=eng.dtype,
                                  device=self.dev)
        self.inputs[0, :, :width] = hidden.transpose(0, 1).repeat_interleave(counts, dim=0)
        if routing is not None:
            prompt_routing = torch.stack(routing, dim=1).view(width, P, len(routing), -1).to(torch.int16)
            for r in range(B):
                i = self.prompt_of[r]
                self.routing[r].append(prompt_routing[: lens[i], i])
        last = logits[self._long(range(P)), self._long(lens) - 1, : self.vocab].repeat_interleave(counts, dim=0)
        self.active = list(range(B))  # rows in batch-slot order
        done = [self._emit(r, pick(last[r], self.rows[r], self.generators[r]), last[r]) for r in range(B)]
        self._settle(done)
        while self.active:
            self._settle(self._round())
        return self.out

    # ---- one round -------------------------------------------------------------------------------------------
    def _round(self) -> list[bool]:
        drafts, dists = self._draft()
        eng, rows, D = self.engine, self.active, self.depth
        L = [len(self.tokens[r]) for r in rows]
        tokens = self._long([[self.tokens[r][-1]] + drafts[b] for b, r in enumerate(rows)])
        start = self._long(L) - 1
        positions = start.unsqueeze(1) + torch.arange(D + 1, device=self.dev).unsqueeze(0)
        routing = [] if self.want_routing else None
        logits, hidden = eng.forward_with_hidden(tokens, positions, self.main, start, routing)
        self.stats.main_forwards += len(rows)
        slots = torch.arange(len(rows), device=self.dev).unsqueeze(1)
        self.inputs[0][slots, positions] = hidden.transpose(0, 1)  # rows past the accepted drafts are redone later
        pending = torch.stack(routing, dim=1).view(D + 1, len(rows), len(routing), -1).to(torch.int16) \
            if routing is not None else None
        logits = logits[..., : self.vocab]
        done = []
        for b, r in enumerate(rows):
            finished = self._verify(r, drafts[b], dists[b], logits[b])
            if pending is not None and self.rows[r].return_routing:  # the inputs whose tokens are now final
                self.routing[r].append(pending[: len(self.tokens[r]) - L[b], b])
            done.append(finished)
        return done

    def _draft(self) -> tuple[list[list[int]], list[list[Optional[torch.Tensor]]]]:
        """D drafts per active row: MTP layer k fed, for each row, every position from its cache's frontier to the
        newest one, L_r - 2 (right-padded to the longest span)."""
        eng, rows, D = self.engine, self.active, self.depth
        B = len(rows)
        L = [len(self.tokens[r]) for r in rows]
        drafts: list[list[int]] = [[] for _ in rows]
        dists: list[list[Optional[torch.Tensor]]] = [[] for _ in rows]
        slots = torch.arange(B, device=self.dev).unsqueeze(1)
        for k in range(D):
            start = [self.fed[k][r] for r in rows]
            span = [L[b] - 1 - start[b] for b in range(B)]
            width = max(span)
            ahead = [((self.tokens[r] + drafts[b])[start[b] + k + 1: L[b] + k] + [0] * width)[:width]
                     for b, r in enumerate(rows)]
            positions = self._long(start).unsqueeze(1) + torch.arange(width, device=self.dev).unsqueeze(0)
            hidden = self.inputs[k][slots, positions].transpose(0, 1)  # [width, B, h]
            out = eng.mtp_hidden(k, hidden, self._long(ahead), positions, self.mtp, self._long(start))
            if k + 1 < D:
                real = torch.arange(width, device=self.dev).unsqueeze(0) < self._long(span).unsqueeze(1)
                self.inputs[k + 1][slots.expand(-1, width)[real], positions[real]] = out.transpose(0, 1)[real]
            for b, r in enumerate(rows):
                self.fed[k][r] = L[b] - 1 - k  # later positions used a draft: recomputed next round
            newest = out[self._long(span) - 1, torch.arange(B, device=self.dev)]  # [B, h] at position L_r - 2
            logits = eng.logits(newest.unsqueeze(0))[:, 0, : self.vocab]
            for b, r in enumerate(rows):
                params = self.rows[r]
                if params.temperature == 0:
                    drafts[b].append(int(logits[b].argmax()))
                    dists[b].append(None)
                else:
                    q = sampling_probs(logits[b], params)
                    drafts[b].append(_draw(q, self.generators[r]))
                    dists[b].append(q)
        return drafts, dists

    def _verify(self, r: int, drafts: list[int], dists, logits: torch.Tensor) -> bool:
        """Row r accepts or rejects its drafts against the main model's logits [D + 1, vocab]; True when done."""
        mine = self.out[r].speculation
        mine["verify_forwards"] += 1

        def count(depth: int, accepted: bool):
            self.stats.count(depth, accepted)
            mine["drafted"] += 1
            mine["accepted"] += int(accepted)

        return verify_drafts(drafts, dists, logits, self.rows[r], self.generators[r], count,
                             lambda token, main_logits: self._emit(r, token, main_logits))

    def _emit(self, r: int, token: int, main_logits: torch.Tensor) -> bool:
        done, logprob = append_token(self.out[r], token, main_logits, self.rows[r], self.engine.weights_version,
                                     self.engine.detokenize)
        self.tokens[r].append(token)
        self.stats.tokens += 1
        if self.on_token is not None:
            self.on_token(r, token, logprob)
        return done

    # ---- finished rows -----------------------------------------------------------------------------------------
    def _settle(self, done: list[bool]):
        """Routing of finished rows' last tokens, texts, and the finished rows out of the batch."""
        if not any(done):
            return
        rows = self.active
        if self.want_routing and any(d and self.rows[r].return_routing for d, r in zip(done, rows)):
            last = self._long([[self.tokens[r][-1]] for r in rows])
            start = self._long([len(self.tokens[r]) - 1 for r in rows])
            routing = []
            self.engine.hidden(last, start.unsqueeze(1), self.main, start, routing)
            self.stats.main_forwards += len(rows)
            newest = torch.stack(routing, dim=1).to(torch.int16)  # [B, layers, topk]
            for b, (d, r) in enumerate(zip(done, rows)):
                if d and self.rows[r].return_routing:
                    self.out[r].routing = torch.cat(self.routing[r] + [newest[b: b + 1]]).cpu()
        for d, r in zip(done, rows):
            if d and self.engine.detokenize is not None and self.out[r].text is None:
                self.out[r].text = self.engine.detokenize(self.out[r].token_ids)
        keep = [b for b, d in enumerate(done) if not d]
        if len(keep) < len(rows):
            index = self._long(keep)
            self.main.kv = [t.index_select(0, index) for t in self.main.kv]
            self.mtp.kv = [t.index_select(0, index) for t in self.mtp.kv]
            self.inputs = self.inputs.index_select(1, index)
            self.active = [rows[b] for b in keep]


def _greedy_rows(engine: InferenceEngine, prompt: list[int], rows: int, params: SamplingParams,
                 stats: SpeculationStats, depth: int):
    """`rows` samples of `prompt` decoded together by the batched speculation (`measure_host_work`'s batched side)."""
    _Rows(engine, [prompt], [rows], [params] * rows, list(range(rows)), stats, depth).run()


speculative.BATCHED_ROUNDS = _greedy_rows
