"""Environments: the interface every task family implements, and a verifiable digit-transformation family.

An environment speaks token ids (the wrapper that renders messages into tokens belongs to the agentic
environment); `reset(task)` gives the first prompt, `step(model_tokens)` the next observation or the end of the
episode, `score()` the reward parts. Rewards are small named callables composed by a `Rubric` with weights; a
part that raises makes the sample score as failed (total 0) with the error recorded, and the run goes on.

Digit tasks: "reverse", "sort" or "copy" a short digit string (sequence answers), or name its "max", "min",
"first" or "last" digit (one-digit answers: a rule a tiny model generalises from few examples over input spaces
far too large to memorise); answers checked exactly. A tiny model learns them in minutes on a CPU; the generator is
deterministic (task i of a split is a function of the seed and i) and the two splits partition the task space by a
hash of (op, input).
"""

from __future__ import annotations

import json
import math
import random
import traceback
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from megatron_ext.rl.types import Reward


@dataclass
class StepResult:
    observation: list[int]  # environment tokens to append before the next model turn (empty when done)
    done: bool


class Environment(Protocol):
    """One episode at a time. Multi-turn: step() returns observation tokens until done."""

    def reset(self, task: dict) -> list[int]: ...

    def step(self, model_tokens: list[int]) -> StepResult: ...

    def score(self) -> dict[str, float]: ...


RewardFn = Callable[[dict, list[int]], float]  # (task, all model tokens of the episode) -> value


class Rubric:
    """A weighted sum of named reward parts; weights may change between steps (`set_weights`)."""

    def __init__(self, parts: dict[str, RewardFn], weights: dict[str, float]):
        unknown = set(weights) - set(parts)
        if unknown:
            raise ValueError(f"reward weights name unknown parts {sorted(unknown)}; known: {sorted(parts)}")
        bad = {k: w for k, w in weights.items() if not math.isfinite(w)}
        if bad:
            raise ValueError(f"reward weights must be finite numbers, got {bad}")
        self.parts, self.weights = parts, {name: weights.get(name, 0.0) for name in parts}

    def set_weights(self, weights: dict[str, float]):
        self.__init__(self.parts, {**self.weights, **weights})

    def score(self, task: dict, model_tokens: list[int]) -> Reward:
        values = {}
        for name, fn in self.parts.items():
            try:
                values[name] = float(fn(task, model_tokens))
            except Exception as e:  # a broken reward function fails this sample, not the run
                err = f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
                return Reward(values, 0.0, error=err)
        return Reward(values, sum(self.weights[k] * v for k, v in values.items()))


