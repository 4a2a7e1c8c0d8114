"""Reward parts equal hand-computed values; the weights file reloads on change and logs the step."""

from __future__ import annotations

import copy
import json
import os
import random

import pytest

from megatron_ext.env.rewards import (DEFAULT_WEIGHTS, STYLE_CAP, WEIGHT_RANGES, EpisodeFacts, WeightFile,
                                      changed_lines, check_config, claims_passing, communication, concave_length,
                                      last_test_run, override_weights, repeated_calls, score,
                                      set_communication_judge, style_violations)
from megatron_ext.env.tools import ToolCall


def test_concave_length_by_hand():
    # k = 0.01, q = 0.5, x = 380: ((1 + 3.8)^0.5 - 1) / (0.01 * 0.5)
    assert concave_length(380, 0.01, 0.5) == pytest.approx((4.8 ** 0.5 - 1) / 0.005)
    assert concave_length(380, 0.01, 0.5) == pytest.approx(238.178046, abs=1e-6)
    assert concave_length(0, 0.01, 0.5) == 0.0
    assert concave_length(100, 0.1, 1.0) == pytest.approx(23.978952728)  # log(11) / 0.1
    assert concave_length(100, 0.1, 2.0) == pytest.approx(9.0909090909)  # (1 - 1/11) / 0.1
    with pytest.raises(ValueError, match="k must be positive"):
        concave_length(1, 0, 0.5)


def test_style_counts_only_diagnostics_introduced_on_changed_lines():
    old = "import sys\n\n\ndef f():\n    return 1\n"           # F401 on line 1, already there
    new = "import sys\nimport os\n\n\ndef f():\n    return x\n"  # adds F401 (os, line 2) and F821 (x, line 6)
    assert changed_lines(old, new) == {2, 6}
    assert style_violations({"m.py": (old, new)}) == 2
    assert style_violations({"m.py": (old, old + "\n")}) == 0
    assert style_violations({"README.md": ("", "import os\n")}) == 0
    assert style_violations({"new.py": ("", "import os\n")}) == 1
    moved = "\n\ndef f():\n    return 1\n\n\nimport sys\n"  # the unused import moved to a changed line 7
    assert 7 in changed_lines(old, moved) and style_violations({"m.py": (old, moved)}) == 0


def test_communication_and_repeats():
    assert communication(None, []) == 0.0
    assert communication("ok", []) == 0.5
    assert communication("Implemented add in calc/__init__.py; ran pytest, 4 passed.", ["calc/__init__.py"]) == 1.0
    assert communication("see calc/__init__.py " + "word " * 200, ["calc/__init__.py"]) == 0.5
    calls = [("run_command", '{"command": "ls", "timeout_s": 5}'), ("run_command", '{"timeout_s": 5, "command": "ls"}'),
             ("run_command", '{"command": "pwd"}'), ("edit_file", "{bad"), ("edit_file", "{bad")]
    assert repeated_calls(calls) == 2


def test_score_by_hand():
    facts = EpisodeFacts(
        correct=False, tests_fraction=0.75,
        changes={"m.py": ("def f():\n    return 1\n", "import os\n\n\ndef f():\n    return 2\n")},
        final_message="Changed m.py; tested it.", calls=[("grep", '{"pattern": "f"}'), ("grep", '{"pattern": "f"}')],
        invalid_calls=2, unfinished_todos=1, forbidden_edits=["tests/t.py"],
        counts={"thinking_tokens": 100, "tool_call_tokens": 50, "tool_output_tokens": 400, "message_tokens": 20,
                "tool_calls": 5, "turns": 6})
    s = score(facts)
    # x = 100 + 50 + 0.25 * 400 + 20 + 10 * 5 + 10 * 6 = 380
    assert s.length_x == 380
    # style ranks correct solutions only: 0 here, 1 (the new F401) for the same change when correct
    assert s.parts == pytest.approx({"correctness": 0.0, "tests_fraction": 0.75, "style": 0.0, "communication": 1.0,
                                     "invalid_calls": 2.0, "unfinished_todos": 1.0, "repeated_calls": 1.0,
                                     "forbidden_edits": 1.0, "length": 184.255429})
    # C(380) at k = 0.01, q = 0.8: (4.8 ** 0.2 - 1) / 0.002 = 184.255429
    # 0 + 0 * 0.75 - 0.02 * 0 + 0.1 * 1 - 0.02 * 2 - 0.02 * 1 - 0.01 * 1 - 0.5 * 1 - 0.0003 * 184.255429
    assert s.total == pytest.approx(0.1 - 0.04 - 0.02 - 0.01 - 0.5 - 0.0552766287)
    facts.correct, facts.tests_fraction = True, 1.0
    assert score(facts).parts["style"] == 1.0 and score(facts).parts["correctness"] == 1.0
    # exit-code grading (a non-pytest command): correctness from the exit code, tests_fraction equal to it
    facts.correct = facts.tests_fraction = None
    facts.test_exit_code, facts.test_output = 1, "= 3 passed in 0.1s ="  # printed text is never read
    assert score(facts).parts["correctness"] == 0.0 and score(facts).parts["tests_fraction"] == 0.0


