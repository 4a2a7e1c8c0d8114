"""Reward parts of a coding episode, each a small function reported separately, and their weights.

Parts (raw values; the weights turn penalties negative):

* ``correctness``: 1 when every expected hidden test passed (grading.py: by test ids for pytest commands, by exit
  code otherwise), else 0; ``tests_fraction``: partial credit from per-test outcomes (never from printed output;
  equal to correctness under exit-code grading): the share of the task's fail_to_pass tests that pass, times the
  share of its other tests still passing (grading.progress; without fail_to_pass, the share of expected tests
  passing), paid only to an episode that changed something. Tests the untouched repository already passes are no
  reward, neither for doing nothing nor for a change that fixes nothing;
* ``style``: ruff diagnostics the change introduced on changed lines (a count of Python files, capped at
  STYLE_CAP), scored for correct episodes only: it ranks solutions, and must not make a wrong attempt score
  below doing nothing (the dodge below);
* ``communication``: in [0, 1], a quarter each for a final message that exists, is concise (at most
  ``concise_words`` words), says what changed (names a changed file or uses a change verb) and how it was
  checked (names a test/run/check). It measures the form of the message, not its truth, so it is paid only when
  the episode changed a file (outside the forbidden ones) and any claim of passing tests in its message is backed
  by its own last test run (a claim after a failing run, or without any test run, earns 0). An LLM judge can
  replace it: `set_communication_judge` (off by default);
* penalties (counts): ``invalid_calls``, ``unfinished_todos``, ``repeated_calls`` (a call identical in name and
  arguments to an earlier one), ``forbidden_edits`` (files the task forbids that the agent changed);
* ``length``: the concave length penalty C(x) = ((1 + kx)^(1-q) - 1) / (k(1-q)) (log(1 + kx)/k at q = 1) over
  x = a weighted count of thinking, tool-call, tool-output and message tokens, tool calls and turns.
  The default weight and shape (-0.0003, k = 0.01, q = 0.8) cost -0.05, -0.15, -0.32 and -0.59 at x = 300, 3K, 30K
  and 300K: shorter is better among equals, and no length turns a correct episode's reward below a wrong one's.
  (The first defaults, -0.01 with q = 0.5, cost -1.8 at x = 300: a correct short answer scored below zero and
  length differences outweighed correctness.)

Ordering (Cursor reported RL policies that emitted broken tool calls to dodge the penalty for bad edits, and
stalled with needless clarifying questions): for every weights file within WEIGHT_RANGES, among episodes with the
same length and call/todo counts, correct > wrong attempt >= no-op >= broken tool calls / stalling, where a wrong
attempt changed files without forbidden edits. Why the ranges give it: correctness outweighs the most
communication plus the most style penalty (the joint condition correctness > communication + STYLE_CAP x
|style|); only changed episodes earn communication and tests_fraction, and only correct ones pay style; penalty
weights are <= 0 and length counts >= 0, so more invalid calls or a longer stall never gain. A no-op's total is
<= 0. check_config refuses weights outside the ranges.

`WeightFile` holds the weights in a JSON file that may be edited while RL runs: it is re-read whenever its
modification time changes, and each change is logged with the step at which it took effect.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger(__name__)

DEFAULT_WEIGHTS = {
    "weights": {"correctness": 1.0, "tests_fraction": 0.0, "style": -0.02, "communication": 0.1,
                "invalid_calls": -0.02, "unfinished_todos": -0.02, "repeated_calls": -0.01,
                "forbidden_edits": -0.5, "length": -0.0003},
    "length": {"k": 0.01, "q": 0.8,
               "counts": {"thinking_tokens": 1.0, "tool_call_tokens": 1.0, "tool_output_tokens": 0.25,
                          "message_tokens": 1.0, "tool_calls": 10.0, "turns": 10.0}},
    "communication": {"concise_words": 120},
}
LENGTH_COUNTS = tuple(DEFAULT_WEIGHTS["length"]["counts"])
# the documented ranges (inclusive) of each weight, plus one joint condition, correctness > communication +
# STYLE_CAP x |style|: within them the ordering in the module docstring holds; check_config enforces both
WEIGHT_RANGES = {"correctness": (0.1, 10.0), "tests_fraction": (0.0, 10.0), "style": (-1.0, 0.0),
                 "communication": (0.0, 10.0), "invalid_calls": (-10.0, 0.0), "unfinished_todos": (-10.0, 0.0),
                 "repeated_calls": (-10.0, 0.0), "forbidden_edits": (-10.0, 0.0), "length": (-1.0, 0.0)}
OTHER_RANGES = {"length.k": (1e-6, 1.0), "length.q": (0.0, 2.0), "length.counts": (0.0, 100.0),
                "communication.concise_words": (1.0, 10000.0)}
PARTS = tuple(DEFAULT_WEIGHTS["weights"])


# --------------------------------------------------------------------------------------------------------
# the parts
# --------------------------------------------------------------------------------------------------------

STYLE_CAP = 10


_TEST_RUN = re.compile(r"pytest|unittest|\b(tox|nox)\b|\b(make|npm|go|cargo)\s+test\b|\btest\w*\.py\b|_test\.py\b")


def last_test_run(calls) -> Optional[bool]:
    """Whether the episode's last run_command that ran tests (pytest, unittest, tox, make test, a test_*.py ...)
    exited 0; None if none did."""
    for call in reversed(calls):
        parsed = call.parsed or {}
        if call.name == "run_command" and call.valid and _TEST_RUN.search(parsed.get("command", "")):
            last = call.observation.rstrip().rsplit("\n", 1)[-1]
            return last == "[exit code 0]"
    return None


_CLAIM = re.compile(r"\b(tests?|pytest|suite)\b[^.;\n]{0,40}\b(pass|passes|passed|passing|green|succeed\w*)\b|"
                    r"\b(all|everything)\b[^.;\n]{0,20}\b(pass|passes|passed|passing|green)\b", re.I)


def claims_passing(message: Optional[str]) -> bool:
    return bool(message and _CLAIM.search(message))


def changed_lines(old: str, new: str) -> set[int]:
    """1-based line numbers of `new` that were added or modified relative to `old`."""
    out = set()
    matcher = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            out.update(range(j1 + 1, j2 + 1))
    return out


def ruff_diagnostics(source: str, filename: str = "file.py") -> list[dict]:
    """ruff's diagnostics (default rules, no project config) of one Python source: [{'code', 'row'}]."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    argv = [ruff] if os.path.exists(ruff) else [sys.executable, "-m", "ruff"]
    r = subprocess.run(argv + ["check", "--isolated", "--no-cache", "--output-format", "json",
                               "--stdin-filename", filename, "-"], input=source, capture_output=True, text=True,
                       timeout=60)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"ruff failed ({r.returncode}): {r.stderr.strip()[:500]}")
    return [{"code": d["code"] or "syntax", "row": d["location"]["row"]} for d in json.loads(r.stdout or "[]")]


