"""Tokens an episode cost, by category, and their price.

The episode's own counts (megatron_ext/env/episode.py) say what the model wrote (thinking, tool-call and message
tokens) and what the tools returned. What a provider bills is per turn: the whole context is the prompt of every
turn. `episode_usage` replays the transcript to split each turn's prompt into the part a prefix cache already held
(everything up to the end of the previous assistant turn of the same segment; a self-summary restarts the
conversation and the cache) and the new part, plus the output:

    turn t of a segment:  prompt_t = tools + messages before it;  cached_t = prompt_{t-1} + output_{t-1} (0 at t=0)
                          input_t = prompt_t - cached_t;          output_t = the assistant message

Token counts come from the counter the episode used (a tokenizer, or the 4-bytes-a-token estimate); the chat
template's own markup is not counted. Prices are in currency units per million tokens.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable

CATEGORIES = ("input_tokens", "cached_input_tokens", "output_tokens")


@dataclass(frozen=True)
class Prices:
    input: float = 0.0          # per million uncached prompt tokens
    cached_input: float = 0.0   # per million prompt tokens served from a prefix cache
    output: float = 0.0         # per million generated tokens

    @property
    def given(self) -> bool:
        return any((self.input, self.cached_input, self.output))

    def cost(self, usage: dict) -> float:
        return (usage["input_tokens"] * self.input + usage["cached_input_tokens"] * self.cached_input +
                usage["output_tokens"] * self.output) / 1e6

    def to_json(self) -> dict:
        return asdict(self)


def message_tokens(message: dict, count: Callable[[str], int]) -> int:
    return (count(message.get("content") or "") + count(message.get("reasoning_content") or "") +
            sum(count(c["function"]["name"] + c["function"]["arguments"]) for c in message.get("tool_calls", [])))


def episode_usage(segments: list[list[dict]], tools: list[dict], count: Callable[[str], int]) -> dict:
    """input/cached input/output tokens summed over the turns of an episode's segments (oldest first)."""
    tools_tokens = count(json.dumps(tools)) if tools else 0
    total = dict.fromkeys(CATEGORIES, 0)
    for messages in segments:
        context, cached = tools_tokens, 0
        for message in messages:
            size = message_tokens(message, count)
            if message.get("role") == "assistant":
                total["input_tokens"] += context - cached
                total["cached_input_tokens"] += cached
                total["output_tokens"] += size
                cached = context + size
            context += size
    return total