def parse_weights(text: str) -> dict[str, float]:
    """'exact=1,char_accuracy=0.2' -> {'exact': 1.0, 'char_accuracy': 0.2}."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--rl-reward-weights: {item!r} is not NAME=NUMBER") from None
        if not sep:
            raise ValueError(f"--rl-reward-weights: {item!r} is not NAME=NUMBER")
        if not math.isfinite(out[name.strip()]):
            raise ValueError(f"--rl-reward-weights: {item!r}: a weight must be a finite number")
    return out


# ---------------------------------------------------------------------------------------------------------
# digit transformations
# ---------------------------------------------------------------------------------------------------------

SEQUENCE_OPS = {"reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s)), "copy": lambda s: s}
DIGIT_OPS = {"max": max, "min": min, "first": lambda s: s[0], "last": lambda s: s[-1]}  # one-digit answers
OPS = {**SEQUENCE_OPS, **DIGIT_OPS}
DEFAULT_OPS = list(SEQUENCE_OPS)  # digit_tasks' and tools/make_rl_prompts.py's default


class DigitVocab:
    """Token ids of the digit tasks: specials, '=', the sequence ops, the ten digits, the one-digit ops (ids below
    32; the one-digit ops come last so the ids of the earlier tokens, and checkpoints trained on them, stay)."""

    SPECIALS = ["<pad>", "<bos>", "<eos>", "="]

    def __init__(self):
        self.items = self.SPECIALS + list(SEQUENCE_OPS) + [str(d) for d in range(10)] + list(DIGIT_OPS)
        self.ids = {s: i for i, s in enumerate(self.items)}
        self.bos, self.eos, self.eq = self.ids["<bos>"], self.ids["<eos>"], self.ids["="]

    def __len__(self) -> int:
        return len(self.items)

    def encode_digits(self, s: str) -> list[int]:
        return [self.ids[c] for c in s]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.items[i] if 0 <= i < len(self.items) and self.items[i].isdigit() else "?"
                       for i in ids)


VOCAB = DigitVocab()


def _answer_tokens(model_tokens: list[int]) -> list[int]:
    """The answer: tokens up to (not including) the first <eos>."""
    return model_tokens[: model_tokens.index(VOCAB.eos)] if VOCAB.eos in model_tokens else list(model_tokens)


def exact(task: dict, model_tokens: list[int]) -> float:
    """1 when the answer is exactly right and closed by <eos>."""
    return float(VOCAB.eos in model_tokens and VOCAB.decode(_answer_tokens(model_tokens)) == task["answer"]
                 and len(_answer_tokens(model_tokens)) == len(task["answer"]))


def char_accuracy(task: dict, model_tokens: list[int]) -> float:
    """Fraction of answer positions right, over the longer of answer and output (partial credit)."""
    got, want = VOCAB.decode(_answer_tokens(model_tokens)), task["answer"]
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1)


DIGIT_REWARDS: dict[str, RewardFn] = {"exact": exact, "char_accuracy": char_accuracy}
DEFAULT_DIGIT_WEIGHTS = {"exact": 1.0, "char_accuracy": 0.0}


class DigitEnv:
    """Single turn: prompt `<bos> OP d1 .. dn =`, the model answers with digits then `<eos>`."""

    def __init__(self, rubric: Optional[Rubric] = None):
        self.rubric = rubric or Rubric(DIGIT_REWARDS, DEFAULT_DIGIT_WEIGHTS)
        self.task: Optional[dict] = None
        self.model_tokens: list[int] = []

    def reset(self, task: dict) -> list[int]:
        self.task, self.model_tokens = task, []
        return prompt_tokens(task)

    def step(self, model_tokens: list[int]) -> StepResult:
        self.model_tokens += list(model_tokens)
        return StepResult([], True)

    def score(self) -> Reward:
        return self.rubric.score(self.task, self.model_tokens)

    def reference(self, task: dict) -> list[int]:
        """The reference answer as model tokens (supervised warm-up)."""
        return answer_tokens(task)


def prompt_tokens(task: dict) -> list[int]:
    return [VOCAB.bos, VOCAB.ids[task["op"]]] + VOCAB.encode_digits(task["input"]) + [VOCAB.eq]


def answer_tokens(task: dict) -> list[int]:
    """The reference answer as model tokens (for the supervised warm-up)."""
    return VOCAB.encode_digits(task["answer"]) + [VOCAB.eos]


def _draw(rng: random.Random, ops: list[str], min_len: int, max_len: int) -> tuple[str, str]:
    op = ops[rng.randrange(len(ops))]
    digits = "".join(str(rng.randrange(10)) for _ in range(rng.randint(min_len, max_len)))
    return op, digits


def is_heldout(op: str, digits: str) -> bool:
    """The held-out part of the task space: a fixed tenth of all (op, input) pairs, by hash."""
    return zlib.crc32(f"{op}:{digits}".encode()) % 10 == 0


def split_size(split: str, ops: list[str], min_len: int, max_len: int, exact_up_to: int = 100_000) -> int:
    """How many distinct (op, input) pairs a split holds: counted when the space is small, else its expected size
    (the held-out split is a tenth of the space)."""
    total = len(ops) * sum(10 ** n for n in range(min_len, max_len + 1))
    if total > exact_up_to:
        return total // 10 if split == "heldout" else total - total // 10
    return sum(is_heldout(op, str(i).zfill(n)) == (split == "heldout")
               for op in ops for n in range(min_len, max_len + 1) for i in range(10 ** n))


def digit_tasks(split: str, count: int, seed: int = 0, ops: Optional[list[str]] = None, min_len: int = 3,
                max_len: int = 6) -> list[dict]:
    """`count` tasks of a split ('train' or 'heldout'), each {'id', 'op', 'input', 'answer'}; deterministic.

    The splits partition the task space (`is_heldout`), so held-out tasks never occur in training and follow the
    same distribution of operations and lengths (up to the one-in-ten subsampling)."""
    ops = ops or DEFAULT_OPS
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown digit op {op!r}; known: {sorted(OPS)}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"digit lengths need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng, pairs, want = random.Random(f"digits-{split}-{seed}"), [], split == "heldout"
    while len(pairs) < count:
        pair = _draw(rng, ops, min_len, max_len)
        if is_heldout(*pair) == want:
            pairs.append(pair)
    return [{"id": f"{split}-{seed}-{i}", "op": op, "input": s, "answer": OPS[op](s)}
            for i, (op, s) in enumerate(pairs)]


def read_prompts(path: str, flag: str = "--rl-prompts") -> list[dict]:
    """Tasks from a JSONL prompt file; every line needs a unique string 'id' (the exactly-once key) and a valid
    digit task, checked here so that a bad line stops the run before the model is built."""
    tasks, ids = [], set()
    try:
        f = open(path)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read ({e.strerror})") from None
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{flag} {path}:{number}: invalid JSON ({e})") from None
            if not isinstance(task, dict) or not isinstance(task.get("id"), str):
                raise ValueError(f"{flag} {path}:{number}: each prompt needs a string 'id'")
            if task["id"] in ids:
                raise ValueError(f"{flag} {path}:{number}: duplicate prompt id {task['id']!r}; ids must be unique")
            problem = _digit_task_problem(task)
            if problem:
                raise ValueError(f"{flag} {path}:{number}: {problem} (tools/make_rl_prompts.py writes valid tasks)")
            ids.add(task["id"])
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{flag} {path} holds no prompts")
    return tasks


def _digit_task_problem(task: dict) -> Optional[str]:
    for key in ("op", "input", "answer"):
        if not isinstance(task.get(key), str):
            return f"a digit task needs a string '{key}'"
    if task["op"] not in OPS:
        return f"unknown op {task['op']!r}; known: {sorted(OPS)}"
    if not task["input"] or not task["input"].isascii() or not task["input"].isdigit():
        return f"input {task['input']!r} is not a non-empty string of digits"
    if not task["answer"].isascii() or not task["answer"].isdigit():
        return f"answer {task['answer']!r} is not a string of digits"
    return None


def write_prompts(path: str, tasks: list[dict]):
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(t) + "\n")