def style_violations(changes: dict[str, tuple[str, str]]) -> int:
    """Diagnostics on changed lines of changed .py files that the original did not have.

    A diagnostic is keyed by its code and the text of its line, so one that only moved is not counted.
    changes: path -> (old text, new text); a new file has old text ''."""
    total = 0
    for path, (old, new) in sorted(changes.items()):
        if not path.endswith(".py"):
            continue
        lines = changed_lines(old, new)
        old_lines, new_lines = old.splitlines(), new.splitlines()

        def key(d, text_lines):
            row = d["row"]
            return d["code"], text_lines[row - 1].strip() if 0 < row <= len(text_lines) else ""

        before = Counter(key(d, old_lines) for d in ruff_diagnostics(old, path)) if old else Counter()
        after = Counter(key(d, new_lines) for d in ruff_diagnostics(new, path) if d["row"] in lines)
        total += sum((after - before).values())
    return total


_CHANGE = re.compile(r"\b(add|added|adds|change|changed|changes|fix|fixed|fixes|implement|implemented|implements|"
                     r"update|updated|updates|remove|removed|removes|rewrote|rewrite|replace|replaced|refactor|"
                     r"refactored|modify|modified|edit|edited|wrote|write)\b", re.I)
_CHECK = re.compile(r"\b(test|tests|tested|pytest|ran|run|running|check|checked|verify|verified|passes|passed|"
                    r"passing)\b", re.I)


def communication(message: Optional[str], changed_files: list[str], concise_words: int = 120) -> float:
    """A quarter each: a final message exists, it is concise, it says what changed, it says how it was checked."""
    if not message or not message.strip():
        return 0.0
    score = 0.25
    score += 0.25 if len(message.split()) <= concise_words else 0.0
    names = {os.path.basename(p) for p in changed_files} | set(changed_files)
    score += 0.25 if _CHANGE.search(message) or any(n and n in message for n in names) else 0.0
    score += 0.25 if _CHECK.search(message) else 0.0
    return score


_JUDGE: Optional[Callable[["EpisodeFacts"], float]] = None


def set_communication_judge(judge: Optional[Callable[["EpisodeFacts"], float]]):
    """Replace the communication heuristic by judge(facts) -> [0, 1] (e.g. an LLM asked whether the final
    message truthfully says what changed and how it was checked); None restores the heuristic. The gates stay:
    an episode that changed nothing or whose claim is contradicted earns 0 whatever the judge says."""
    global _JUDGE
    _JUDGE = judge