def test_weight_file_reloads_and_logs(tmp_path):
    path = tmp_path / "weights.json"
    path.write_text(json.dumps({"weights": {"correctness": 2.0}}))
    logged = []
    w = WeightFile(str(path), log_fn=logged.append)
    assert w.current(0)["weights"]["correctness"] == 2.0 and w.current(0)["weights"]["style"] == -0.02
    assert w.current(3) is w.config and len(w.changes) == 1  # unchanged file: no re-read, no new entry

    def rewrite(payload, tick):
        path.write_text(json.dumps(payload))
        os.utime(path, ns=(0, 10**18 + tick))

    rewrite({"weights": {"correctness": 1.0}, "length": {"k": 0.5, "counts": {"turns": 0.0}}}, 1)
    config = w.current(7)
    assert config["weights"]["correctness"] == 1.0 and config["length"]["k"] == 0.5
    assert config["length"]["counts"]["turns"] == 0.0 and config["length"]["counts"]["tool_calls"] == 10.0
    assert [step for step, _ in w.changes] == [0, 7] and "step 7 takes" in logged[-1]
    rewrite({"weights": {"corectness": 1.0}}, 2)
    assert w.current(9) == config and "unknown key weights.corectness" in logged[-1] and len(w.changes) == 2
    with pytest.raises(ValueError, match="does not exist"):
        WeightFile(str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="length.k must be positive"):
        path.write_text(json.dumps({"length": {"k": 0}}))
        WeightFile(str(path))


def test_override_weights():
    out = override_weights(DEFAULT_WEIGHTS, ["style=-0.01", " length = 0"])
    assert out["weights"]["style"] == -0.01 and out["weights"]["length"] == 0.0
    assert DEFAULT_WEIGHTS["weights"]["style"] == -0.02  # the defaults are not modified
    for bad, message in (("style", "expected NAME=NUMBER"), ("style=x", "expected NAME=NUMBER"),
                         ("styel=1", "unknown part"), ("style=-2", r"weights.style = -2 is outside"),
                         ("style=-0.5", "must exceed")):
        with pytest.raises(ValueError, match=message):
            override_weights(DEFAULT_WEIGHTS, [bad])


# ---- rewards that cannot be gamed (issue 23) ----------------------------------------------------------------

COUNTS = {"thinking_tokens": 300, "tool_call_tokens": 120, "tool_output_tokens": 800, "message_tokens": 40,
          "tool_calls": 6, "turns": 6}
CHANGE = {"notes.txt": ("old\n", "new\n")}  # not Python: no ruff run; style comes from style_violations
GOOD_MESSAGE = "Changed notes.txt; ran pytest, the tests pass."
P2P = 1 / 3  # the untouched repository passes one of three expected tests


def _facts(correct=False, fraction=P2P, changes=None, message=None, last_run=None, style=0, invalid=0, **counts):
    return EpisodeFacts(correct=correct, tests_fraction=fraction, changes=dict(changes or {}), final_message=message,
                        invalid_calls=invalid, counts={**COUNTS, **counts}, last_test_run=last_run,
                        style_violations=style)


SCENARIOS = {
    # the worst a correct episode can score at these counts: no message, style past the cap
    "correct": _facts(correct=True, fraction=1.0, changes=CHANGE, style=STYLE_CAP + 7),
    # the best a wrong attempt can score: all but one of many tests, a perfect message backed by a passing (visible) test run
    "wrong_best": _facts(fraction=0.999, changes=CHANGE, message=GOOD_MESSAGE, last_run=True, style=40),
    # the worst wrong attempt in the ordering's class: no message, no more tests than the untouched repository
    "wrong_worst": _facts(changes=CHANGE, style=40),
    "noop": _facts(message="Fixed it; the tests pass."),
    "broken_calls": _facts(invalid=6, tool_calls=12, tool_call_tokens=400),
    "stalling": _facts(message="Before I change anything: which behaviour do you want for negative numbers?",
                       turns=12, message_tokens=400),
}


