"""Agent prompt options and SFT data from oracle trajectories (issue 26, item 2): compact tool declarations keep
every schema, oracle episodes become chat SFT lines whose rendering is token for token what the RL environment
produces, and a checkpoint records the declarations it was trained with so local: agents prompt it the same way."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron_ext.data.sft import render_chat
from megatron_ext.data.tokenizers import build_tokenizer
from megatron_ext.env.arguments import sft_agent_prompt
from megatron_ext.env.demo import ORACLE, make_two_part_task
from megatron_ext.env.episode import EpisodeConfig
from megatron_ext.env.sandbox import BubblewrapConfig
from megatron_ext.env.swarm import SWARM_TOOL_SCHEMAS
from megatron_ext.env.token_env import CodingEnv
from megatron_ext.env.tools import TOOL_SCHEMAS, declarations, declared_kind, validate
from tests.unit.data_fixtures import load_tool, small_corpus, trained_tokenizer
from tests.unit.eval_fixtures import make_suite, script_dir


def _tokenizer(tmp_path):
    return build_tokenizer(None, trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024))


def test_compact_declarations_keep_every_schema(tmp_path):
    for schemas in (TOOL_SCHEMAS, SWARM_TOOL_SCHEMAS):
        compact = declarations(schemas, "compact")
        assert declarations(schemas, "full") is schemas
        assert [t["function"]["name"] for t in compact] == [t["function"]["name"] for t in schemas]
        for short, full in zip(compact, schemas):
            assert short["type"] == full["type"] == "function"
            params, full_params = short["function"]["parameters"], full["function"]["parameters"]
            assert params == {k: v for k, v in full_params.items() if k != "additionalProperties"}
            assert params["properties"] == full_params["properties"] and params["required"] == full_params["required"]
            assert set(short["function"]) == set(full["function"])
            assert 0 < len(short["function"]["description"].split()) <= 6
            assert len(short["function"]["description"]) < len(full["function"]["description"])
        assert declared_kind(compact) == "compact" and declared_kind(schemas) == "full"
    assert TOOL_SCHEMAS[0]["function"]["description"].startswith("Read a text file, with line numbers")  # untouched
    assert declared_kind([{"type": "function", "function": {"name": "mine"}}]) is None
    assert validate("read_file", '{"path": "a.py", "start_line": 2}') == {"path": "a.py", "start_line": 2}
    with pytest.raises(ValueError, match="unknown arguments"):  # still refused, though compact does not say so
        validate("read_file", '{"path": "a.py", "mode": "r"}')
    with pytest.raises(ValueError, match="must be one of"):
        declarations(TOOL_SCHEMAS, "tiny")
    tokenizer = _tokenizer(tmp_path)
    message = [{"role": "user", "content": "x"}]
    full = len(render_chat(tokenizer, message, tools=TOOL_SCHEMAS).ids)
    compact = len(render_chat(tokenizer, message, tools=declarations(TOOL_SCHEMAS, "compact")).ids)
    assert compact < full * 0.8, (compact, full)


def _oracle_suite(root: str):
    """Four demo tasks: two with the oracle, one whose script does nothing (graded wrong), one without a file."""
    suite = make_suite(root, ids=("add-a", "add-b", "add-c"))
    with open(suite, "a") as f:
        f.write(json.dumps({**json.loads(open(suite).readline()), "id": "no-oracle"}) + "\n")
    oracle = script_dir(root, "oracle", {"add-a": ORACLE, "add-b": ORACLE,
                                         "add-c": [{"name": "list_dir", "arguments": {}}]})
    return suite, oracle


def test_build_agent_sft_keeps_only_correct_oracle_episodes(tmp_path, capsys):
    suite, oracle = _oracle_suite(str(tmp_path))
    out = str(tmp_path / "sft.jsonl")
    code = load_tool("build_agent_sft").main(["--tasks", suite, "--oracle", oracle, "--output", out,
                                              "--env-tool-declarations", "compact", "--concurrency", "2",
                                              "--env-sandbox-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    lines = [json.loads(line) for line in open(out)]
    assert [r["id"] for r in lines] == ["add-a", "add-b"]
    report = json.load(open(out + ".report.json"))
    assert report["dropped_tasks"] == {"add-c": "graded wrong (tests passed: 0%)", "no-oracle": "no oracle file"}
    assert "kept 2 of 4" in err and "dropped 1: graded wrong" in err and "dropped 1: no oracle file" in err
    record = lines[0]
    assert record["tools"] == declarations(TOOL_SCHEMAS, "compact")
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["system", "user"] + ["assistant", "tool"] * (len(ORACLE) - 1) + ["assistant"]
    calls = [m["tool_calls"][0]["function"] for m in record["messages"] if m["role"] == "assistant"]
    assert [c["name"] for c in calls] == [a["name"] for a in ORACLE]
    observations = [m["content"] for m in record["messages"] if m["role"] == "tool"]
    assert "raise NotImplementedError" in observations[1] and observations[3] == "5\n[exit code 0]"  # real outputs
    assert record["messages"][-1]["tool_calls"][0]["function"]["name"] == "finish"


def _model_turns(rendered) -> list[list[int]]:
    """The runs of trained tokens of an SFT rendering: the model's turns, body and <|im_end|>."""
    turns, current = [], None
    for token, trained in zip(rendered.ids, rendered.loss_mask):
        if trained:
            current = current if current is not None else []
            current.append(token)
        elif current is not None:
            turns.append(current)
            current = None
    return turns + ([current] if current else [])