def communication_part(facts: "EpisodeFacts", concise_words: int) -> float:
    """communication(), paid only to an episode that changed something and whose claim of passing tests (if it
    makes one) is backed by its own last test run: a claim after a failing run, or with no test run at all, is 0."""
    if not facts.changes:
        return 0.0
    if claims_passing(facts.final_message) and facts.last_test_run is not True:
        return 0.0
    if _JUDGE is not None:
        return min(1.0, max(0.0, float(_JUDGE(facts))))
    return communication(facts.final_message, sorted(facts.changes), concise_words)


def repeated_calls(calls: list[tuple[str, str]]) -> int:
    """Calls identical (name and canonical arguments) to an earlier call of the episode."""
    seen, repeats = set(), 0
    for name, arguments in calls:
        try:
            key = (name, json.dumps(json.loads(arguments), sort_keys=True))
        except ValueError:
            key = (name, arguments)
        repeats += key in seen
        seen.add(key)
    return repeats


def concave_length(x: float, k: float, q: float) -> float:
    """C(x) = ((1 + kx)^(1-q) - 1) / (k(1-q)), and log(1 + kx)/k at q = 1; C(0) = 0, C'(0) = 1, concave for q > 0."""
    if k <= 0:
        raise ValueError(f"length penalty: k must be positive, got {k}")
    if x < 0:
        raise ValueError(f"length penalty: x must be >= 0, got {x}")
    if abs(q - 1.0) < 1e-12:
        return math.log1p(k * x) / k
    return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


def length_x(counts: dict[str, float], weights: dict[str, float]) -> float:
    missing = set(LENGTH_COUNTS) - set(counts)
    if missing:
        raise ValueError(f"length counts missing {sorted(missing)}")
    return sum(weights.get(name, 0.0) * counts[name] for name in LENGTH_COUNTS)


# --------------------------------------------------------------------------------------------------------
# what the parts are computed from, and the weighted total
# --------------------------------------------------------------------------------------------------------

@dataclass
class EpisodeFacts:
    """Everything the reward needs from a finished episode (filled by the episode loop)."""

    correct: Optional[bool] = None                    # every expected test passed (grading.py); None: from
    tests_fraction: Optional[float] = None            # test_exit_code == 0, and tests_fraction = correctness
    test_exit_code: Optional[int] = None              # exit-code grading (non-pytest commands)
    test_output: str = ""
    changes: dict = field(default_factory=dict)       # path -> (old text, new text) of changed text files
    final_message: Optional[str] = None
    calls: list = field(default_factory=list)         # (name, argument text) of every tool call
    invalid_calls: int = 0
    unfinished_todos: int = 0
    forbidden_edits: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)        # the LENGTH_COUNTS
    last_test_run: Optional[bool] = None              # last_test_run(): did the agent's last test command pass
    style_violations: Optional[int] = None            # precomputed style count (None: ruff runs on `changes`)


@dataclass
class Score:
    parts: dict
    weights: dict
    total: float
    length_x: float
    error: Optional[str] = None  # why the episode could not be scored (parts empty, total 0)

    def to_json(self) -> dict:
        return {**self.parts, "total": self.total, "length_x": self.length_x, "weights": self.weights,
                "error": self.error}


def score(facts: EpisodeFacts, config: Optional[dict] = None) -> Score:
    """All reward parts of an episode and their weighted sum under config (a WeightFile's current value)."""
    config = config or DEFAULT_WEIGHTS
    x = length_x(facts.counts, config["length"]["counts"])
    correct = float(bool(facts.correct) if facts.correct is not None else facts.test_exit_code == 0)
    fraction = facts.tests_fraction if facts.tests_fraction is not None else correct
    style = 0
    if correct:
        style = facts.style_violations if facts.style_violations is not None else style_violations(facts.changes)
    parts = {
        "correctness": correct,
        "tests_fraction": float(fraction) if facts.changes or correct else 0.0,
        "style": float(min(style, STYLE_CAP)),
        "communication": communication_part(facts, config["communication"]["concise_words"]),
        "invalid_calls": float(facts.invalid_calls),
        "unfinished_todos": float(facts.unfinished_todos),
        "repeated_calls": float(repeated_calls(facts.calls)),
        "forbidden_edits": float(len(facts.forbidden_edits)),
        "length": concave_length(x, config["length"]["k"], config["length"]["q"]),
    }
    weights = config["weights"]
    return Score(parts, dict(weights), sum(weights.get(k, 0.0) * v for k, v in parts.items()), x)