def _weights(rng) -> dict:
    return {"weights": {k: rng.uniform(*r) for k, r in WEIGHT_RANGES.items()},
            "length": {"k": rng.uniform(1e-4, 1.0), "q": rng.uniform(0, 2),
                       "counts": {k: rng.uniform(0, 100) for k in COUNTS}}}


def _order_holds(config) -> bool:
    total = {name: score(f, config).total for name, f in SCENARIOS.items()}
    return (total["correct"] > total["wrong_best"] and total["wrong_worst"] >= total["noop"] >= total["broken_calls"]
            and total["noop"] >= total["stalling"] and total["noop"] <= 0)


def test_order_of_totals_holds_for_any_weights_in_the_documented_ranges():
    rng = random.Random(23)
    corners = [{"weights": {k: r[i] for k, r in WEIGHT_RANGES.items()}} for i in (0, 1)]
    edge = {"weights": {"correctness": 0.5, "communication": 0.29, "style": -0.02, "tests_fraction": 0.0}}
    accepted = refused = 0
    for raw in corners + [edge] + [_weights(rng) for _ in range(400)]:
        try:
            config = check_config(raw, "w.json")
        except ValueError as e:
            assert "must exceed" in str(e)
            refused += 1
            full = copy.deepcopy(DEFAULT_WEIGHTS)
            full["weights"].update(raw["weights"])
            full["length"].update(raw.get("length", {}))
            w = full["weights"]
            if w["correctness"] < w["communication"] - STYLE_CAP * w["style"] - 0.01:
                assert not _order_holds(full), raw  # what the file check refuses breaks the order here
            continue
        accepted += 1
        assert _order_holds(config), config["weights"]
    assert accepted > 30 and refused > 30
    with pytest.raises(ValueError, match=r"weights.communication = -0.1 is outside the documented range"):
        check_config({"weights": {"communication": -0.1}}, "w.json")
    with pytest.raises(ValueError, match=r"length.counts.turns = -1 is outside"):
        check_config({"length": {"counts": {"turns": -1}}}, "w.json")


def test_noop_and_unbacked_claims_earn_no_communication():
    s = score(SCENARIOS["noop"])
    assert s.parts["communication"] == 0.0 and s.total <= 0
    backed = _facts(changes=CHANGE, message=GOOD_MESSAGE, last_run=True)
    assert score(backed).parts["communication"] == 1.0
    for last_run in (False, None):  # contradicted by a failing run; or claimed with no test run at all
        assert score(_facts(changes=CHANGE, message=GOOD_MESSAGE, last_run=last_run)).parts["communication"] == 0
    no_claim = _facts(changes=CHANGE, message="Changed notes.txt; checked it by reading it back.")
    assert score(no_claim).parts["communication"] == 1.0
    assert claims_passing("All 3 tests pass now") and claims_passing("pytest is green")
    assert not claims_passing("Implemented add in calc/__init__.py; ran the tests.")


def test_last_test_run_reads_the_last_test_command():
    def call(command, status):
        return ToolCall("c", "run_command", "{}", {"command": command}, f"out\n[exit code {status}]")
    assert last_test_run([]) is None
    assert last_test_run([call("ls", 1)]) is None and last_test_run([call("cat tests/conftest.py", 0)]) is None
    assert last_test_run([call("python tests/test_calc.py", 1)]) is False
    assert last_test_run([call("make test", 0)]) is True
    assert last_test_run([call("python -m pytest -q", 1), call("ls", 0)]) is False
    assert last_test_run([call("python -m pytest -q", 1), call("python -m pytest -q", 0), call("ls", 2)]) is True


def test_communication_judge_hook_is_off_by_default_and_gated():
    assert score(_facts(changes=CHANGE, message="ok")).parts["communication"] == 0.5
    set_communication_judge(lambda facts: 0.9)
    try:
        assert score(_facts(changes=CHANGE, message="ok")).parts["communication"] == 0.9
        assert score(SCENARIOS["noop"]).parts["communication"] == 0.0  # the gates stay
    finally:
        set_communication_judge(None)
