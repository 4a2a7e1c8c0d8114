"""A generated family of small repository tasks with hidden tests and oracle scripts (issue 26), small enough
that a tiny model can learn them from a few hundred demonstrations, varied enough that a held-out split measures
generalisation rather than memory.

Every task is one Python function computed by a *program*: a composition of 1..max_depth primitives from a
small typed grammar over strings, lists of ints and ints (``upper``, ``reverse``, ``keep_even``, ``sum``,
``add(c)`` ...). Kinds:

* ``implement``: the function's body is ``raise NotImplementedError``; the instruction and docstring say what it
  does in words that map one-to-one onto the primitives, plus an example.
* ``bugfix``: the function is the program with one token changed (an operator, a constant or a method); a visible
  test fails and the instruction names it.
* ``submodule``: like ``implement``, but the file lies in ``PKG/SUB/MOD.py`` and the instruction names only the
  package, so the agent lists the repository before reading.

The split is by the program's *shape* (the primitives in order, constants abstracted): ``upper | suffix`` is one
shape whatever the suffix. Shapes of one primitive always train (they teach the primitives); a longer shape is
held out when its hash falls under the held-out fraction. The rule does not depend on the seed or the counts,
so tasks generated with another seed keep the same split, and a held-out program is a new combination of
primitives whose every primitive appears in training (the generator checks it).

Everything visible is deterministic in the seed: the same seed writes byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_ext.env.grading import GUARDED_MODULES

KINDS = ("implement", "bugfix", "submodule")
GENERATOR = "agent_tasks/v2"   # v2: paths in backticks (tokenised as in a tool call's JSON string)
SPLIT_SALT = "agent_tasks/v1"  # the split rule's hash, unchanged since v1: the same shapes stay held out
VISIBLE_TEST_COMMAND = "python -m pytest -q -p no:cacheprovider tests"   # no .pytest_cache in the diff
TEST_COMMAND = "python -m pytest -q tests tests_hidden"
FORBIDDEN = ["tests/*", "tests_hidden/*", "*conftest.py"]
STUB_LINE = "    raise NotImplementedError\n"
MAX_INSTRUCTION_CHARS = 200   # a tiny model's context holds the whole episode


class AgentTaskError(ValueError):
    """Generation cannot meet the request (e.g. no held-out program for the chosen kinds and depth)."""


@dataclass(frozen=True)
class Primitive:
    name: str
    takes: str            # "str" | "list" | "int"
    gives: str
    code: str             # an expression over {v} (the value) and {c} (the constant)
    words: str            # an imperative phrase over {x} (the value's name, or "it") and {c}
    const: Optional[Callable] = None   # rng -> constant
    bugs: tuple = ()      # one-token variants of code; "const" means: the constant off by one

    def render(self, v: str, c) -> str:
        return self.code.format(v=v, c=repr(c))


def _letters(rng: random.Random) -> str:
    return "".join(rng.choice("xyz") for _ in range(rng.randint(1, 2)))


PRIMITIVES = {p.name: p for p in (
    Primitive("upper", "str", "str", "{v}.upper()", "upper-case {x}", bugs=("{v}.lower()",)),
    Primitive("lower", "str", "str", "{v}.lower()", "lower-case {x}", bugs=("{v}.upper()",)),
    Primitive("reverse", "str", "str", "{v}[::-1]", "reverse {x}", bugs=("{v}[::1]",)),
    Primitive("strip", "str", "str", "{v}.strip()", "strip the spaces around {x}", bugs=("{v}.lstrip()",)),
    Primitive("suffix", "str", "str", "{v} + {c}", "append {c} to {x}", _letters, ("const",)),
    Primitive("repeat", "str", "str", "{v} * {c}", "repeat {x} {c} times", lambda r: r.randint(2, 3), ("const",)),
    Primitive("head", "str", "str", "{v}[:{c}]", "keep the first {c} characters of {x}", lambda r: r.randint(1, 3),
              ("const",)),
    Primitive("length", "str", "int", "len({v})", "take the length of {x}"),
    Primitive("count", "str", "int", "{v}.count({c})", "count the {c} characters in {x}",
              lambda r: r.choice("abc"), ("const",)),
    Primitive("sort", "list", "list", "sorted({v})", "sort {x} ascending"),
    Primitive("reverse_list", "list", "list", "{v}[::-1]", "reverse the list {x}", bugs=("{v}[::1]",)),
    Primitive("keep_even", "list", "list", "[e for e in {v} if e % 2 == 0]", "keep the even numbers of {x}",
              bugs=("[e for e in {v} if e % 2 == 1]",)),
    Primitive("keep_odd", "list", "list", "[e for e in {v} if e % 2 == 1]", "keep the odd numbers of {x}",
              bugs=("[e for e in {v} if e % 2 == 0]",)),
    Primitive("keep_above", "list", "list", "[e for e in {v} if e > {c}]", "keep the numbers of {x} above {c}",
              lambda r: r.randint(2, 8), ("[e for e in {v} if e < {c}]",)),
    Primitive("add_each", "list", "list", "[e + {c} for e in {v}]", "add {c} to each number of {x}",
              lambda r: r.randint(1, 9), ("[e - {c} for e in {v}]",)),
    Primitive("mul_each", "list", "list", "[e * {c} for e in {v}]", "multiply each number of {x} by {c}",
              lambda r: r.randint(2, 5), ("[e + {c} for e in {v}]",)),
    Primitive("sum", "list", "int", "sum({v})", "sum {x}", bugs=("len({v})", "max({v})")),
    Primitive("size", "list", "int", "len({v})", "count the numbers in {x}", bugs=("sum({v})",)),
    Primitive("max", "list", "int", "max({v})", "take the largest number of {x}", bugs=("min({v})",)),
    Primitive("min", "list", "int", "min({v})", "take the smallest number of {x}", bugs=("max({v})",)),
    Primitive("add", "int", "int", "{v} + {c}", "add {c} to {x}", lambda r: r.randint(1, 9), ("{v} - {c}",)),
    Primitive("sub", "int", "int", "{v} - {c}", "subtract {c} from {x}", lambda r: r.randint(1, 9), ("{v} + {c}",)),
    Primitive("mul", "int", "int", "{v} * {c}", "multiply {x} by {c}", lambda r: r.randint(2, 9), ("{v} + {c}",)),
    Primitive("mod", "int", "int", "{v} % {c}", "take {x} modulo {c}", lambda r: r.randint(2, 7), ("{v} // {c}",)),
)}

# identifiers (none is a standard-library or pytest module name: grading would treat such a file as a shadow)
VERBS = ("fold", "mix", "tweak", "shape", "churn", "pack", "turn", "spin", "bend", "brew", "craft", "forge", "knit",
         "press", "sift", "trim", "warp", "weave", "blend", "cook", "tune", "grind", "shift", "stir", "polish")
NOUNS = ("word", "text", "items", "value", "data", "token", "label", "code", "entry", "batch", "chunk", "piece",
         "bits", "line", "record", "note", "score", "tally", "name", "field")
MODULE_HEADS = ("text", "word", "num", "list", "calc", "data", "item", "seq", "misc", "core", "tool", "util")
MODULE_TAILS = ("kit", "ops", "tools", "fns", "box", "lib", "bag", "help", "work", "craft")
PACKAGES = ("engine", "appcore", "project", "suite", "kernel", "toolbox", "pipeline", "service", "backend")
SUBPACKAGES = ("impl", "internal", "parts", "detail", "common", "inner", "extra", "helpers")
ARG_NAMES = {"str": ("s", "text", "word", "name", "line"), "list": ("nums", "values", "items", "xs", "data"),
             "int": ("n", "k", "num", "value", "count")}


@dataclass
class Program:
    steps: list           # [(primitive name, constant or None)]

    @property
    def takes(self) -> str:
        return PRIMITIVES[self.steps[0][0]].takes

    @property
    def shape(self) -> str:
        """The split key: the primitives in order, constants abstracted."""
        return " | ".join(name for name, _ in self.steps)

    @property
    def text(self) -> str:
        """The canonical program: ``upper | suffix('xy') | length``."""
        return " | ".join(name if c is None else f"{name}({c!r})" for name, c in self.steps)

    def body(self, arg: str, bug: Optional[tuple] = None) -> list[str]:
        """The function body, one line a step (the tiny model writes what it reads); bug = (step, code)."""
        lines = []
        for i, (name, c) in enumerate(self.steps):
            p = PRIMITIVES[name]
            if bug is not None and bug[0] == i:
                expr = bug[1]
            else:
                expr = p.render(arg, c)
            lines.append(f"    {arg} = {expr}\n")
        return lines + [f"    return {arg}\n"]

    def describe(self, arg: str) -> str:
        phrases = [PRIMITIVES[n].words.format(x=arg if i == 0 else "it", c=repr(c)) for i, (n, c) in
                   enumerate(self.steps)]
        return ", then ".join(phrases)


def shape_hash(shape: str) -> str:
    return hashlib.sha256(f"{SPLIT_SALT}:{shape}".encode()).hexdigest()[:16]


HELDOUT_FRACTION = 0.25  # share of composition shapes held out by default (tools/make_agent_tasks.py's default)


def is_heldout(shape: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """The split rule: a composition (2+ primitives) whose shape hash falls under `fraction`."""
    return " | " in shape and int(shape_hash(shape), 16) % 10000 < round(fraction * 10000)


# ---- sampling -----------------------------------------------------------------------------------------------
def sample_program(rng: random.Random, max_depth: int, allowed: Optional[set] = None) -> Program:
    depth = rng.randint(1, max_depth)
    names = sorted(n for n in PRIMITIVES if allowed is None or n in allowed)
    steps, kind = [], None
    for _ in range(depth):
        options = [n for n in names if (kind is None or PRIMITIVES[n].takes == kind) and
                   (not steps or steps[-1][0] != n)]
        if not options:
            break
        name = rng.choice(options)
        p = PRIMITIVES[name]
        steps.append((name, p.const(rng) if p.const else None))
        kind = p.gives
    return Program(steps)


def sample_input(rng: random.Random, kind: str, program: Program):
    if kind == "str":
        text = "".join(rng.choice("abcABCxyz") for _ in range(rng.randint(2, 5)))
        if any(n == "strip" for n, _ in program.steps):
            text = " " * rng.randint(0, 2) + text + " " * rng.randint(1, 2)
        return text
    if kind == "list":
        return [rng.randint(0, 12) for _ in range(rng.randint(3, 5))]
    return rng.randint(0, 40)


def compile_function(source: str, name: str) -> Callable:
    namespace: dict = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # our own generated code, never the agent's
    return namespace[name]


def _call(fn: Callable, value):
    try:
        return True, fn(value)
    except Exception:  # a step undefined on this input (max of an empty list): the input is not used
        return False, None


def _function_source(fn: str, arg: str, doc: Optional[str], body: list[str]) -> str:
    head = f"def {fn}({arg}):\n" + (f'    """{doc}"""\n' if doc else "")
    return head + "".join(body)


# ---- one task -----------------------------------------------------------------------------------------------
@dataclass
class AgentTask:
    id: str
    kind: str
    split: str
    program: Program
    files: dict                      # repo-relative path -> text
    hidden: dict                     # hidden-test-relative path -> text
    instruction: str
    fail_to_pass: list
    pass_to_pass: list
    oracle: list
    reference: dict = field(default_factory=dict)   # path -> the file with the reference solution

    def record(self) -> dict:
        base = f"tasks/{self.id}"
        return {"id": self.id, "repo": f"{base}/repo", "instruction": self.instruction,
                "test_command": TEST_COMMAND, "timeout_s": 60, "hidden_tests": f"{base}/hidden",
                "forbidden": list(FORBIDDEN), "max_turns": 8, "command_timeout_s": 30,
                "metadata": {"source": "agent_tasks", "generator": GENERATOR, "kind": self.kind, "split": self.split,
                             "program": self.program.text, "program_shape": self.program.shape,
                             "program_hash": shape_hash(self.program.shape),
                             "fail_to_pass": list(self.fail_to_pass), "pass_to_pass": list(self.pass_to_pass),
                             "reference_diff_lines": len(self.program.steps) + (1 if self.kind != "bugfix" else 0)}}


def _names(rng: random.Random) -> tuple[str, str]:
    """(target function, helper function): two different verb_noun names."""
    first = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
    while True:
        second = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
        if second != first:
            return first, second


def _module_name(rng: random.Random, pool=None) -> str:
    while True:
        name = rng.choice(pool) if pool else rng.choice(MODULE_HEADS) + rng.choice(MODULE_TAILS)
        if name not in GUARDED_MODULES:
            return name


def _pick_cases(rng: random.Random, program: Program, fn: Callable, wrong: list[Callable], count: int = 4):
    """`count` inputs on which the program is defined and differs from every wrong variant (the identity, the
    bug, the program without one of its steps), or None when too few exist: the tests then tell them apart."""
    cases, seen = [], set()
    for _ in range(80):
        value = sample_input(rng, program.takes, program)
        key = repr(value)
        if key in seen:
            continue
        seen.add(key)
        ok, out = _call(fn, value)
        if not ok:
            continue
        if all(_call(w, value) != (True, out) for w in wrong):  # a variant that raises differs too
            cases.append((value, out))
            if len(cases) == count:
                return cases
    return None


def _redundant(program: Program, fn: Callable, rng: random.Random, arg: str) -> bool:
    """A step whose removal leaves the result unchanged on sample inputs (upper then lower, reverse then sort)."""
    samples = [sample_input(rng, program.takes, program) for _ in range(12)]
    for i in range(len(program.steps)):
        rest = Program(program.steps[:i] + program.steps[i + 1:])
        if not rest.steps or not _chains(rest):
            continue
        shorter = compile_function(_function_source("f", arg, None, rest.body(arg)), "f")
        if all(_call(fn, s) == _call(shorter, s) for s in samples):
            return True
    return False


def _chains(program: Program) -> bool:
    kind = program.takes
    for name, _ in program.steps:
        if PRIMITIVES[name].takes != kind:
            return False
        kind = PRIMITIVES[name].gives
    return True


def _bug(rng: random.Random, program: Program) -> Optional[tuple[int, str]]:
    """(step, buggy expression) changing one token of one step, or None when no step has a variant."""
    options = []
    for i, (name, c) in enumerate(program.steps):
        p = PRIMITIVES[name]
        for variant in p.bugs:
            if variant == "const":
                other = c + rng.choice((1, -1)) if isinstance(c, int) else c + c[-1]
                options.append((i, p.code.format(v="{v}", c=repr(other))))
            else:
                options.append((i, variant.format(v="{v}", c=repr(c))))
    if not options:
        return None
    return rng.choice(options)


def _helper(rng: random.Random, name: str) -> Optional[tuple[str, tuple]]:
    """A working one-primitive function beside the task's (its visible test is the task's pass_to_pass), with
    one (input, output) case; None when no sampled input suits it."""
    program = sample_program(rng, 1)
    arg = rng.choice(ARG_NAMES[program.takes])
    source = _function_source(name, arg, None, program.body(arg))
    fn = compile_function(source, name)
    for _ in range(20):
        value = sample_input(rng, program.takes, program)
        ok, out = _call(fn, value)
        if ok:
            return source, (value, out)
    return None


def _layout(rng: random.Random, kind: str) -> tuple[str, str, str, list]:
    """(module, file path, import path, package __init__ files): a root module or a one-level package, and
    PKG/SUB/MODULE.py for the submodule kind."""
    module = _module_name(rng)
    if kind == "submodule":
        package, sub = _module_name(rng, PACKAGES), rng.choice(SUBPACKAGES)
        return (module, f"{package}/{sub}/{module}.py", f"{package}.{sub}.{module}",
                [f"{package}/__init__.py", f"{package}/{sub}/__init__.py"])
    if rng.random() < 0.5:
        return module, f"{module}.py", module, []
    package = _module_name(rng, PACKAGES)
    return module, f"{package}/{module}.py", f"{package}.{module}", [f"{package}/__init__.py"]


def _verify(task_id: str, fn: str, reference: str, written: str, cases: list):
    """The files say what the tests check: the reference passes every case, the repository as written none."""
    good, given = compile_function(reference, fn), compile_function(written, fn)
    for value, out in cases:
        if _call(good, value) != (True, out) or _call(given, value) == (True, out):
            raise AgentTaskError(f"{task_id}: generator error: case {fn}({value!r}) == {out!r} does not tell the "
                                 "reference from the repository")


def build_task(rng: random.Random, task_id: str, kind: str, split: str, program: Program) -> Optional[AgentTask]:
    """The task for `program`, or None when this program does not make a good one (redundant step, no bug, too
    few distinguishing inputs); the caller samples another."""
    arg = rng.choice(ARG_NAMES[program.takes])
    fn, helper = _names(rng)
    reference_src = _function_source(fn, arg, None, program.body(arg))
    reference = compile_function(reference_src, fn)
    if _redundant(program, reference, rng, arg):
        return None
    bug = _bug(rng, program) if kind == "bugfix" else None
    if kind == "bugfix" and bug is None:
        return None
    wrong = []
    if bug is not None:
        bug = (bug[0], bug[1].format(v=arg))
        wrong.append(compile_function(_function_source(fn, arg, None, program.body(arg, bug)), fn))
    if PRIMITIVES[program.steps[-1][0]].gives == program.takes:
        wrong.append(lambda v: v)
    for i in range(len(program.steps) if len(program.steps) > 1 else 0):
        rest = Program(program.steps[:i] + program.steps[i + 1:])
        if _chains(rest):
            wrong.append(compile_function(_function_source(fn, arg, None, rest.body(arg)), fn))
    cases = _pick_cases(rng, program, reference, wrong)
    if cases is None:
        return None
    (example_in, example_out), hidden_cases = cases[0], cases[1:]
    call = f"{fn}({example_in!r}) == {example_out!r}"
    words = program.describe(arg)
    doc = f"{words[0].upper()}{words[1:]}. Example: {call}."

    helper_part = _helper(rng, helper)
    if helper_part is None:
        return None
    helper_src, helper_case = helper_part
    module, path, import_from, inits = _layout(rng, kind)
    if kind == "bugfix":
        target_body = program.body(arg, bug)
    else:
        target_body = [STUB_LINE]
    target = _function_source(fn, arg, doc, target_body)
    fixed = _function_source(fn, arg, doc, program.body(arg))
    order = [helper_src, None] if rng.random() < 0.5 else [None, helper_src]
    text = "\n\n".join(target if part is None else part for part in order)
    reference_text = "\n\n".join(fixed if part is None else part for part in order)

    if kind == "bugfix":
        old_text = target_body[bug[0]]
        new_text = program.body(arg)[bug[0]]
    else:
        old_text, new_text = STUB_LINE, "".join(program.body(arg))
    if text.count(old_text) != 1:
        return None
    _verify(task_id, fn, reference_text, text, cases)

    test_file = f"tests/test_{module}.py"
    visible_test = (f"from {import_from} import {', '.join(sorted((fn, helper)))}\n\n\n"
                    f"def test_{fn}():\n    assert {call}\n\n\n"
                    f"def test_{helper}():\n    assert {helper}({helper_case[0]!r}) == {helper_case[1]!r}\n")
    hidden_file = f"tests_hidden/test_{module}_hidden.py"
    halves = (hidden_cases[:1], hidden_cases[1:])
    hidden_test = f"from {import_from} import {fn}\n"
    for suffix, part in zip(("basic", "more"), halves):
        hidden_test += f"\n\ndef test_{fn}_{suffix}():\n" + "".join(
            f"    assert {fn}({v!r}) == {out!r}\n" for v, out in part)

    files = {**{p: "" for p in inits}, path: text, test_file: visible_test}
    # paths and the package in backticks: a byte-level BPE then cuts them into the same tokens as in a tool call's
    # JSON string ("path": "pkg/mod.py"), where no space precedes them (after a space, `pkg` would be another token:
    # the tiny model would have to learn a mapping instead of copying)
    location = f"in package `{path.split('/')[0]}`" if kind == "submodule" else f"in `{path}`"
    signature = f"{fn}({arg})"
    if kind == "bugfix":
        instruction = f"Test `{test_file}::test_{fn}` fails. Fix the bug in {signature} in `{path}`."
        message = f"Fixed {fn} in {path}; ran the tests and they pass."
    else:
        instruction = f"Implement {signature} {location}: {words}. Example: {call}."
        message = f"Implemented {fn} in {path}; ran the tests and they pass."
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        return None
    oracle = [{"name": "list_dir", "arguments": {"depth": 3}}] if kind == "submodule" else []
    oracle += [{"name": "read_file", "arguments": {"path": path}},
               {"name": "edit_file", "arguments": {"path": path, "old_text": old_text, "new_text": new_text}},
               {"name": "run_command", "arguments": {"command": VISIBLE_TEST_COMMAND}},
               {"name": "finish", "arguments": {"message": message}}]
    fail_to_pass = [f"{test_file}::test_{fn}"] + [f"{hidden_file}::test_{fn}_{s}" for s in ("basic", "more")]
    return AgentTask(task_id, kind, split, program, files, {hidden_file: hidden_test}, instruction, fail_to_pass,
                     [f"{test_file}::test_{helper}"], oracle, {path: reference_text})


# ---- a family ------------------------------------------------------------------------------------------------
def generate(seed: int, train: int, heldout: int, kinds=KINDS, max_depth: int = 3,
             heldout_fraction: float = HELDOUT_FRACTION) -> dict[str, list[AgentTask]]:
    """{"train": [...], "heldout": [...]}: kinds round-robin in each split; train first (its own random stream,
    so asking for more held-out tasks leaves the training tasks as they were), then held-out programs whose
    primitives all appear in training."""
    if not kinds or any(k not in KINDS for k in kinds):
        raise AgentTaskError(f"kinds must be among {', '.join(KINDS)}; got {list(kinds)}")
    if max_depth < 1:
        raise AgentTaskError(f"max_depth must be >= 1, got {max_depth}")
    if heldout and max_depth < 2:
        raise AgentTaskError("held-out programs are compositions: max_depth must be >= 2 when heldout > 0")
    if not 0 < heldout_fraction < 1:
        raise AgentTaskError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction}")
    out = {}
    seen_primitives: set = set()
    for split, count in (("train", train), ("heldout", heldout)):
        rng = random.Random(f"{GENERATOR}:{seed}:{split}")
        out[split] = _sample_split(rng, split, split, count, kinds, max_depth, heldout_fraction,
                                   seen_primitives if split == "heldout" else None)
        if split == "train":
            seen_primitives.update(name for t in out[split] for name, _ in t.program.steps)
    return out


def _sample_split(rng: random.Random, split: str, prefix: str, count: int, kinds, max_depth: int,
                  heldout_fraction: float, allowed: Optional[set]) -> list[AgentTask]:
    tasks, attempts = [], 0
    while len(tasks) < count:
        attempts += 1
        if attempts > 200 * (count + 10):
            raise AgentTaskError(f"could not find {count} {split} programs (kinds {list(kinds)}, max depth "
                                 f"{max_depth}): raise --max-depth or --train")
        kind = kinds[len(tasks) % len(kinds)]
        program = sample_program(rng, max_depth, allowed)
        if is_heldout(program.shape, heldout_fraction) != (split == "heldout"):
            continue
        task = build_task(rng, f"{prefix}-{len(tasks):04d}-{kind}", kind, split, program)
        if task is not None:
            tasks.append(task)
    return tasks


def corpus_document(task: AgentTask) -> str:
    """A training task as plain text for code pretraining: the instruction, the repository's files, the module as
    written and (for a bug) as fixed. The text an agent copies from (paths, names, constants) and the mapping of
    the description's words to code, without the chat format; loss on every token."""
    path, fixed = next(iter(task.reference.items()))
    parts = [task.instruction, "files:\n" + "\n".join(sorted(task.files)), f"`{path}`:\n{task.files[path]}"]
    if fixed != task.files[path]:
        parts.append(f"`{path}`, fixed:\n{fixed}")
    return "\n".join(parts)