@pytest.mark.parametrize("kind", ["compact", "full"])
def test_sft_rendering_is_the_rl_token_sequence(tmp_path, kind):
    """SFT teaches exactly what RL samples: the model turns of an SFT line, fed to CodingEnv.step, rebuild the SFT
    rendering token for token, and the SFT loss covers exactly the model's tokens of that sequence."""
    tokenizer = _tokenizer(tmp_path)
    suite, oracle = _oracle_suite(str(tmp_path))
    out = str(tmp_path / "sft.jsonl")
    assert load_tool("build_agent_sft").main(["--tasks", suite, "--oracle", oracle, "--output", out,
                                              "--env-tool-declarations", kind, "--env-sandbox-dir",
                                              str(tmp_path)]) == 0
    record = json.loads(open(out).readline())
    sft = render_chat(tokenizer, record["messages"], tools=record["tools"])
    task = json.loads(open(suite).readline())
    config = EpisodeConfig(sandbox=BubblewrapConfig(base_dir=str(tmp_path / "boxes")), tool_declarations=kind)
    env = CodingEnv(tokenizer, config, task_dir=os.path.dirname(suite))
    sequence = env.reset(task)
    mask = [0] * len(sequence)
    turns = _model_turns(sft)
    assert len(turns) == len(ORACLE)
    for i, turn in enumerate(turns):
        step = env.step(turn)
        sequence += turn + step.observation
        mask += [1] * len(turn) + [0] * len(step.observation)
        assert step.done == (i == len(turns) - 1)
    assert sequence == sft.ids
    assert mask == sft.loss_mask
    assert env.session.messages == record["messages"] + [
        {"role": "tool", "tool_call_id": f"functions.finish:{len(ORACLE) - 1}", "content": "finished"}]
    assert env.score().parts["correctness"] == 1.0


