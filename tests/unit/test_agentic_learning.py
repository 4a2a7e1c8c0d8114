"""The agentic-learning benchmark's pipeline end to end at smoke size (benchmarks/agentic_learning.py --smoke):
generated tasks -> oracle SFT data -> tokenizer -> code pretraining -> SFT -> GRPO in the sandboxed coding
environment -> run_eval on held-out tasks for both checkpoints -> compare -> summary and figure. It checks the
pipeline's content, not that the model learns (that is the full benchmark's job, docs/benchmarks.md); and the
helpers that make a re-run resume."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_agentic_learning_smoke(tmp_path):
    out = tmp_path / "agentic"
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-W", "ignore", "benchmarks/agentic_learning.py", "--out", str(out),
                           "--smoke", "--temperature", "0.9", "--rl-temperature", "1.1", "--env-reward-weight",
                           "tests_fraction=0.5", "--sft-recovery", "--sft-renamed-copies", "2", "--rl-iters", "1",
                           "--eval-rl-split", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    settings = summary["settings"]

    # SFT data: one conversation per kept oracle episode, each with tool calls ending in finish
    conversations = [json.loads(line) for line in (out / "sft.jsonl").read_text().splitlines()]
    assert len(conversations) == settings["sft_tasks"]
    for c in conversations:
        calls = [t["function"]["name"] for m in c["messages"] if m["role"] == "assistant"
                 for t in m.get("tool_calls") or []]
        assert calls[-1] == "finish" and "edit_file" in calls
    # --sft-recovery: each SFT task's oracle also played with a wrong first edit (untrained) and its fix; renamed
    # copies are made of both kinds
    recovery = [json.loads(line) for line in (out / "sft_recovery.jsonl").read_text().splitlines()]
    assert len(recovery) >= len(conversations) // 2
    for c in recovery:
        untrained = [m for m in c["messages"] if m.get("train") is False]
        assert c["id"].endswith("-recovery") and len(untrained) == 1
        assert untrained[0]["tool_calls"][0]["function"]["name"] == "edit_file"
    both = [json.loads(line) for line in (out / "sft_with_recovery.jsonl").read_text().splitlines()]
    assert both == conversations + recovery
    renamed = [json.loads(line)["id"] for line in (out / "sft_renamed_x2.jsonl").read_text().splitlines()]
    assert sorted(renamed) == sorted(f"{c['id']}-renamed-{k}" for c in both for k in range(2))

    # RL: every RL task trained once, G episodes each, the environment's reward parts logged per step; the sampling
    # temperature (--rl-temperature; the evaluation keeps --temperature) and reward weights asked for reach the RL run
    rl_log = (out / "logs" / "rl.log").read_text()
    assert re.search(r"rl_temperature \.+ 1\.1\n", rl_log) and "['tests_fraction=0.5']" in rl_log
    assert settings["temperature"] == 0.9 and settings["rl_temperature"] == 1.1
    for name in ("sft", "rl"):
        assert json.loads((out / "eval" / name / "run.json").read_text())["sampling"]["temperature"] == 0.9
    groups = [json.loads(line) for line in (out / "rl_logs" / "trained_groups.jsonl").read_text().splitlines()]
    rl_ids = [json.loads(line)["id"] for line in (out / "tasks" / "rl.jsonl").read_text().splitlines()]
    # one step (--rl-iters 1): its prompts are RL tasks, each once; the split's other tasks stay untrained
    trained = {g["prompt_id"] for g in groups}
    assert len(groups) == len(trained) == settings["prompts_per_step"] < len(rl_ids) and trained <= set(rl_ids)
    assert all(len(g["rewards"]) == settings["group_size"] for g in groups)
    assert summary["rl_curve"] and {"correctness", "invalid_calls"} <= set(summary["rl_curve"][0])

    # held-out evaluation of both checkpoints: every task x pass ran, as graded episodes with a report
    heldout = [json.loads(line)["id"] for line in (out / "tasks" / "heldout.jsonl").read_text().splitlines()]
    for name in ("sft", "rl"):
        m = summary["heldout"][name]
        assert m["episodes"] == len(heldout) * settings["passes"] and m["tasks"] == len(heldout)
        assert 0.0 <= m["success"] <= 1.0 and m["forbidden_edits"] == 0
        records = [json.loads(line) for line in (out / "eval" / name / "episodes.jsonl").read_text().splitlines()]
        assert {r["task"] for r in records} == set(heldout)
        assert all("correctness" in r["reward"] for r in records)
        # success split by the program's depth and the task's kind: every episode counted once on each axis
        for axis in ("depth", "kind"):
            cells = m["solved_by"][axis]
            assert sum(c["episodes"] for c in cells.values()) == m["episodes"] and "?" not in cells, cells
            assert sum(c["solved"] for c in cells.values()) == sum(r["reward"]["correctness"] >= 1 for r in records)
    assert set(summary["heldout"]["sft"]["solved_by"]["depth"]) <= {"2", "3"}  # one primitive always trains
    rl_depths = summary["rl_solved_by"]["depth"]
    assert sum(c["episodes"] for c in rl_depths.values()) == len(groups) * settings["group_size"]
    # --eval-rl-split 1: both checkpoints on RL's own split, paired over its trained and its untrained tasks
    for name in ("sft", "rl"):
        records = [json.loads(line) for line in
                   (out / "eval" / f"{name}_rl_split" / "episodes.jsonl").read_text().splitlines()]
        assert sorted(r["task"] for r in records) == sorted(rl_ids)
    split = summary["rl_split"]
    assert split["trained"]["tasks"] == len(trained) and split["untrained"]["tasks"] == len(rl_ids) - len(trained)
    assert all(0.0 <= split[part][k] <= 1.0 for part in ("trained", "untrained") for k in ("sft", "rl", "p"))
    assert re.search(rf"RL's own task split, 1 pass a task, SFT -> RL: trained on {len(trained)} tasks "
                     rf"[0-9.]+ -> [0-9.]+, p = ", done.stdout)
    pair = summary["compare"]["against_baseline"]["rl"]
    assert pair["shared_tasks"] == len(heldout) and 0.0 <= pair["p"] <= 1.0
    # the checkpoints carry the agent-prompt option they were trained with
    from megatron_ext.training.checkpointing import checkpoint_args

    for name in ("sft", "rl"):
        _, recorded = checkpoint_args(str(out / "ckpt" / name), "test")
        assert recorded.get("env_tool_declarations") == "compact", recorded.keys()
    assert os.path.getsize(out / "agentic_learning.png") > 10_000
    assert set(summary["wall_s"]) >= {"tasks", "sft_data", "sft_recovery", "sft_renamed", "tokenizer",
                                      "pretrain_data", "pretrain", "sft", "rl",
                                      "eval_sft", "eval_rl", "heldout_oracle", "turns_sft", "turns_rl",
                                      "eval_sft_rl_split", "eval_rl_rl_split"}
    # teacher-forced turns on the held-out oracle conversations: every oracle tool scored for both checkpoints
    for name in ("sft", "rl"):
        turns = summary["heldout"][name]["teacher_forced"]
        assert {"read_file", "edit_file", "run_command", "finish"} <= set(turns), turns
        assert turns["read_file"]["turns"] == len(heldout)
        assert all(0.0 <= r["exact_rate"] <= 1.0 and 0.0 <= r["token_accuracy"] <= 1.0 for r in turns.values())
    # code pretraining: the corpus's documents, the checkpoint SFT started from at its own context
    corpus = (out / "tasks" / "corpus.jsonl").read_text().splitlines()
    assert len(corpus) == settings["corpus_tasks"] and all(json.loads(line)["text"] for line in corpus)
    _, pretrained = checkpoint_args(str(out / "ckpt" / "pretrain"), "test")
    assert pretrained["seq_length"] == settings["pretrain_seq_length"] != settings["seq_length"]
    assert f"loaded {out / 'ckpt' / 'pretrain'}" in (out / "logs" / "sft.log").read_text()
    # pretraining and SFT save along the way (about ten times), so that a kill loses a tenth of the phase, not all
    assert (out / "ckpt" / "pretrain" / "iter_0000001").is_dir() and (out / "ckpt" / "sft" / "iter_0000002").is_dir()

    # --rl-prompts twice: RL on tasks generated with two other seeds, merged in order; the same command re-run
    # reuses every phase before RL, sets the first RL aside and trains on the merged file, whose trained and
    # untrained parts --eval-rl-split scores; --eval-heldout: both checkpoints on another seed's held-out tasks too
    other, second = tmp_path / "other", tmp_path / "second"
    for folder, seed, train in ((other, "5", "6"), (second, "6", "3")):
        subprocess.run([sys.executable, "tools/make_agent_tasks.py", "--out", str(folder), "--seed", seed, "--train",
                        train, "--heldout", "1"], cwd=ROOT, env=env, check=True, capture_output=True)
    again = subprocess.run(done.args + ["--rl-prompts", str(other / "train.jsonl"), "--rl-prompts",
                                        str(second / "train.jsonl"), "--eval-heldout", str(second / "heldout.jsonl"),
                                        "--eval-heldout-passes", "1"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[sft] done before" in again.stdout and "[eval_sft] done before" in again.stdout
    assert (out / "ckpt" / "rl.stale-1").is_dir() and (out / "rl_logs.stale-1").is_dir()
    other_ids = [f"f{i}-" + json.loads(line)["id"] for i, folder in enumerate((other, second), 1)
                 for line in (folder / "train.jsonl").read_text().splitlines()]
    merged = [json.loads(line) for line in (out / "rl_prompts.jsonl").read_text().splitlines()]
    assert [t["id"] for t in merged] == other_ids and all(os.path.isdir(t["repo"]) for t in merged)
    sets = json.loads((out / "summary.json").read_text())["heldout_sets"]
    assert [r["rl"]["tasks"] for r in sets] == [settings["heldout"], 1, settings["heldout"] + 1]
    assert sets[-1]["set"] == "all sets" and 0.0 <= sets[-1]["rl"]["p"] <= 1.0
    second_heldout = json.loads((second / "heldout.jsonl").read_text())["id"]
    for name in ("sft", "rl"):
        records = [json.loads(line) for line in
                   (out / "eval" / f"{name}_heldout_1" / "episodes.jsonl").read_text().splitlines()]
        assert [r["task"] for r in records] == [second_heldout]
    groups = [json.loads(line) for line in (out / "rl_logs" / "trained_groups.jsonl").read_text().splitlines()]
    assert {g["prompt_id"] for g in groups} <= set(other_ids) and len(groups) == settings["prompts_per_step"]
    split = json.loads((out / "summary.json").read_text())["rl_split"]
    assert (split["trained"]["tasks"], split["untrained"]["tasks"]) == (len(groups), len(other_ids) - len(groups))
    records = [json.loads(line) for line in (out / "eval" / "rl_rl_split" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in records) == sorted(other_ids)


def _benchmark():
    from tests.unit.data_fixtures import load_tool

    return load_tool("agentic_learning", "benchmarks")


def test_smoke_sizes_are_defaults_that_flags_given_still_override(tmp_path):
    bench = _benchmark()
    smoke = bench.parse_args(["--out", str(tmp_path), "--smoke"])
    assert (smoke.eval_max_tokens, smoke.sft_tasks, smoke.ranks) == (48, 12, 1)
    assert smoke.plot == os.path.join(str(tmp_path), "agentic_learning.png")
    given = bench.parse_args(["--out", str(tmp_path), "--smoke", "--eval-max-tokens", "64", "--sft-tasks", "7",
                              "--plot", str(tmp_path / "p.png")])
    assert (given.eval_max_tokens, given.sft_tasks, given.ranks) == (64, 7, 1) and given.plot.endswith("p.png")
    full = bench.parse_args(["--out", str(tmp_path)])
    assert (full.eval_max_tokens, full.sft_tasks, full.ranks) == (160, 400, 2)
    assert full.plot.endswith(os.path.join("docs", "agentic_learning.png"))


def test_solved_by_counts_each_episode_once_per_axis(tmp_path):
    bench = _benchmark()
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in [
        {"id": "a", "metadata": {"program_shape": "upper | reverse", "kind": "bugfix"}},
        {"id": "b", "metadata": {"program_shape": "min | mod | add", "kind": "implement"}},
        {"id": "c", "metadata": {}}]) + "\n")
    groups = bench.task_groups(str(tasks))
    assert groups == {"a": (2, "bugfix"), "b": (3, "implement"), "c": ("?", "?")}
    cells = bench.solved_by([("a", True), ("a", False), ("b", False), ("c", True)], groups)
    assert cells["depth"] == {"2": {"episodes": 2, "solved": 1}, "3": {"episodes": 1, "solved": 0},
                              "?": {"episodes": 1, "solved": 1}}
    assert cells["kind"]["bugfix"] == {"episodes": 2, "solved": 1} and bench.solved_line(cells["kind"]) == \
        "? 1/1, bugfix 1/2, implement 0/1"


def test_rl_split_effect_pairs_tasks_and_keeps_trained_apart_from_untrained(tmp_path):
    bench = _benchmark()

    def run(name, per_task):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"per_task": {t: {
            "correct": c, "passes": len(c), "accuracy": sum(c) / len(c), "efficiency": {}}
            for t, c in per_task.items()}}))  # the fields run_eval's summary gives each task
        return str(tmp_path / name)

    # RL solved its 20 trained tasks where SFT solved none; on the unseen ones it lost a little
    trained = {f"t{i}" for i in range(20)}
    sft = run("sft", {**{t: [0, 0] for t in trained}, "u0": [1, 1], "u1": [1, 0], "gone": [1, 1]})
    rl = run("rl", {**{t: [1, 1] for t in trained}, "u0": [1, 0], "u1": [1, 0], "new": [0, 0]})
    split = bench.rl_split_effect(sft, rl, trained | {"absent"})
    assert split["trained"]["tasks"] == 20 and (split["trained"]["sft"], split["trained"]["rl"]) == (0.0, 1.0)
    assert split["trained"]["p"] < 0.001  # 20 tasks all up: Monte Carlo over sign flips
    # only tasks both runs hold are paired ("gone", "new" are not); an untrained task RL never saw counts there
    assert split["untrained"]["tasks"] == 2 and split["untrained"]["sft"] == 0.75 and split["untrained"]["rl"] == 0.5
    assert split["untrained"]["p"] == 1.0  # one difference of -0.5: both sign patterns reach it
    none = bench.rl_split_effect(sft, rl, trained | {"u0", "u1"})
    assert none["untrained"] == {"tasks": 0}


def test_rl_prompts_with_a_held_out_program_shape_are_refused(tmp_path):
    from megatron_ext.env.agent_tasks import is_heldout

    bench = _benchmark()
    task = lambda i, shape: json.dumps({"id": f"t{i}", "metadata": {"program_shape": shape}})  # noqa: E731
    shapes = [f"{a} | {b}" for a in ("upper", "lower", "strip", "sum", "min", "head") for b in ("reverse", "sort",
                                                                                                  "add", "max")]
    kept = [shape for shape in shapes if not is_heldout(shape)]
    by_rule = next(shape for shape in shapes if is_heldout(shape))
    heldout, rl = tmp_path / "heldout.jsonl", tmp_path / "rl.jsonl"
    heldout.write_text(task(0, kept[0]) + "\n")  # a held-out file may hold any shape: its shapes are refused
    rl.write_text(task(1, kept[1]) + "\n" + task(2, "sum") + "\n")
    bench.no_heldout_shapes(str(rl), str(heldout))  # no shape in common, none held out by the rule: accepted
    rl.write_text(rl.read_text() + task(3, kept[0]) + "\n")
    with pytest.raises(SystemExit, match=r"1 task\(s\) have a held-out program shape \(t3\)"):
        bench.no_heldout_shapes(str(rl), str(heldout))
    # a shape the split rule holds out, though this seed's held-out file has no task of it (another seed's may)
    rl.write_text(task(1, kept[1]) + "\n" + task(5, by_rule) + "\n")
    with pytest.raises(SystemExit, match=r"1 task\(s\) have a held-out program shape \(t5\)"):
        bench.no_heldout_shapes(str(rl), str(heldout))
    # a task whose shape is unknown (metadata stripped) cannot be checked: refused too
    rl.write_text(task(1, kept[1]) + "\n" + json.dumps({"id": "t4", "metadata": {}}) + "\n")
    with pytest.raises(SystemExit, match=r"1 task\(s\) name no program shape in their metadata \(t4\)"):
        bench.no_heldout_shapes(str(rl), str(heldout))


def test_several_rl_prompts_files_merge_in_order_with_unique_ids_and_absolute_paths(tmp_path):
    """Generator seeds reuse task ids and each file's paths are relative to its folder: the merged file prefixes
    ids by file and makes paths absolute, keeps the order (RL takes tasks in file order), passes the held-out
    check and is left untouched (its date too) when a re-run merges the same files."""
    from megatron_ext.env.tasks import load_tasks
    from tests.unit.data_fixtures import load_tool

    bench = _benchmark()
    make = load_tool("make_agent_tasks").main
    for seed in (3, 4):
        assert make(["--out", str(tmp_path / f"s{seed}"), "--seed", str(seed), "--train", "5", "--heldout", "1"]) in (
            0, None)
    files = [str(tmp_path / f"s{seed}" / "train.jsonl") for seed in (3, 4)]
    assert {t.id for t in load_tasks(files[0])} & {t.id for t in load_tasks(files[1])}  # ids clash as generated
    path = bench.merge_rl_prompts(files, str(tmp_path / "out" / "rl_prompts.jsonl"))
    merged = load_tasks(path)  # unique ids, or it raises
    originals = [t for f in files for t in load_tasks(f)]
    assert [t.id for t in merged] == [f"f{1 + (i >= 5)}-{t.id}" for i, t in enumerate(originals)]
    assert [(t.repo, t.instruction, t.metadata) for t in merged] == [(t.repo, t.instruction, t.metadata)
                                                                      for t in originals]
    assert all(os.path.isabs(t.repo) and os.path.isdir(t.repo) for t in merged)
    bench.no_heldout_shapes(path, str(tmp_path / "s3" / "heldout.jsonl"))
    os.utime(path, (1000, 1000))
    assert bench.merge_rl_prompts(files, path) == path and os.path.getmtime(path) == 1000
    assert bench.merge_rl_prompts(files[::-1], path) == path and os.path.getmtime(path) > 1000  # other order
    assert load_tasks(path)[0].id == "f1-" + load_tasks(files[1])[0].id
    with pytest.raises(SystemExit, match="--rl-prompts"):
        bench.merge_rl_prompts([str(tmp_path / "s3" / "heldout.jsonl"), str(tmp_path / "absent.jsonl")], path)


def test_eval_heldout_sets_must_be_held_out_and_are_pooled_per_task(tmp_path, capsys):
    from tests.unit.data_fixtures import load_tool

    bench = _benchmark()
    assert load_tool("make_agent_tasks").main(["--out", str(tmp_path / "s8"), "--seed", "8", "--train", "4",
                                               "--heldout", "3"]) in (0, None)
    bench.only_heldout_shapes(str(tmp_path / "s8" / "heldout.jsonl"))
    with pytest.raises(SystemExit, match=r"4 task\(s\) have no held-out program shape"):
        bench.only_heldout_shapes(str(tmp_path / "s8" / "train.jsonl"))
    for flag in ("--eval-heldout", "--rl-prompts"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--out", str(tmp_path), flag, str(tmp_path / "absent.jsonl")])
        assert f"{flag} {tmp_path / 'absent.jsonl'}: no such file" in capsys.readouterr().err

    def run(name, per_task):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps({"per_task": {
            t: {"correct": c} for t, c in per_task.items()}}))
        return str(tmp_path / name)

    # two sets with the same task names (other seeds) and different pass counts: pooled per task, not per pass
    own = (run("sft", {"a": [0, 0, 0, 0], "b": [1, 1, 1, 1]}), run("rl", {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1]}))
    extra = (run("sft2", {"a": [0, 0], "c": [1, 0]}), run("rl2", {"a": [1, 1], "c": [1, 1]}))
    rows = bench.heldout_sets_effect([("own", *own), ("extra", *extra)])
    assert [r["set"] for r in rows] == ["own", "extra", "all sets"]
    assert (rows[0]["sft"]["mean"], rows[0]["rl"]["mean"]) == (0.5, 0.75)
    assert (rows[1]["sft"]["mean"], rows[1]["rl"]["mean"]) == (0.25, 1.0)
    pooled = rows[2]
    assert pooled["rl"]["tasks"] == 4 and pooled["sft"]["mean"] == (0 + 1 + 0 + 0.5) / 4
    assert pooled["rl"]["mean"] == (0.5 + 1 + 1 + 1) / 4 and pooled["rl"]["pass_at_k"] == 1.0
    assert pooled["sft"]["pass_at_k"] == 0.5 and pooled["sft"]["p"] is None and 0 < pooled["rl"]["p"] <= 1
    table = bench.markdown({}, {"against_baseline": {"rl": {"shared_tasks": 2, "accuracy_a": 0.5, "accuracy_b": 0.75,
                                                             "p": 0.5, "test": "t"}}}, [], {}, 4,
                           {"depth": {}, "kind": {}}, heldout_sets=rows)
    assert "| all sets | 4 | 0.375 [" in table and "| 0.375 -> 0.875" not in table and "0.500 -> 1.000 |" in table


def test_a_phase_run_again_appends_to_its_log_and_a_failure_quotes_only_its_own_run(tmp_path):
    bench = _benchmark()
    log = str(tmp_path / "rl.log")
    bench.run([sys.executable, "-c", "print('first run, steps 1-5')"], log)
    with pytest.raises(SystemExit) as failed:
        bench.run([sys.executable, "-c", "import sys; print('second run'); sys.exit(3)"], log)
    text = open(log).read()
    assert "first run, steps 1-5" in text and "second run" in text  # the resumed phase kept the first part
    assert text.count("===== ") == 2 and text.index("first run") < text.index("second run")
    assert "failed (3)" in str(failed.value) and "second run" in str(failed.value)
    assert "first run" not in str(failed.value)


def _fake_save(root, iteration):
    os.makedirs(os.path.join(root, f"iter_{iteration:07d}"), exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def test_phase_resumes_its_own_save_instead_of_a_refused_fresh_start(tmp_path):
    """A phase stopped after a save (SIGTERM saves) and the command re-run: the phase loads its own --save, which
    pretrain_composer accepts; a fresh start (or the upstream --load --finetune) into it is refused."""
    import argparse

    import pytest

    from megatron_ext.training.checkpointing import CheckpointError, check_save_target

    bench = _benchmark()
    ckpt, sft = str(tmp_path / "rl"), str(tmp_path / "sft")
    fresh = ["--load", sft, "--finetune"]
    assert bench.saved_iteration(ckpt) is None and bench.resume_or(ckpt, fresh) == fresh
    _fake_save(ckpt, 3)
    assert bench.saved_iteration(ckpt) == 3
    start = bench.resume_or(ckpt, fresh)
    assert start == ["--load", ckpt]
    as_args = lambda flags: argparse.Namespace(save=ckpt, load=flags[1] if flags else None,  # noqa: E731
                                               finetune="--finetune" in flags)
    check_save_target(as_args(start))  # resuming: accepted
    for refused in (fresh, []):
        with pytest.raises(CheckpointError, match="would overwrite"):
            check_save_target(as_args(refused))


def test_outputs_older_than_their_inputs_are_set_aside_not_reused(tmp_path):
    """The command re-run after an upstream phase was redone (say with more SFT steps): the RL checkpoint, its logs
    and the evaluations made from the old SFT are renamed, kept, and the phases run again."""
    bench = _benchmark()
    sft, rl, logs = tmp_path / "sft", tmp_path / "rl", tmp_path / "rl_logs"
    _fake_save(str(sft), 200)
    _fake_save(str(rl), 6)
    logs.mkdir()
    (logs / "trained_groups.jsonl").write_text("{}\n")
    tracker = lambda p: str(p / "latest_checkpointed_iteration.txt")  # noqa: E731
    os.utime(tracker(sft), (1000, 1000))
    os.utime(tracker(rl), (2000, 2000))
    assert not bench.set_aside_if_stale([str(rl), str(logs)], tracker(rl), [tracker(sft)])
    assert rl.exists() and logs.exists()
    os.utime(tracker(sft), (3000, 3000))  # SFT redone after the RL run
    assert bench.set_aside_if_stale([str(rl), str(logs), str(tmp_path / "absent")], tracker(rl), [tracker(sft)])
    assert not rl.exists() and not logs.exists()
    assert (tmp_path / "rl.stale-1" / "iter_0000006").is_dir()
    assert (tmp_path / "rl_logs.stale-1" / "trained_groups.jsonl").read_text() == "{}\n"
    _fake_save(str(rl), 6)
    os.utime(tracker(rl), (2000, 2000))
    assert bench.set_aside_if_stale([str(rl)], tracker(rl), [tracker(sft)])
    assert (tmp_path / "rl.stale-2").is_dir() and (tmp_path / "rl.stale-1").is_dir()
    # nothing written yet: nothing to set aside
    assert not bench.set_aside_if_stale([str(rl)], tracker(rl), [tracker(sft)])


def test_pretrain_extra_documents_are_shuffled_into_the_corpus(tmp_path):
    bench = _benchmark()
    code, extra = tmp_path / "corpus.jsonl", tmp_path / "copy.jsonl"
    code.write_text("".join(f'{{"text": "code {i}"}}\n' for i in range(30)))
    extra.write_text("".join(f'{{"text": "copy {i}"}}\n' for i in range(10)) + "\n")  # a blank line is dropped
    assert bench.mixed_corpus(str(code), None, str(tmp_path / "pretrain" / "corpus")) == str(code)
    path = bench.mixed_corpus(str(code), str(extra), str(tmp_path / "pretrain" / "corpus"))
    assert path == str(tmp_path / "pretrain" / "mixed.jsonl")
    mixed = open(path).read().splitlines()
    expected = code.read_text().splitlines() + [line for line in extra.read_text().splitlines() if line]
    assert sorted(mixed) == sorted(expected) and mixed != expected  # every document once, interleaved
    assert bench.mixed_corpus(str(code), str(extra), str(tmp_path / "pretrain" / "corpus")) == path
    assert open(path).read().splitlines() == mixed  # seeded: the same mix on a re-run


def test_sft_renamed_copies_are_seeded_and_rename_every_conversation(tmp_path):
    bench = _benchmark()
    talk = lambda i, module, fn: {"id": f"t{i}", "messages": [  # noqa: E731
        {"role": "user", "content": f"Fix {fn}(xs) in `{module}.py`."},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.read_file:0", "type": "function",
         "function": {"name": "read_file", "arguments": json.dumps({"path": f"{module}.py"})}}]}]}
    names = [("listbag", "tune_bits"), ("numops", "fold_text"), ("calckit", "mix_code")]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps(talk(i, m, f)) + "\n" for i, (m, f) in enumerate(names)))
    path = bench.renamed_conversations(str(sft), 4, 1, str(tmp_path / "renamed.jsonl"))
    records = [json.loads(line) for line in open(path)]
    assert sorted(r["id"] for r in records) == sorted(f"t{i}-renamed-{c}" for i in range(3) for c in range(4))
    for r in records:
        user = r["messages"][0]["content"]
        call = json.loads(r["messages"][1]["tool_calls"][0]["function"]["arguments"])
        module, fn = user.split("`")[1][:-len(".py")], user.split()[1].split("(")[0]
        assert call["path"] == f"{module}.py"  # the copy still says the same thing twice
        assert (module, fn) != names[int(r["id"][1])] and module != names[int(r["id"][1])][0]
    assert len({r["messages"][0]["content"] for r in records}) > 6  # names drawn afresh per copy
    again = bench.renamed_conversations(str(sft), 4, 1, str(tmp_path / "again.jsonl"))
    assert open(again).read() == open(path).read()  # seeded


def test_copy_drills_write_back_what_the_user_listed_and_mix_with_the_sft_data(tmp_path):
    """--sft-copy-drills N: N short conversations whose assistant turn is the user's items verbatim (paths and
    function names from the generator's pools, code lines of the given training programs, read_file's line numbers
    stripped), shuffled in with the SFT conversations, seeded; the chat renderer takes them."""
    from megatron_ext.data.sft import render_chat
    from megatron_ext.env import agent_tasks
    from tests.unit.test_agent_sft import _tokenizer

    bench = _benchmark()
    sft = tmp_path / "sft.jsonl"
    read = {"role": "tool", "tool_call_id": "functions.read_file:0",
            "content": "     1\tdef tune_bits(items):\n     2\t    items = [e for e in items if e < 8]\n"}
    sft.write_text("".join(json.dumps({"id": f"t{i}", "messages": [{"role": "user", "content": "Fix it."}, read]})
                           + "\n" for i in range(3)))
    lines = bench.code_lines([str(sft)])
    assert lines == ["def tune_bits(items):", "    items = [e for e in items if e < 8]"]
    path = bench.with_copy_drills(str(sft), 200, 1, lines, str(tmp_path / "mixed.jsonl"))
    records = [json.loads(line) for line in open(path)]
    assert sorted(r["id"] for r in records if not r["id"].startswith("drill-")) == ["t0", "t1", "t2"]
    drills = [r for r in records if r["id"].startswith("drill-")]
    assert len(drills) == 200 and records[:3] != [json.loads(line) for line in open(sft)][:3]  # shuffled in
    pools = set(agent_tasks._FUNCTIONS) | set(lines)
    kinds = set()
    for d in drills:
        user, assistant = (m["content"] for m in d["messages"])
        assert user == "Write back exactly:\n" + assistant
        for item in assistant.split("\n"):
            if item.endswith(".py"):
                *dirs, module = item.split("/")
                assert module[:-3] in agent_tasks._MODULES and len(dirs) <= 2
                assert all(x in agent_tasks.PACKAGES + agent_tasks.SUBPACKAGES for x in dirs)
                kinds.add("path")
            else:
                assert item in pools, item
                kinds.add("line" if item in lines else "function")
    assert kinds == {"path", "function", "line"}
    assert open(bench.with_copy_drills(str(sft), 200, 1, lines, str(tmp_path / "again.jsonl"))).read() == \
        open(path).read()  # seeded
    tokenizer = _tokenizer(tmp_path)
    rendered = render_chat(tokenizer, drills[0]["messages"])  # the loss falls on the written-back items
    trained = [t for t, m in zip(rendered.ids, rendered.loss_mask) if m]
    assert tokenizer.detokenize(trained).startswith(drills[0]["messages"][1]["content"])


def _pipeline(bench, out, lr, seed=1, fail=None):
    """Three phases as the benchmark chains them: tasks (its --seed), SFT (--sft-lr, reads tasks), RL (reads
    SFT); each writes a file naming the settings it was made with. Returns the phases whose body ran."""
    ran = []

    def body(name, content):
        def write():
            ran.append(name)
            with open(out / name, "w") as f:
                f.write(content)
            if name == fail:
                raise KeyboardInterrupt  # a kill during the phase: its output is there, the phase unfinished
        return write

    phases = bench.Phases(str(out))
    phases("tasks", lambda: (out / "tasks").exists(), body("tasks", f"seed {seed}"), settings={"seed": seed},
           outputs=[str(out / "tasks")])
    phases("sft", lambda: (out / "sft").exists(), body("sft", f"lr {lr}"), settings={"lr": lr}, after=["tasks"],
           outputs=[str(out / "sft")])
    phases("rl", lambda: (out / "rl").exists(), body("rl", "rl"), after=["sft"], outputs=[str(out / "rl")])
    return ran


def test_a_rerun_with_other_settings_redoes_the_phases_they_reach(tmp_path, capsys):
    """The command re-run into the same --out with another --sft-lr: SFT and the RL trained from it are set aside
    (kept) and redone, the tasks reused; another --seed redoes everything; the same command redoes nothing. A
    phase killed under changed settings and the old command re-run: its partial outputs are not taken as done,
    and what was made from the old settings' outputs still holds."""
    import pytest

    bench = _benchmark()
    out = tmp_path
    assert _pipeline(bench, out, lr=3e-3) == ["tasks", "sft", "rl"]
    assert _pipeline(bench, out, lr=3e-3) == []
    assert _pipeline(bench, out, lr=1e-3) == ["sft", "rl"]
    assert (out / "sft.stale-1").read_text() == "lr 0.003" and (out / "sft").read_text() == "lr 0.001"
    assert (out / "rl.stale-1").exists()
    said = capsys.readouterr().out
    assert "made with other settings (lr 0.003 -> 0.001)" in said and "(sft redone)" in said
    assert _pipeline(bench, out, lr=1e-3, seed=2) == ["tasks", "sft", "rl"]
    assert (out / "tasks.stale-1").read_text() == "seed 1" and (out / "sft.stale-2").read_text() == "lr 0.001"
    with pytest.raises(KeyboardInterrupt):
        _pipeline(bench, out, lr=1e-3, seed=3, fail="tasks")
    assert (out / "tasks").read_text() == "seed 3"
    # the partial seed-3 tasks are set aside and redone; SFT and RL, made from seed-2 tasks, still hold
    assert _pipeline(bench, out, lr=1e-3, seed=2) == ["tasks"]
    assert (out / "tasks").read_text() == "seed 2" and (out / "tasks.stale-3").read_text() == "seed 3"