def _identifier_pattern(names) -> re.Pattern:
    """Whole identifiers: not inside a longer name, but `_` and `/` are boundaries (`test_NAME`, `PKG/MOD.py`)."""
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    return re.compile(rf"(?<![A-Za-z0-9])({alternatives})(?![A-Za-z0-9])")


_MODULES = [h + t for h in MODULE_HEADS for t in MODULE_TAILS]
_FUNCTIONS = [f"{v}_{n}" for v in VERBS for n in NOUNS]
_POOLS = (("module", _MODULES), ("package", PACKAGES), ("subpackage", SUBPACKAGES), ("function", _FUNCTIONS))
_FIND = {kind: _identifier_pattern(pool) for kind, pool in _POOLS}


def rename_identifiers(conversation: dict, rng: random.Random) -> tuple[dict, dict[str, str]]:
    """The conversation with every generated name (module, package, subpackage, function) replaced, consistently
    in every message and tool-call argument, by another draw from the same pool: what the sandbox would have shown
    for the same task under those names. SFT on such copies cannot write a name from memory of the training tasks
    (400 tasks share 120 module names), only by copying it from the instruction or a tool's output. Returns the
    copy and the mapping (old -> new)."""
    texts = [m.get("content") for m in conversation["messages"] if isinstance(m.get("content"), str)]
    texts += [c["function"]["arguments"] for m in conversation["messages"] for c in m.get("tool_calls") or []]
    text = "\n".join(texts)
    mapping: dict[str, str] = {}
    for kind, pool in _POOLS:
        found = sorted(set(_FIND[kind].findall(text)) - set(mapping))
        if kind in ("package", "subpackage"):  # ordinary words too ("common", "extra"): only as a path component
            found = [n for n in found if re.search(rf"(?<![A-Za-z0-9]){n}[/.][a-z]|/{n}(?![A-Za-z0-9])", text)]
        taken = set(found) | set(mapping.values())
        for old in found:
            new = rng.choice([n for n in pool if n not in taken and n not in GUARDED_MODULES])
            mapping[old] = new
            taken.add(new)
    out = json.loads(json.dumps(conversation))
    for m in out["messages"]:
        if isinstance(m.get("content"), str):
            m["content"] = substitute_names(m["content"], mapping)
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = substitute_names(call["function"]["arguments"], mapping)
    return out, mapping


