"""The generated agentic task family (megatron_ext/env/agent_tasks.py, tools/make_agent_tasks.py): determinism,
a split by program shape that never leaks a held-out program into training, valid task files, and grading of a
task of each kind through the real episode loop and sandbox: the oracle scores 1 without forbidden edits, doing
nothing and a wrong edit score 0 (the hidden tests fail on the untouched repository and pass with the reference)."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from megatron_ext.env import agent_tasks
from megatron_ext.env.agent_tasks import KINDS, PRIMITIVES, generate, is_heldout, shape_hash
from megatron_ext.env.agents import ScriptAgent, load_actions
from megatron_ext.env.episode import run_episode
from megatron_ext.env.tasks import load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make(out, *args) -> int:
    """tools/make_agent_tasks.py in this process (a fresh interpreter spends seconds importing the package)."""
    try:
        return _tool("make_agent_tasks").main(["--out", str(out), *args])
    except SystemExit as e:  # argparse's refusal
        return e.code


def tree(folder) -> dict:
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


FAMILY = ("--seed", "3", "--train", "30", "--heldout", "3")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A small family on disk: 30 training tasks (kinds in turn) and 3 held-out ones."""
    out = tmp_path_factory.mktemp("agent_tasks")
    assert make(out, *FAMILY) == 0
    return out


def test_same_seed_writes_byte_identical_files_and_another_seed_does_not(tmp_path, family):
    assert make(tmp_path / "again", *FAMILY) == 0
    first, second = tree(family), tree(tmp_path / "again")
    assert first == second and len(first) > 33 * 5
    assert make(tmp_path / "other", "--seed", "4", "--train", "30", "--heldout", "3") == 0
    assert tree(tmp_path / "other")["train.jsonl"] != first["train.jsonl"]


def test_more_heldout_tasks_leave_the_training_tasks_unchanged():
    small, large = generate(5, 40, 2), generate(5, 40, 8)
    assert [t.record() for t in small["train"]] == [t.record() for t in large["train"]]


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1)])
def test_heldout_programs_never_appear_in_training_and_use_seen_primitives(seeds):
    train, heldout = generate(seeds[0], 300, 0)["train"], generate(seeds[1], 300, 60)["heldout"]
    train_hashes = {t.record()["metadata"]["program_hash"] for t in train}
    heldout_hashes = {t.record()["metadata"]["program_hash"] for t in heldout}
    assert len(heldout_hashes) >= 10 and not train_hashes & heldout_hashes
    train_primitives = {name for t in train for name, _ in t.program.steps}
    for t in heldout:
        meta = t.record()["metadata"]
        assert meta["program_hash"] == shape_hash(meta["program_shape"]) and is_heldout(meta["program_shape"], 0.25)
        assert len(t.program.steps) >= 2 and {n for n, _ in t.program.steps} <= train_primitives
    assert {n for t in train if len(t.program.steps) == 1 for n, _ in t.program.steps}  # single primitives train
    assert not any(is_heldout(p, 0.99) for p in PRIMITIVES)


def test_tasks_validate_against_the_schema_with_safe_unique_ids_and_grader_ids(family):
    from megatron_ext.eval.schema import validate_paths

    paths = [str(family / "train.jsonl"), str(family / "heldout.jsonl")]
    assert validate_paths(paths) == 0
    tasks = load_tasks(paths[0]) + load_tasks(paths[1])
    ids = [t.id for t in tasks]
    assert len(set(ids)) == len(ids) == 33 and all(re.fullmatch(r"[a-z0-9-]+", i) for i in ids)
    assert [t.metadata["kind"] for t in tasks[:6]] == list(KINDS) * 2
    for t in tasks:
        meta = t.metadata
        assert meta["source"] == "agent_tasks" and meta["program"] and t.forbidden
        hidden = sorted(os.listdir(os.path.join(t.hidden_tests, "tests_hidden")))
        assert len(hidden) == 1 and all(i.startswith(("tests/", f"tests_hidden/{hidden[0]}::"))
                                        for i in meta["fail_to_pass"] + meta["pass_to_pass"])
        with open(os.path.join(t.hidden_tests, "tests_hidden", hidden[0])) as f:
            names = re.findall(r"^def (test_\w+)", f.read(), re.M)
        assert {i.split("::")[1] for i in meta["fail_to_pass"] if i.startswith("tests_hidden/")} == set(names)
        assert load_actions(str(family / "oracle" / f"{t.id}.json"))


