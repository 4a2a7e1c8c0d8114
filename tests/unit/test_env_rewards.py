"""Reward parts equal hand-computed values; the weights file reloads on change and logs the step."""

from __future__ import annotations

import json
import os

import pytest

from megatron_ext.env.rewards import (DEFAULT_WEIGHTS, EpisodeFacts, WeightFile, changed_lines, communication,
                                      concave_length, override_weights, passed_fraction, repeated_calls, score,
                                      style_violations)


def test_concave_length_by_hand():
    # k = 0.01, q = 0.5, x = 380: ((1 + 3.8)^0.5 - 1) / (0.01 * 0.5)
    assert concave_length(380, 0.01, 0.5) == pytest.approx((4.8 ** 0.5 - 1) / 0.005)
    assert concave_length(380, 0.01, 0.5) == pytest.approx(238.178046, abs=1e-6)
    assert concave_length(0, 0.01, 0.5) == 0.0
    assert concave_length(100, 0.1, 1.0) == pytest.approx(23.978952728)  # log(11) / 0.1
    assert concave_length(100, 0.1, 2.0) == pytest.approx(9.0909090909)  # (1 - 1/11) / 0.1
    with pytest.raises(ValueError, match="k must be positive"):
        concave_length(1, 0, 0.5)


def test_passed_fraction():
    assert passed_fraction(1, "..F.\n1 failed, 3 passed in 0.50s\n") == 0.75
    assert passed_fraction(1, "= 2 passed, 1 failed, 1 error in 1.2s =") == 0.5
    assert passed_fraction(0, "ok") == 1.0 and passed_fraction(2, "Traceback") == 0.0 and passed_fraction(None, "") == 0


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
        test_exit_code=1, test_output="1 failed, 3 passed in 0.2s",
        changes={"m.py": ("def f():\n    return 1\n", "import os\n\n\ndef f():\n    return 2\n")},
        final_message="Changed m.py; tested it.", calls=[("grep", '{"pattern": "f"}'), ("grep", '{"pattern": "f"}')],
        invalid_calls=2, unfinished_todos=1, forbidden_edits=["tests/t.py"],
        counts={"thinking_tokens": 100, "tool_call_tokens": 50, "tool_output_tokens": 400, "message_tokens": 20,
                "tool_calls": 5, "turns": 6})
    s = score(facts)
    # x = 100 + 50 + 0.25 * 400 + 20 + 10 * 5 + 10 * 6 = 380
    assert s.length_x == 380
    assert s.parts == pytest.approx({"correctness": 0.0, "tests_fraction": 0.75, "style": 1.0, "communication": 1.0,
                                     "invalid_calls": 2.0, "unfinished_todos": 1.0, "repeated_calls": 1.0,
                                     "forbidden_edits": 1.0, "length": 184.255429})
    # C(380) at k = 0.01, q = 0.8: (4.8 ** 0.2 - 1) / 0.002 = 184.255429
    # 0 + 0 * 0.75 - 0.02 * 1 + 0.1 * 1 - 0.02 * 2 - 0.02 * 1 - 0.01 * 1 - 0.5 * 1 - 0.0003 * 184.255429
    assert s.total == pytest.approx(-0.02 + 0.1 - 0.04 - 0.02 - 0.01 - 0.5 - 0.0552766287)


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
    out = override_weights(DEFAULT_WEIGHTS, ["style=-0.5", " length = 0"])
    assert out["weights"]["style"] == -0.5 and out["weights"]["length"] == 0.0
    assert DEFAULT_WEIGHTS["weights"]["style"] == -0.02  # the defaults are not modified
    for bad, message in (("style", "expected NAME=NUMBER"), ("style=x", "expected NAME=NUMBER"),
                         ("styel=1", "unknown part")):
        with pytest.raises(ValueError, match=message):
            override_weights(DEFAULT_WEIGHTS, [bad])