def check_ranges(config: dict, where: str):
    """Every weight and shape parameter within WEIGHT_RANGES / OTHER_RANGES (outside them the ordering
    correct > wrong attempt >= no-op >= broken calls / stalling can fail); the error names the key and range."""
    values = [(f"weights.{k}", v, WEIGHT_RANGES[k]) for k, v in config["weights"].items()]
    values += [(f"length.{k}", config["length"][k], OTHER_RANGES[f"length.{k}"]) for k in ("k", "q")]
    values += [(f"length.counts.{k}", v, OTHER_RANGES["length.counts"]) for k, v in config["length"]["counts"].items()]
    values.append(("communication.concise_words", config["communication"]["concise_words"],
                   OTHER_RANGES["communication.concise_words"]))
    for key, value, (low, high) in values:
        if not low <= value <= high:
            raise ValueError(f"{where}: {key} = {value:g} is outside the documented range [{low:g}, {high:g}] "
                             "(megatron_ext/env/rewards.py WEIGHT_RANGES: outside it a no-op or a broken tool call "
                             "can outscore a wrong attempt, or a wrong attempt a correct one)")
    w = config["weights"]
    if not w["correctness"] > w["communication"] - STYLE_CAP * w["style"]:
        raise ValueError(f"{where}: weights.correctness ({w['correctness']:g}) must exceed weights.communication "
                         f"({w['communication']:g}) + {STYLE_CAP} x |weights.style| ({-w['style']:g}): otherwise a "
                         "wrong attempt with a good message can outscore a correct solution")


def check_config(config, where: str) -> dict:
    """DEFAULT_WEIGHTS updated by config; unknown names and non-numbers are errors that name the key."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object")
    out = copy.deepcopy(DEFAULT_WEIGHTS)
    for section, value in config.items():
        if section not in out:
            raise ValueError(f"{where}: unknown section {section!r}; sections: {sorted(out)}")
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {section} must be an object")
        for key, v in value.items():
            if key not in out[section]:
                raise ValueError(f"{where}: unknown key {section}.{key}; known: {sorted(out[section])}")
            if key == "counts":
                if not isinstance(v, dict) or set(v) - set(LENGTH_COUNTS):
                    raise ValueError(f"{where}: length.counts takes {list(LENGTH_COUNTS)}")
                for name, w in v.items():
                    _check_weight(w, f"{where}: length.counts.{name}")
                out[section][key].update({n: float(w) for n, w in v.items()})
            else:
                _check_weight(v, f"{where}: {section}.{key}")
                out[section][key] = float(v)
    if out["length"]["k"] <= 0:
        raise ValueError(f"{where}: length.k must be positive")
    check_ranges(out, where)
    return out


def _check_weight(value, where: str):
    """A weight is a finite number: NaN or Inf would make every reward NaN and every RL step skipped."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where} must be a number")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value}")


def override_weights(config: dict, items: list[str]) -> dict:
    """config with 'NAME=VALUE' weight overrides (--env-reward-weight); names are checked."""
    out = copy.deepcopy(config)
    for item in items:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or number is None:
            raise ValueError(f"--env-reward-weight {item!r}: expected NAME=NUMBER")
        _check_weight(number, f"--env-reward-weight {item!r}: the weight")
        if name.strip() not in out["weights"]:
            raise ValueError(f"--env-reward-weight {item!r}: unknown part; parts: {sorted(out['weights'])}")
        out["weights"][name.strip()] = number
    check_ranges(out, "--env-reward-weight")
    return out


class WeightFile:
    """Reward weights from a JSON file, re-read when its mtime changes; `changes` lists (step, config) taken.

    A file that becomes invalid while running keeps the last good weights (logged), so a typo never stops RL."""

    def __init__(self, path: Optional[str], log_fn: Callable[[str], None] = log.info):
        self.path, self.log = path, log_fn
        self.mtime: Optional[int] = None
        self.config = copy.deepcopy(DEFAULT_WEIGHTS)
        self.changes: list[tuple[int, dict]] = []
        if path is not None:
            if not os.path.isfile(path):
                raise ValueError(f"reward weights file {path} does not exist; write one (see "
                                 "megatron_ext/env/rewards.py DEFAULT_WEIGHTS) or leave the flag out")
            self._load(step=0, strict=True)

    def _load(self, step: int, strict: bool):
        mtime = os.stat(self.path).st_mtime_ns
        try:
            with open(self.path) as f:
                try:
                    loaded = json.load(f)
                except ValueError as e:
                    raise ValueError(f"--env-reward-weights {self.path}: invalid JSON ({e})") from None
            config = check_config(loaded, self.path)
        except (ValueError, OSError) as e:
            if strict:
                raise ValueError(str(e)) from None
            self.log(f"reward weights: {self.path} is invalid at step {step} ({e}); keeping the previous weights")
            self.mtime = mtime
            return
        self.mtime = mtime
        if config != self.config or not self.changes:
            self.config = config
            self.changes.append((step, copy.deepcopy(config)))
            self.log(f"reward weights: step {step} takes {json.dumps(config, sort_keys=True)} from {self.path}")

    def current(self, step: int = 0) -> dict:
        if self.path is not None and os.stat(self.path).st_mtime_ns != self.mtime:
            self._load(step, strict=False)
        return self.config