def test_tasks_stay_small_enough_for_a_tiny_model():
    family = generate(0, 120, 30)
    for t in family["train"] + family["heldout"]:
        assert len(t.instruction) <= 200, t.instruction
        assert all(text.count("\n") <= 15 for text in {**t.files, **t.hidden}.values()), t.id
        names = [a["name"] for a in t.oracle]
        assert len(names) <= 5 and names[-3:] == ["edit_file", "run_command", "finish"]
        assert names[0] == ("list_dir" if t.kind == "submodule" else "read_file")
        if t.kind == "submodule":  # the instruction names the package only: the agent must look for the file
            assert t.oracle[1]["arguments"]["path"] not in t.instruction


def test_every_kind_tells_the_reference_from_the_repository_and_from_wrong_answers():
    """In process: the hidden and visible assertions hold for the reference file and fail on the written repo."""
    for t in generate(1, 30, 9)["train"]:
        (path, reference), = t.reference.items()
        fn = t.record()["metadata"]["fail_to_pass"][0].split("::test_")[1]
        cases = re.findall(rf"assert ({fn}\(.*\) == .*)$", "".join(t.hidden.values()) + t.files[
            next(p for p in t.files if p.startswith("tests/"))], re.M)
        assert len(cases) == 4
        for source, holds in ((reference, True), (t.files[path], False)):
            namespace: dict = {}
            exec(source, namespace)
            outcomes = []
            for case in cases:
                try:
                    outcomes.append(eval(case, namespace))
                except Exception:
                    outcomes.append(False)
            assert all(outcomes) if holds else not any(outcomes), (t.id, source)


# ---- grading through the real episode loop ---------------------------------------------------------------------
def _episode(family, task_id: str, actions: list):
    task = next(t for t in load_tasks(str(family / ("heldout.jsonl" if task_id.startswith("heldout") else
                                                    "train.jsonl"))) if t.id == task_id)
    return task, run_episode(task, ScriptAgent(actions))


def _wrong(task, oracle: list) -> list:
    """The oracle with a wrong edit: the implementation returns its input, the fix returns None."""
    actions = json.loads(json.dumps(oracle))
    edit = next(a for a in actions if a["name"] == "edit_file")["arguments"]
    fn = task.metadata["fail_to_pass"][0].split("::test_")[1]
    with open(os.path.join(task.repo, edit["path"])) as f:
        arg = re.search(rf"^def {fn}\((\w+)\)", f.read(), re.M)
    edit["new_text"] = "    return None\n" if task.metadata["kind"] == "bugfix" else f"    return {arg.group(1)}\n"
    return actions


@pytest.mark.parametrize("task_id", ["train-0000-implement", "train-0001-bugfix", "train-0002-submodule",
                                     pytest.param("heldout-0001-bugfix", marks=pytest.mark.slow)])
def test_oracle_scores_one_doing_nothing_and_a_wrong_edit_score_zero(family, task_id):
    oracle = load_actions(str(family / "oracle" / f"{task_id}.json"))
    task, good = _episode(family, task_id, oracle)
    f2p, p2p = task.metadata["fail_to_pass"], task.metadata["pass_to_pass"]
    assert good.status == "finished" and good.counts["turns"] == len(oracle) <= 5
    assert good.reward["correctness"] == 1.0 and good.reward["tests_fraction"] == 1.0
    assert good.reward["communication"] == 1.0 and good.reward["forbidden_edits"] == 0.0
    assert good.grading["mode"] == "pytest ids" and sorted(good.grading["passed"]) == sorted(f2p + p2p)
    assert good.grading["forbidden_edits"] == [] and good.grading["changed_files"] == [oracle[-3]["arguments"]
                                                                                       ["path"]]
    assert all(c.valid for c in good.calls) and "passed" in good.calls[-2].observation

    _, idle = _episode(family, task_id, [])  # finish at once: the hidden tests fail on the untouched repo
    assert idle.reward["correctness"] == 0.0 and idle.reward["tests_fraction"] == 0.0 and idle.reward["total"] <= 0
    assert sorted(idle.grading["failed"]) == sorted(f2p) and idle.grading["passed"] == p2p

    _, wrong = _episode(family, task_id, _wrong(task, oracle))
    # the tests it left passing passed before it: no partial credit for an edit that fixes nothing (it was
    # p2p / (f2p + p2p), which any change collected)
    assert wrong.reward["correctness"] == 0.0 and wrong.reward["tests_fraction"] == 0.0 and p2p
    assert sorted(wrong.grading["failed"]) == sorted(f2p) and wrong.grading["forbidden_edits"] == []
    assert wrong.reward["communication"] == 0.0  # it claims passing tests its own last test run failed
    assert wrong.reward["total"] < good.reward["total"]