def test_sft_data_decides_and_checks_the_flag(tmp_path):
    path = str(tmp_path / "chat.jsonl")
    compact = declarations(TOOL_SCHEMAS, "compact")
    with open(path, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": compact}) + "\n")
    args = argparse.Namespace(sft=True, data_path=[path], env_tool_declarations=None)
    sft_agent_prompt(args, log=lambda line: None)
    assert args.env_tool_declarations == "compact"
    args.env_tool_declarations = "full"
    with pytest.raises(ValueError, match=r"--env-tool-declarations full, but --data-path .* declares the compact "
                                         r"tools \(line 2\)"):
        sft_agent_prompt(args)
    with open(path, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": TOOL_SCHEMAS}) + "\n")
    args.env_tool_declarations = None
    with pytest.raises(ValueError, match="line 3 declares the full tools and line 2 the compact ones"):
        sft_agent_prompt(args)


def test_two_part_oracle_is_kept_with_full_declarations(tmp_path, capsys):
    task = make_two_part_task(str(tmp_path / "kit"))
    from megatron_ext.env.demo import TWO_PART_SERIAL

    oracle = script_dir(str(tmp_path), "oracle", {"kit-two-part": TWO_PART_SERIAL})
    out = str(tmp_path / "sft.jsonl")
    assert load_tool("build_agent_sft").main(["--tasks", task, "--oracle", oracle, "--output", out,
                                              "--env-sandbox-dir", str(tmp_path)]) == 0
    record = json.loads(open(out).readline())
    assert record["tools"] == TOOL_SCHEMAS and len(record["messages"]) == 1 + 2 * len(TWO_PART_SERIAL)


def test_checkpoint_options_rule(monkeypatch, capsys):
    """No flag: the checkpoint's value (an older checkpoint records none: full); a disagreeing flag wins, warned."""
    import megatron_ext.training.checkpointing as checkpointing
    from megatron_ext.env.arguments import checkpoint_agent_prompt

    recorded = {}
    monkeypatch.setattr(checkpointing, "checkpoint_args", lambda root, purpose: (f"{root}/iter_0000007", recorded))
    for saved, flag, want, warned in ((None, None, "full", False), ("compact", None, "compact", False),
                                      ("compact", "compact", "compact", False), ("compact", "full", "full", True),
                                      (None, "compact", "compact", True)):
        recorded.clear()
        if saved:
            recorded["env_tool_declarations"] = saved
        args = argparse.Namespace(env_tool_declarations=flag)
        lines = []
        assert checkpoint_agent_prompt(args, "ck", "--agent local:ck", log=lines.append) == want
        assert args.env_tool_declarations == want
        err = capsys.readouterr().err
        assert ("WARNING: --agent local:ck: --env-tool-declarations" in err) == warned, (saved, flag, err)
        assert lines == ([] if flag else [f"--agent local:ck: --env-tool-declarations {want} (recorded in "
                                          "ck/iter_0000007)"])


@pytest.mark.slow  # 50-85 s on the shared 2-core VM: an SFT step, a served checkpoint, two RL start-ups
def test_checkpoint_records_tool_declarations_and_local_agent_applies(tmp_path, monkeypatch, capsys):
    """pretrain_composer.py --sft from a fresh init on compact SFT data records compact in its checkpoint;
    run_eval --agent local:CKPT without the flag declares the compact tools to the served model; rl_composer.py
    --load of it with an explicit full warns, and the flag wins."""
    import pretrain_composer
    import rl_composer
    from megatron_ext.env.arguments import checkpoint_agent_prompt
    from megatron_ext.inference import server
    from megatron_ext.training.checkpointing import checkpoint_args
    from tests.unit.eval_fixtures import run_eval_main

    tokenizer_dir = trained_tokenizer(str(tmp_path), small_corpus(str(tmp_path)), vocab_size=1024)
    suite, oracle = _oracle_suite(str(tmp_path))
    data = str(tmp_path / "sft.jsonl")
    assert load_tool("build_agent_sft").main(["--tasks", suite, "--oracle", oracle, "--output", data,
                                              "--env-tool-declarations", "compact", "--env-sandbox-dir",
                                              str(tmp_path)]) == 0
    save = str(tmp_path / "ckpt")
    assert pretrain_composer.main(["--model", "tiny", "--sft", "--data-path", data, "--tokenizer-model",
                                   tokenizer_dir, "--split", "1,0,0", "--train-iters", "1", "--global-batch-size",
                                   "1", "--micro-batch-size", "1", "--seq-length", "2048",
                                   "--max-position-embeddings", "2048",
                                   "--save", save]) == 0
    assert "--env-tool-declarations compact: as the --sft data declares its tools" in capsys.readouterr().out
    assert checkpoint_args(save, "test")[1]["env_tool_declarations"] == "compact"

    received = []

    def recording(value, _parse=server._tools):
        received.append(_parse(value))
        return received[-1]

    monkeypatch.setattr(server, "_tools", recording)
    out = str(tmp_path / "run")
    code = run_eval_main()(["--tasks", f"{suite}#add-a", "--agent", f"local:{save}", "--serve-arg=--tokenizer-model",
                            f"--serve-arg={tokenizer_dir}", "--serve-arg=--inference-max-seq-length",
                            "--serve-arg=4096", "--max-tokens", "4", "--max-turns", "2", "--out", out,
                            "--env-sandbox-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert f"--agent local:{save}: --env-tool-declarations compact (recorded in" in err
    assert received and all(tools == declarations(TOOL_SCHEMAS, "compact") for tools in received)

    args = argparse.Namespace(env_tool_declarations="full")
    assert checkpoint_agent_prompt(args, save, "rl_composer.py --load") == "full"
    assert "WARNING: rl_composer.py --load: --env-tool-declarations full is given, but" in capsys.readouterr().err

    seen = {}

    class Stop(Exception):
        pass

    def trainer(args, cfg, tasks, make_env, **kwargs):
        seen["declarations"] = make_env.config.tool_declarations
        raise Stop

    monkeypatch.setattr(rl_composer, "RLTrainer", trainer)
    base = ["--model", "tiny", "--rl-env", "coding", "--rl-prompts", suite, "--tokenizer-model", tokenizer_dir,
            "--load", save, "--finetune", "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--grpo-max-response-length", "64", "--env-sandbox-dir", str(tmp_path)]
    for flags, want in (([], "compact"), (["--env-tool-declarations", "full"], "full")):
        with pytest.raises(Stop):
            rl_composer.main(base + flags)
        assert seen["declarations"] == want
    from megatron_ext.training.initialize import destroy

    destroy()
    assert "WARNING: rl_composer.py --load: --env-tool-declarations full is given" in capsys.readouterr().err


def test_run_eval_declares_compact_and_pins_it(tmp_path, capsys):
    """run_eval with the flag: episodes (a script agent) count the compact declarations in their prompts, run.json
    pins the option, and resuming the run with the other one is refused."""
    from megatron_ext.eval.harness import MANIFEST
    from tests.unit.eval_fixtures import oracle_dir, run_eval_main

    suite, oracle = make_suite(str(tmp_path), ids=("add-a",)), oracle_dir(str(tmp_path), ids=("add-a",))
    runs = {}
    for kind in ("compact", "full"):
        out = str(tmp_path / kind)
        assert run_eval_main()(["--tasks", suite, "--agent", f"script:{oracle}", "--out", out,
                                "--env-tool-declarations", kind, "--env-sandbox-dir", str(tmp_path)]) == 0
        runs[kind] = json.loads(open(os.path.join(out, "episodes.jsonl")).readline())
        assert json.load(open(os.path.join(out, MANIFEST)))["tool_declarations"] == kind
    assert runs["compact"]["grading"]["correct"] and runs["full"]["grading"]["correct"]
    turns = runs["full"]["counts"]["turns"]
    saved = runs["full"]["usage"]["input_tokens"] + runs["full"]["usage"]["cached_input_tokens"] - \
        runs["compact"]["usage"]["input_tokens"] - runs["compact"]["usage"]["cached_input_tokens"]
    declared = len(json.dumps(TOOL_SCHEMAS)) - len(json.dumps(declarations(TOOL_SCHEMAS, "compact")))
    assert saved == pytest.approx(turns * declared / 4, rel=0.05)  # 4 bytes a token without a tokenizer
    capsys.readouterr()
    assert run_eval_main()(["--tasks", suite, "--agent", f"script:{oracle}", "--out", str(tmp_path / "compact"),
                            "--env-sandbox-dir", str(tmp_path)]) == 2
    assert "holds a run with another tool_declarations (compact)" in capsys.readouterr().err


def test_recovery_episodes_show_a_failing_run_and_train_only_the_fix(tmp_path, capsys):
    """--recovery: each oracle played with one slip in its first edit. The wrong edit is context (untrained), the
    tests it breaks really fail in the sandbox, the next turns put the one wrong line right and pass, and the SFT
    loss covers every model turn but the wrong edit."""
    tasks = tmp_path / "tasks"
    assert load_tool("make_agent_tasks").main(["--out", str(tasks), "--seed", "5", "--train", "6",
                                               "--heldout", "1"]) == 0
    out = str(tmp_path / "recovery.jsonl")
    code = load_tool("build_agent_sft").main(["--tasks", str(tasks / "train.jsonl"), "--oracle", str(tasks / "oracle"),
                                              "--output", out, "--env-tool-declarations", "compact", "--recovery",
                                              "--concurrency", "2", "--env-sandbox-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in open(out)]
    report = json.load(open(out + ".report.json"))
    assert report["recovery"] is True and report["kept"] == len(records) >= 4, report
    tokenizer = _tokenizer(tmp_path)
    for record in records:
        task_id = record["id"].removesuffix("-recovery")
        assert record["id"].endswith("-recovery")
        oracle = json.load(open(tasks / "oracle" / f"{task_id}.json"))
        right = next(a for a in oracle if a["name"] == "edit_file")["arguments"]
        turns = [m for m in record["messages"] if m["role"] == "assistant"]
        calls = [(m["tool_calls"][0]["function"]["name"], json.loads(m["tool_calls"][0]["function"]["arguments"]))
                 for m in turns]
        untrained = [k for k, m in enumerate(turns) if m.get("train") is False]
        assert len(untrained) == 1, record["id"]
        k = untrained[0]
        name, wrong = calls[k]
        assert name == "edit_file" and wrong["old_text"] == right["old_text"] and wrong["path"] == right["path"]
        assert wrong["new_text"] != right["new_text"]
        assert len(wrong["new_text"].splitlines()) == len(right["new_text"].splitlines())
        assert [c[0] for c in calls[k:]] == ["edit_file", "run_command", "edit_file", "run_command", "finish"]
        fix = calls[k + 2][1]
        assert fix["old_text"] in wrong["new_text"] and fix["new_text"] in right["new_text"]
        assert wrong["new_text"].replace(fix["old_text"], fix["new_text"], 1) == right["new_text"]
        runs = [m["content"] for m in record["messages"] if m["role"] == "tool" and "passed" in m["content"]
                or m["role"] == "tool" and "failed" in m["content"]]
        assert len(runs) == 2 and "failed" in runs[0] and not runs[0].rstrip().endswith("[exit code 0]")
        assert runs[1].rstrip().endswith("[exit code 0]") and "failed" not in runs[1]
        # the loss covers each model turn except the wrong edit
        rendered = render_chat(tokenizer, record["messages"], tools=record["tools"])
        trained = _model_turns(rendered)
        assert len(trained) == len(turns) - 1
        everything = render_chat(tokenizer, [{k2: v for k2, v in m.items() if k2 != "train"}
                                             for m in record["messages"]], tools=record["tools"])
        assert everything.ids == rendered.ids and sum(everything.loss_mask) > sum(rendered.loss_mask)