def substitute_names(text: str, mapping: dict[str, str]) -> str:
    """`text` with each whole identifier of `mapping` replaced at once (a swap of two names stays a swap)."""
    if not mapping:
        return text
    return _identifier_pattern(mapping).sub(lambda m: mapping[m.group(1)], text)


def generate_corpus(seed: int, count: int, kinds=KINDS, max_depth: int = 3,
                    heldout_fraction: float = HELDOUT_FRACTION) -> list[AgentTask]:
    """`count` training-split tasks from their own random stream (disjoint in sampling from the family's tasks of
    the same seed): documents for code pretraining. Held-out shapes never appear (the same split rule)."""
    rng = random.Random(f"{GENERATOR}:{seed}:corpus")
    return _sample_split(rng, "train", "corpus", count, kinds, max_depth, heldout_fraction, None)


def _write(path: str, text: str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_family(out: str, family: dict[str, list[AgentTask]]) -> dict:
    """DIR/{train,heldout}.jsonl, DIR/tasks/<id>/{repo,hidden}, DIR/oracle/<id>.json; returns the characters of
    each instruction, module, visible and hidden test file (what a tiny model's context must hold)."""
    for name in ("tasks", "oracle"):
        if os.path.isdir(os.path.join(out, name)):
            shutil.rmtree(os.path.join(out, name))
    sizes = {"instruction": [], "module": [], "visible test": [], "hidden test": []}
    for split, tasks in family.items():
        lines = []
        for task in tasks:
            root = os.path.join(out, "tasks", task.id)
            for rel, text in task.files.items():
                _write(os.path.join(root, "repo", rel), text)
                if text:
                    sizes["module" if rel in task.reference else "visible test"].append(len(text))
            for rel, text in task.hidden.items():
                _write(os.path.join(root, "hidden", rel), text)
                sizes["hidden test"].append(len(text))
            _write(os.path.join(out, "oracle", f"{task.id}.json"), json.dumps(task.oracle, indent=1) + "\n")
            lines.append(json.dumps(task.record()) + "\n")
            sizes["instruction"].append(len(task.instruction))
        _write(os.path.join(out, f"{split}.jsonl"), "".join(lines))
    return sizes


def copy_drill(rng: random.Random, code_lines: Sequence[str], items: tuple[int, int] = (2, 5)) -> dict:
    """A short conversation that trains the one skill an episode of this family cannot do without, copying from
    the context: the user lists a few items, the assistant writes them back verbatim. The items are what episodes
    copy: file paths (`PKG/SUB/MOD.py`) and function names drawn from the generator's pools, and code lines (give
    lines of training-split programs only, so no held-out program is seen). An episode copies about 40 tokens (a
    path into read_file, a line into edit_file, a name into finish) in ~1000; packed SFT rows of drills hold ~15
    times as many copied tokens."""
    def item() -> str:
        r = rng.random()
        if r < 0.35:
            parts = [rng.choice(PACKAGES)] if r > 0.1 else []
            parts += [rng.choice(SUBPACKAGES)] if r > 0.25 else []
            return "/".join(parts + [rng.choice(_MODULES) + ".py"])
        if r < 0.5 or not code_lines:
            return rng.choice(_FUNCTIONS)
        return rng.choice(code_lines)

    body = "\n".join(item() for _ in range(rng.randint(*items)))
    return {"messages": [{"role": "user", "content": "Write back exactly:\n" + body},
                         {"role": "assistant", "content": body}]}
