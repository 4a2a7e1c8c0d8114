"""SFT data from oracle trajectories: each task's oracle played through the real episode loop in the sandbox.

    python tools/build_agent_sft.py --tasks DIR/train.jsonl --oracle DIR/oracle --output data/agent_sft.jsonl \
        --env-tool-declarations compact --concurrency 2

--tasks is a suite (a .json/.jsonl task file, a directory of them, builtin:NAME); --oracle DIR holds DIR/<task
id>.json in the ACTIONS.json format that run_eval's script:DIR agent replays. Each oracle runs as an episode
(megatron_ext/env/episode.py, the --env-* sandbox limits), so the tool results in the data are the real
observations RL and evaluation show; the episode is graded in a fresh sandbox with the hidden tests and kept only
when it finished, every call was valid and the grade is correct. Every kept episode is one JSON line
{"id", "messages", "tools"}: the transcript up to the model's last turn (tool calls in the OpenAI shape, rendered
in the Kimi-K2 format by megatron_ext/data/sft.py, tool results as tool messages) and the declared tools, exactly
what `pretrain_composer.py --sft --data-path` reads and what the RL environment's token sequences hold
(tests/unit/test_agent_sft.py checks them token for token). Dropped tasks are counted by reason on stderr and in
OUTPUT.report.json. Exit status: 0 when at least one episode was kept, 1 when none was, 2 on bad input.

--recovery plays each oracle with a wrong first edit instead: one slip in its first edit's new text (an integer
literal moved by one, min/max, upper/lower or sum/len swapped, a string literal's last character doubled), the test
run that then fails, an edit that puts the line right, the passing run and finish. The wrong
edit's turn stays in the conversation as context ("train": false); every turn after it is trained. Oracles only
ever pass their first test run, so a policy trained on them alone has never seen what to do after a failing one
(it stops). A recovery episode is kept only when its first test run failed and the rest holds as above; ids end in
"-recovery".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.atomic import atomic_output  # noqa: E402
from megatron_ext.env.agents import AgentError, ScriptAgent, load_actions  # noqa: E402
from megatron_ext.env.arguments import add_env_args, episode_config  # noqa: E402
from megatron_ext.env.episode import EpisodeConfig, Session, drive  # noqa: E402
from megatron_ext.env.tasks import Task, TaskError  # noqa: E402
from megatron_ext.env.tools import TOOL_SCHEMAS, declarations  # noqa: E402
from megatron_ext.eval.harness import task_config  # noqa: E402
from megatron_ext.eval.tasks import load_suite  # noqa: E402


_INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
_SWAPS = {"min": "max", "max": "min", "upper": "lower", "lower": "upper", "sum": "len", "len": "sum"}
_WORD = re.compile(r"\b(" + "|".join(_SWAPS) + r")\(|\.(" + "|".join(_SWAPS) + r")\(")
_STRING = re.compile(r"'([^'\\\n]+)'")


def _slips(text: str) -> list[str]:
    """`text` with one slip each: an integer literal moved by one (n+1, n-1 when not negative), a builtin or
    method swapped for its twin (min/max, upper/lower, sum/len), a string literal with its last character doubled."""
    out = []
    for m in _INTEGER.finditer(text):
        n = int(m.group())
        out += [text[:m.start()] + str(k) + text[m.end():] for k in (n + 1, n - 1) if k >= 0]
    for m in _WORD.finditer(text):
        g = 1 if m.group(1) else 2
        out.append(text[:m.start(g)] + _SWAPS[m.group(g)] + text[m.end(g):])
    for m in _STRING.finditer(text):
        out.append(text[:m.end(1)] + m.group(1)[-1] + text[m.end(1):])
    return out


def recovery_actions(actions: list, rng: random.Random) -> tuple[list, list, str] | None:
    """(the oracle's actions with a wrong first edit and a fix of its one wrong line, the same with a fix that
    rewrites the wrong edit's whole text, for a line that is not unique in the file; the wrong edit's new text), or
    None when the first edit has nothing to slip (`_slips`) or no test run follows it."""
    i = next((k for k, a in enumerate(actions) if isinstance(a, dict) and a.get("name") == "edit_file"), None)
    if i is None or not any(isinstance(a, dict) and a.get("name") == "run_command" for a in actions[i + 1:]):
        return None
    arguments = actions[i]["arguments"]
    right = arguments["new_text"]
    slips = [w for w in _slips(right) if w != arguments["old_text"]]  # not a no-op edit back to the bug
    if not slips:
        return None
    wrong = rng.choice(slips)
    line = next(k for k, (a, b) in enumerate(zip(wrong.splitlines(True), right.splitlines(True))) if a != b)
    run = next(a for a in actions[i + 1:] if isinstance(a, dict) and a.get("name") == "run_command")
    wrong_edit = {"name": "edit_file", "arguments": {**arguments, "new_text": wrong}}
    fixes = ({"old_text": wrong.splitlines(True)[line], "new_text": right.splitlines(True)[line]},
             {"old_text": wrong, "new_text": right})
    return (*(actions[:i] + [wrong_edit, run, {"name": "edit_file", "arguments": {"path": arguments["path"], **fix}}]
              + actions[i + 1:] for fix in fixes), wrong)


def recovery_episode(task: Task, actions: list, config: EpisodeConfig,
                     rng: random.Random) -> tuple[dict | None, str | None]:
    """(the recovery SFT record, None), else (None, why it is dropped): see --recovery."""
    planned = recovery_actions(actions, rng)
    if planned is None:
        return None, "nothing to slip in the first edit, or no test run after it"
    line_fix, block_fix, wrong = planned
    record, why = oracle_episode(task, line_fix, config, wrong_edit=wrong)
    if why is not None and why.startswith("invalid tool calls"):  # the wrong line is not unique in its file
        record, why = oracle_episode(task, block_fix, config, wrong_edit=wrong)
    return record, why


def _edits(message: dict) -> list[dict]:
    out = []
    for call in message.get("tool_calls") or []:
        if call["function"]["name"] == "edit_file":
            try:
                out.append(json.loads(call["function"]["arguments"]))
            except ValueError:
                pass
    return out


def oracle_episode(task: Task, actions: list, config: EpisodeConfig,
                   wrong_edit: str | None = None) -> tuple[dict | None, str | None]:
    """(the SFT record, None) for an oracle episode graded correct, else (None, why it is dropped). With
    `wrong_edit` (a recovery episode: see --recovery) the edit writing that text must be followed by a failing test
    run, and its assistant turn is marked "train": false."""
    tools = declarations(TOOL_SCHEMAS, config.tool_declarations)
    try:
        result = drive(Session(task, task_config(config, task)), ScriptAgent(actions), tools)
    except Exception as e:  # a task whose sandbox or grading cannot run is dropped, named, not the whole build
        return None, f"episode failed ({type(e).__name__}: {str(e)[:200]})"
    if result.status != "finished":
        return None, f"status {result.status}"
    invalid = [c.name for c in result.calls if not c.valid]
    if invalid:
        return None, f"invalid tool calls ({', '.join(invalid)})"
    if result.segments:
        return None, "self-summarised (more than one sequence)"
    if not result.grading.get("correct"):
        return None, f"graded wrong (tests passed: {result.grading.get('tests_fraction', 0):.0%})"
    if result.grading.get("forbidden_edits"):
        return None, "forbidden edits"
    messages = list(result.messages)
    while messages[-1]["role"] == "tool":  # finish's "finished": after the last model turn, nothing to learn
        messages.pop()
    if wrong_edit is None:
        return {"id": task.id, "messages": messages, "tools": tools}, None
    runs = [c for c in result.calls if c.name == "run_command"]
    if not runs or runs[0].observation.rstrip().rsplit("\n", 1)[-1] == "[exit code 0]":
        return None, "the wrong edit passed the tests"
    k = next(k for k, m in enumerate(messages)
             if m["role"] == "assistant" and any(e.get("new_text") == wrong_edit for e in _edits(m)))
    messages[k] = {**messages[k], "train": False}
    return {"id": f"{task.id}-recovery", "messages": messages, "tools": tools}, None


def build(tasks: list[Task], oracle_dir: str, config: EpisodeConfig, concurrency: int = 1, log=None,
          recovery: bool = False, seed: int = 0):
    """(records in task order, {task id: why dropped}); `log` gets a progress line every ~5% of the tasks.
    `recovery`: recovery episodes instead (see --recovery; each task's wrong literal drawn from `seed` and its id)."""
    done, lock, every, start = [0], threading.Lock(), max(1, len(tasks) // 20), time.monotonic()

    def progress():
        with lock:
            done[0] += 1
            if log is not None and (done[0] % every == 0 or done[0] == len(tasks)):
                rate = done[0] / max(time.monotonic() - start, 1e-9)
                log(f"[{done[0]}/{len(tasks)}] oracle episodes played, {rate:.2f}/s, "
                    f"eta {(len(tasks) - done[0]) / rate:.0f} s")

    def one(task: Task):
        try:
            return _one(task)
        finally:
            progress()

    def _one(task: Task):
        path = os.path.join(oracle_dir, f"{task.id}.json")
        if not os.path.exists(path):
            return None, "no oracle file"
        try:
            actions = load_actions(path)
        except AgentError as e:
            return None, f"bad oracle file ({e})"
        if recovery:
            return recovery_episode(task, actions, config, random.Random(f"recovery:{seed}:{task.id}"))
        return oracle_episode(task, actions, config)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(one, tasks))
    records = [r for r, _ in outcomes if r is not None]
    dropped = {t.id: why for t, (_, why) in zip(tasks, outcomes) if why is not None}
    return records, dropped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", required=True, help="SUITE: task file, directory of task files, or builtin:NAME")
    p.add_argument("--oracle", required=True, help="DIR with DIR/<task id>.json (ACTIONS.json format)")
    p.add_argument("--output", required=True, help="chat JSONL for pretrain_composer.py --sft --data-path")
    p.add_argument("--concurrency", type=int, default=1, help="episodes run at once")
    p.add_argument("--recovery", action="store_true",
                   help="play each oracle with a wrong first edit (one slip: a literal or builtin changed; its turn "
                        "kept as untrained context), the failing test run, the fix, then the rest (ids end in "
                        "-recovery)")
    p.add_argument("--seed", type=int, default=0, help="--recovery: draws which literal goes wrong and how")
    add_env_args(p)
    args = p.parse_args(argv)
    try:
        if args.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
        if args.env_summarize_at is not None:
            raise ValueError("--env-summarize-at: SFT conversations are single sequences; drop the flag")
        if not os.path.isdir(args.oracle):
            raise ValueError(f"--oracle {args.oracle}: not a directory")
        tasks = load_suite(args.tasks)
        config = episode_config(args)
    except (TaskError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records, dropped = build(tasks, args.oracle, config, args.concurrency,
                             log=lambda line: print(line, file=sys.stderr, flush=True), recovery=args.recovery,
                             seed=args.seed)
    with atomic_output(args.output) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    reasons = Counter(why.split(" (")[0] for why in dropped.values())
    report = {"tasks": len(tasks), "kept": len(records), "dropped": len(dropped), "recovery": args.recovery,
              "tool_declarations":
              config.tool_declarations, "dropped_by_reason": dict(reasons), "dropped_tasks": dropped}
    with atomic_output(args.output + ".report.json") as f:
        json.dump(report, f, indent=1)
    print(f"kept {len(records)} of {len(tasks)} oracle episodes -> {args.output} ({config.tool_declarations} tool "
          f"declarations)", file=sys.stderr)
    for why, n in reasons.most_common():
        print(f"  dropped {n}: {why}", file=sys.stderr)
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