def test_a_checkpoint_left_without_its_tracker_is_still_dated(tmp_path):
    """A kill between a save's rename and its tracker write leaves a complete iter_N/ that --load resumes from:
    the staleness check dates it by its manifest, so a checkpoint made from replaced inputs is still set aside."""
    from megatron_ext.training.checkpointing import MANIFEST, TRACKER

    bench = _benchmark()
    ckpt, data = tmp_path / "ckpt", tmp_path / "data.jsonl"
    _fake_save(str(ckpt), 4)
    (ckpt / "iter_0000004" / MANIFEST).write_text("{}")
    (ckpt / TRACKER).unlink()
    assert bench.saved_marker(str(ckpt)) == str(ckpt / "iter_0000004" / MANIFEST)
    os.utime(ckpt / "iter_0000004" / MANIFEST, (1000, 1000))
    data.write_text("new\n")
    assert bench.set_aside_if_stale([str(ckpt)], bench.saved_marker(str(ckpt)), [str(data)])
    assert (tmp_path / "ckpt.stale-1" / "iter_0000004").is_dir()
    assert bench.saved_marker(str(ckpt)) == str(ckpt / TRACKER)  # nothing saved: no date, nothing to set aside


def test_digit_benchmarks_resume_a_partial_sft_instead_of_taking_it_as_done(tmp_path):
    """benchmarks/rl_learning.py, rl_async.py and rl_speculative.py skipped their SFT warm-up whenever its tracker
    existed: a SIGTERM part way (which saves) left a half-trained SFT that the re-run took as done. Now: done only
    at its own iteration count, resumed from its own save otherwise (the tracker-less save of a kill included)."""
    from megatron_ext.training.checkpointing import MANIFEST, TRACKER
    from tests.unit.data_fixtures import load_tool

    rl_learning = load_tool("rl_learning", "benchmarks")
    ckpt = str(tmp_path / "sft")
    assert rl_learning.sft_start(ckpt, 100) == []
    _fake_save(ckpt, 30)
    assert rl_learning.sft_start(ckpt, 100) == ["--load", ckpt]
    _fake_save(ckpt, 100)
    assert rl_learning.sft_start(ckpt, 100) is None
    os.remove(os.path.join(ckpt, TRACKER))  # killed before its tracker write: only the complete iter_N/ counts
    with open(os.path.join(ckpt, "iter_0000100", MANIFEST), "w") as f:
        f.write("{}")
    assert rl_learning.sft_start(ckpt, 100) is None