@pytest.mark.slow  # three episodes through the harness: ~10 s on an idle 2-core machine, 40 s when loaded
def test_run_eval_replays_the_oracle_directory(family, tmp_path):
    run = tmp_path / "eval"
    assert _tool("run_eval").main(["--tasks", str(family / "heldout.jsonl"), "--agent",
                                   f"script:{family / 'oracle'}", "--out", str(run)]) == 0
    with open(run / "summary.json") as f:
        summary = json.load(f)
    assert summary["episodes"] == 3 and summary["accuracy"] == 1.0


@pytest.mark.parametrize("args,message", [
    (["--max-depth", "0"], "--max-depth must lie in 1..4"),
    (["--max-depth", "1", "--heldout", "2"], "--heldout > 0 needs --max-depth >= 2"),
    (["--heldout-fraction", "1.5"], "--heldout-fraction must lie strictly between 0 and 1"),
    (["--kinds", "refactor"], "invalid choice: 'refactor'"),
])
def test_bad_flags_are_refused_by_name(tmp_path, capsys, args, message):
    assert make(tmp_path / "x", "--train", "3", "--heldout", "0", *args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_kinds_flag_chooses_the_kinds(tmp_path):
    assert make(tmp_path / "sub", "--train", "4", "--heldout", "0", "--kinds", "submodule") == 0
    tasks = load_tasks(str(tmp_path / "sub" / "train.jsonl"))
    assert [t.metadata["kind"] for t in tasks] == ["submodule"] * 4
    assert all(t.metadata["program_shape"].count("|") <= 2 for t in tasks)
    shallow = generate(0, 20, 0, max_depth=1)["train"]
    assert all(len(t.program.steps) == 1 for t in shallow)


def test_unwritable_out_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert make(tmp_path / "file" / "below", "--train", "3", "--heldout", "0") == 2
    assert "--out" in capsys.readouterr().err


def test_generation_errors_name_the_cause():
    with pytest.raises(agent_tasks.AgentTaskError, match="kinds must be among"):
        generate(0, 3, 0, kinds=("refactor",))


def test_paths_in_instructions_tokenise_as_in_a_tool_call():
    """Paths (and the package) stand in backticks: a byte-level BPE then cuts them into the tokens a tool call's
    JSON string holds, so the agent copies tokens instead of mapping ' pkg' to 'pkg'."""
    family = generate(2, 30, 0)["train"]
    for t in family:
        path = next(iter(t.reference))
        if t.kind == "submodule":
            assert f"package `{path.split('/')[0]}`" in t.instruction, t.instruction
        else:
            assert f"`{path}`" in t.instruction and f" {path}" not in t.instruction, t.instruction


def test_corpus_holds_training_programs_only_and_what_an_agent_copies(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    assert make(tmp_path / "f", "--seed", "3", "--train", "6", "--heldout", "0", "--corpus", str(corpus),
                "--corpus-tasks", "300") == 0
    lines = corpus.read_text().splitlines()
    assert len(lines) == 300
    tasks = agent_tasks.generate_corpus(3, 300)
    assert [json.loads(line)["text"] for line in lines] == [agent_tasks.corpus_document(t) for t in tasks]
    assert not any(is_heldout(t.program.shape, 0.25) for t in tasks)
    assert len({t.program.shape for t in tasks}) > 100
    # its own stream: not the family's training tasks of the same seed
    family = generate(3, 6, 0)["train"]
    assert not {t.instruction for t in family} & {t.instruction for t in tasks}
    for t in tasks[:30]:
        doc = agent_tasks.corpus_document(t)
        path, fixed = next(iter(t.reference.items()))
        assert doc.startswith(t.instruction + "\nfiles:\n") and all(p in doc for p in t.files)
        assert f"`{path}`:\n{t.files[path]}" in doc
        assert (f"`{path}`, fixed:\n{fixed}" in doc) == (t.files[path] != fixed)
        assert fixed in doc  # the solution: the stub's replacement, or the bug's fix
    again = tmp_path / "again.jsonl"
    assert make(tmp_path / "g", "--seed", "3", "--train", "6", "--heldout", "0", "--corpus", str(again),
                "--corpus-tasks", "300") == 0
    assert again.read_bytes() == corpus.read_bytes()


@pytest.mark.parametrize("args", [["--corpus", "c.jsonl"], ["--corpus-tasks", "5"]])
def test_corpus_flags_go_together(tmp_path, capsys, args):
    assert make(tmp_path / "x", "--train", "3", "--heldout", "0", *args) == 2
    assert "--corpus and --corpus-tasks go together" in capsys.readouterr().err



def _rename_task(src, dst, task_id, mapping):
    """Task `task_id` of the family at `src`, appended to the family at `dst`, with every name of `mapping`
    substituted in its record, files, file paths and oracle script: the same task generated under other names."""
    from megatron_ext.env.agent_tasks import substitute_names

    record = next(line for line in open(os.path.join(src, "train.jsonl")) if json.loads(line)["id"] == task_id)
    with open(os.path.join(dst, "train.jsonl"), "a") as f:
        f.write(substitute_names(record.strip(), mapping) + "\n")
    for rel, data in tree(os.path.join(src, "tasks", task_id)).items():
        path = os.path.join(dst, "tasks", task_id, substitute_names(rel, mapping))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(substitute_names(data.decode(), mapping))
    os.makedirs(os.path.join(dst, "oracle"), exist_ok=True)
    with open(os.path.join(dst, "oracle", f"{task_id}.json"), "w") as f:
        f.write(substitute_names(open(os.path.join(src, "oracle", f"{task_id}.json")).read(), mapping))


def test_renamed_sft_conversations_are_what_the_sandbox_shows_under_the_new_names(family, tmp_path):
    """agentic_learning --sft-renamed-copies: a conversation renamed by `rename_identifiers` equals the oracle
    episode played in the sandbox on the same task generated under the new names (test timings aside), for each
    kind; every generated name changes, to another of the generator's pools."""
    import random

    from megatron_ext.env.agent_tasks import MODULE_HEADS, MODULE_TAILS, PACKAGES, SUBPACKAGES, rename_identifiers

    sft = _tool("build_agent_sft")
    ids = [f"train-000{i}-{kind}" for i, kind in enumerate(KINDS)]
    original, suite = tmp_path / "original.jsonl", tmp_path / "suite.jsonl"
    suite.write_text("".join(line for line in open(family / "train.jsonl") if json.loads(line)["id"] in ids))
    os.symlink(family / "tasks", tmp_path / "tasks")  # the records' repo paths are relative to the suite
    assert sft.main(["--tasks", str(suite), "--oracle", str(family / "oracle"), "--output", str(original),
                     "--env-sandbox-dir", str(tmp_path)]) == 0
    conversations = {r["id"]: r for r in map(json.loads, open(original))}
    assert sorted(conversations) == sorted(ids)
    modules = {h + t for h in MODULE_HEADS for t in MODULE_TAILS}
    functions = re.compile(r"[a-z]+_[a-z]+")
    renamed_dir, renamed, rng = tmp_path / "renamed", {}, random.Random(5)
    renamed_dir.mkdir()
    for task_id in ids:
        renamed[task_id], mapping = rename_identifiers(conversations[task_id], rng)
        kind = task_id.rsplit("-", 1)[1]
        new = set(mapping.values())
        assert len(new) == len(mapping) and all(n != old for old, n in mapping.items())
        # the module, the target and helper functions; the submodule kind's package and subpackage too
        assert len(mapping) in ((5,) if kind == "submodule" else (3, 4))  # 4: the module in a package
        assert len([n for n in new if functions.fullmatch(n)]) == 2
        assert all(functions.fullmatch(n) or n in modules | set(PACKAGES) | set(SUBPACKAGES) for n in new)
        if kind == "submodule":
            assert len(new & set(SUBPACKAGES)) == 1
        text = json.dumps(renamed[task_id]["messages"])
        assert not [old for old in mapping if re.search(rf"(?<![A-Za-z0-9]){old}(?![A-Za-z0-9])", text)]
        _rename_task(str(family), str(renamed_dir), task_id, mapping)
    played = tmp_path / "played.jsonl"
    assert sft.main(["--tasks", str(renamed_dir / "train.jsonl"), "--oracle", str(renamed_dir / "oracle"),
                     "--output", str(played), "--env-sandbox-dir", str(tmp_path)]) == 0
    timing = lambda r: re.sub(r" in \d+\.\d+s", " in Ts", json.dumps(r["messages"]))  # noqa: E731
    records = list(map(json.loads, open(played)))
    assert sorted(r["id"] for r in records) == sorted(ids)
    for record in records:
        assert timing(record) == timing(renamed[record["id"]])
