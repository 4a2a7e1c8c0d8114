"""Agentic RL that learns: the whole recipe in miniature, on one command, judged on held-out repository tasks.

    python benchmarks/agentic_learning.py --out runs/agentic            # 36 minutes on 2 CPU cores
    python benchmarks/agentic_learning.py --out runs/agentic_smoke --smoke   # the default suite's few-step version

Phases (each skipped when its output exists and was made with the same settings, recorded in
DIR/phase_settings.json, so re-running the command resumes, a training phase from its own latest save when it was
stopped part way; a re-run with other settings sets the outputs they reach aside as NAME.stale-N and makes them
again; DIR is --out):
  1. tasks      tools/make_agent_tasks.py: a generated family of small repository tasks with hidden tests; the
                train split is cut into an SFT part and a disjoint RL part, the held-out split shares no program with
                either (DIR/tasks/{sft,rl,heldout}.jsonl, oracle scripts in DIR/tasks/oracle/)
  2. sft data   tools/build_agent_sft.py: each SFT task's oracle played through the real episode loop in the sandbox,
                kept when graded correct, as chat conversations (DIR/sft.jsonl), compact tool declarations
  3. tokenizer  tools/train_tokenizer.py on the SFT conversations' text, the RL tasks' files and the code corpus
                (DIR/tokenizer)
  4. pretrain   code pretraining (loss on every token) on more training-split tasks as plain text: instruction,
                files, module before and after (tools/make_agent_tasks.py --corpus, tools/preprocess_data.py;
                DIR/ckpt/pretrain); no held-out program is in it. --pretrain-iters 0 skips it; --init starts it
                from other weights, --pretrain-extra mixes more documents in (a copy warm-up's, to keep its skill)
  5. sft        pretrain_composer.py --sft from the pretrained checkpoint, deliberately short (DIR/ckpt/sft);
                --sft-renamed-copies N trains on N copies of each oracle conversation with its names drawn afresh
                (DIR/sft_renamed_xN.jsonl) instead, so that names can only be copied, not recalled;
                --sft-recovery adds each SFT task's oracle played with a wrong first edit and its fix
                (tools/build_agent_sft.py --recovery, DIR/sft_recovery.jsonl): what to do after a failing test run
  6. rl         rl_composer.py --rl-env coding on 2 ranks from the SFT checkpoint: every RL task once, G episodes
                per task, rewards from the environment's parts (DIR/ckpt/rl, DIR/rl_logs, a save every 5 steps);
                rollouts sampled at --rl-temperature (default: --temperature); --rl-prompts (repeatable) takes
                RL's tasks from other generated files instead (several: merged in order, DIR/rl_prompts.jsonl)
  7. eval       tools/run_eval.py on the held-out tasks for both checkpoints (local: agent, K passes at
                --temperature, 1 by default, as RL samples; DIR/eval/sft, DIR/eval/rl), then --compare
                (DIR/eval/compare); --eval-heldout adds other seeds' held-out sets (DIR/eval/{sft,rl}_heldout_N),
                reported per set and pooled
  8. turns      benchmarks/agent_turns.py for both checkpoints on the held-out tasks' oracle conversations
                (DIR/heldout_oracle.jsonl): per tool, the turns the model would write verbatim under teacher forcing
                (which step fails: the path it must copy, the code, the call's format)
  9. report     DIR/summary.json, a markdown table for docs/benchmarks.md, and the figure (--plot): held-out
                success with 95% intervals and the training reward's parts per RL step

The checkpoints record the agent-prompt options they were trained with, so anyone can evaluate them on tasks of
another seed with `tools/run_eval.py --tasks T --agent local:DIR/ckpt/rl --serve-arg=--tokenizer-model
--serve-arg=DIR/tokenizer` and no other flag.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_ext.eval.stats import wilson  # noqa: E402
from megatron_ext.lifetime import run_tied  # noqa: E402

PROMPT_OPTIONS = ["--env-tool-declarations", "compact"]


def run(cmd: list, log_path: str, threads: int = 1):
    """Runs one phase's command with its output in log_path; a failure names the log. One thread per process
    (parallelism comes from the ranks): on a shared machine, two spinning threads slowed an SFT step from about
    4 s to 56 s here. A phase run again (resumed after a kill, or redone) appends to its log after a dated line,
    so the earlier part's output is kept."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    with open(log_path, "a") as log:
        start = log.tell()
        log.write(f"===== {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(str(c) for c in cmd)}\n")
        log.flush()
        code = run_tied([str(c) for c in cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code:
        with open(log_path) as f:
            f.seek(start)
            tail = f.read()[-2000:]
        raise SystemExit(f"{' '.join(str(c) for c in cmd[:4])} ... failed ({code}); see {log_path}:\n{tail}")


class Phases:
    """Runs the pipeline's phases, skipping those already done, across re-runs of the command. Keeps the wall time of
    each phase (DIR/timings.json) and the settings each phase's outputs were made with (DIR/phase_settings.json:
    its own flags and a digest of the phases it reads). A re-run with other settings (say --sft-lr, or --seed)
    sets the outputs of the phases they reach aside, downstream ones included, and runs those phases again, instead
    of skipping or resuming them as done."""

    def __init__(self, out: str):
        self.path = os.path.join(out, "timings.json")
        self.seconds = json.load(open(self.path)) if os.path.exists(self.path) else {}
        self.settings_path = os.path.join(out, "phase_settings.json")
        self.recorded = json.load(open(self.settings_path)) if os.path.exists(self.settings_path) else {}
        self.digests = {}

    def _record(self, name: str, entry: dict):
        self.recorded[name] = entry
        tmp = self.settings_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.recorded, f, indent=1, sort_keys=True)
        os.replace(tmp, self.settings_path)

    def __call__(self, name: str, done, body, settings: dict | None = None, after=(), outputs=()):
        """`done()`: whether the outputs are complete; `settings`: what else than the outputs of the phases named in
        `after` decides this phase's `outputs` (files or folders)."""
        settings = json.loads(json.dumps(settings or {}, default=str))
        upstream = {n: self.digests[n] for n in after if n in self.digests}
        digest = hashlib.sha256(json.dumps([settings, upstream], sort_keys=True).encode()).hexdigest()[:16]
        self.digests[name] = digest
        old = self.recorded.get(name)
        if old is None or old["digest"] != digest:
            if old is not None:
                changed = [f"{k} {old['settings'].get(k)!r} -> {settings.get(k)!r}"
                           for k in sorted(set(old["settings"]) | set(settings))
                           if old["settings"].get(k) != settings.get(k)]
                changed += [f"{n} redone" for n in sorted(set(old.get("after", {})) | set(upstream))
                            if old.get("after", {}).get(n) != upstream.get(n)]
                set_aside(outputs, f"made with other settings ({', '.join(changed)})")
                self.seconds.pop(name, None)
            # recorded before the phase runs: a kill during it leaves outputs that the next run can judge
            self._record(name, {"digest": digest, "settings": settings, "after": upstream})
        if done() and name in self.seconds:
            print(f"[{name}] done before ({self.seconds[name]:.0f} s)", flush=True)
            return
        print(f"[{name}] ...", flush=True)
        start = time.monotonic()
        body()
        self.seconds[name] = time.monotonic() - start
        with open(self.path, "w") as f:
            json.dump(self.seconds, f, indent=1)
        print(f"[{name}] {self.seconds[name]:.0f} s", flush=True)


def saved_iteration(ckpt: str):
    """The iteration of a checkpoint directory's latest save, or None when it holds none (the rule --load uses:
    the tracker, else the latest complete iter_N/ a kill left before its tracker was written)."""
    from megatron_ext.training.checkpointing import CheckpointError, read_tracker

    try:
        tag = read_tracker(ckpt)
    except CheckpointError:
        return None
    return tag if isinstance(tag, int) else None


def save_interval(iters: int, saves: int = 10) -> int:
    """Pretraining and SFT save about ten times, so that a kill (a SLURM requeue, the end of a session) loses at most
    a tenth of the phase: the same command re-run resumes from the last save (`resume_or`)."""
    return max(1, -(-iters // saves))


def resume_or(ckpt: str, fresh: list) -> list:
    """A phase's start: from its own checkpoint when a save of it exists (a kill after its first save, or a SIGTERM,
    which saves: the re-run command resumes instead of being refused for overwriting it), else from `fresh`."""
    return ["--load", ckpt] if saved_iteration(ckpt) is not None else fresh


def mtime(path: str):
    return os.path.getmtime(path) if os.path.exists(path) else None


def saved_marker(ckpt: str) -> str:
    """What dates a checkpoint directory's latest save: its tracker, else (a kill between the rename and the
    tracker write) the manifest of the complete iter_N/ that --load would take."""
    from megatron_ext.training.checkpointing import MANIFEST, TRACKER, checkpoint_dir

    tracker = os.path.join(ckpt, TRACKER)
    if os.path.exists(tracker):
        return tracker
    iteration = saved_iteration(ckpt)
    return tracker if iteration is None else os.path.join(checkpoint_dir(ckpt, iteration), MANIFEST)


def set_aside(outputs, why: str):
    """Renames each existing output to OUTPUT.stale-N (kept, never deleted), saying why."""
    for path in outputs:
        if os.path.lexists(path):
            k = 1
            while os.path.lexists(f"{path}.stale-{k}"):
                k += 1
            os.rename(path, f"{path}.stale-{k}")
            print(f"{path}: {why}; set aside as {path}.stale-{k}", flush=True)


def set_aside_if_stale(outputs: list, marker: str, inputs: list) -> bool:
    """When `marker` (what a phase writes first, or its checkpoint's `saved_marker`) is older than one of `inputs`
    (what the phase reads), its outputs came from other inputs (an earlier phase redone, or an input file replaced
    by hand): rename them to OUTPUT.stale-N, keeping them, so that the phase runs again instead of being skipped or
    resumed from them. (Changed settings are `Phases`' to notice.)"""
    written = mtime(marker)
    if written is None or not any((mtime(i) or 0) > written for i in inputs):
        return False
    set_aside(outputs, "older than its inputs")
    return True


def split_train(tasks_dir: str, n_sft: int, n_rl: int):
    """DIR/tasks/sft.jsonl and rl.jsonl: disjoint slices of train.jsonl (same folder, so relative paths hold)."""
    lines = [line for line in open(os.path.join(tasks_dir, "train.jsonl")) if line.strip()]
    if len(lines) < n_sft + n_rl:
        raise SystemExit(f"{tasks_dir}/train.jsonl holds {len(lines)} tasks; --sft-tasks + --rl-tasks need "
                         f"{n_sft + n_rl}")
    for name, part in (("sft", lines[:n_sft]), ("rl", lines[n_sft:n_sft + n_rl])):
        with open(os.path.join(tasks_dir, f"{name}.jsonl"), "w") as f:
            f.writelines(part)


def merge_rl_prompts(paths: list, out_path: str) -> str:
    """Several --rl-prompts files as one task file, in the order given (RL takes tasks in file order): each id
    prefixed with its file's position (f1-, f2-, ...: generator seeds reuse ids) and the repository and hidden-test
    paths made absolute (each file's relative paths resolve against its own folder). Rewritten only when its
    content changes, so that a re-run with the same files leaves its date, which dates the RL checkpoint's input,
    alone."""
    from megatron_ext.env.tasks import TaskError, load_tasks

    records = []
    for i, path in enumerate(paths, 1):
        try:
            records += [{**task.to_json(), "id": f"f{i}-{task.id}"} for task in load_tasks(path)]
        except TaskError as e:
            raise SystemExit(f"--rl-prompts: {e}") from None
    if os.path.exists(out_path) and open(out_path).read() == "".join(json.dumps(r) + "\n" for r in records):
        return out_path
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    return write_jsonl(records, out_path)


def only_heldout_shapes(tasks_file: str):
    """Refuses an --eval-heldout set holding a task whose program shape is not held out by the generator's split
    rule: SFT or RL may have trained on that shape, so success on it would not measure generalisation."""
    from megatron_ext.env.agent_tasks import is_heldout

    shapes = program_shapes(tasks_file)
    if not shapes:
        raise SystemExit(f"--eval-heldout {tasks_file}: holds no tasks")
    bad = [task for task, shape in shapes.items() if not shape or not is_heldout(shape)]
    if bad:
        raise SystemExit(f"--eval-heldout {tasks_file}: {len(bad)} task(s) have no held-out program shape "
                         f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}); give a heldout.jsonl that "
                         "tools/make_agent_tasks.py wrote (any --seed)")


def heldout_sets_effect(sets: list) -> list:
    """SFT against RL per held-out set and pooled over all of them: `sets` is [(label, sft run dir, rl run dir)];
    per set the mean over tasks of each task's share of passes solved, a 95% bootstrap interval over tasks, pass@K
    and the paired sign-flip p over tasks (benchmarks/rl_task_count.py's statistics); "all sets" pools the tasks
    (per-task means, so sets of different pass counts weigh each task alike)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from rl_task_count import per_task, point

    rows, pooled = [], ({}, {})
    for label, sft_dir, rl_dir in sets:
        sft, rl = per_task(sft_dir), per_task(rl_dir)
        rows.append({"set": label, "sft": point(sft, sft), "rl": point(sft, rl)})
        for side, runs in zip(pooled, (sft, rl)):
            side.update({f"{label}/{task}": v for task, v in runs.items()})
    if len(sets) > 1:
        rows.append({"set": "all sets", "sft": point(pooled[0], pooled[0]), "rl": point(pooled[0], pooled[1])})
    return rows


def mixed_corpus(code_corpus: str, extra: str | None, prefix: str) -> str:
    """The pretraining input: the code corpus, or it and `extra`'s documents shuffled together (seeded) into
    PREFIX's folder as mixed.jsonl."""
    if not extra:
        return code_corpus
    import random

    lines = [line if line.endswith("\n") else line + "\n" for path in (code_corpus, extra)
             for line in open(path) if line.strip()]
    random.Random(0).shuffle(lines)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    path = os.path.join(os.path.dirname(prefix), "mixed.jsonl")
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def renamed_conversations(sft_path: str, copies: int, seed: int, path: str) -> str:
    """`copies` renamed copies of each SFT conversation (agent_tasks.rename_identifiers), shuffled, in `path`."""
    import random

    from megatron_ext.env.agent_tasks import rename_identifiers

    rng = random.Random(f"sft-renamed:{seed}")
    records = [json.loads(line) for line in open(sft_path) if line.strip()]
    out = []
    for copy in range(copies):
        for record in records:
            renamed, _ = rename_identifiers(record, rng)
            out.append({**renamed, "id": f"{record.get('id', 'sft')}-renamed-{copy}"})
    rng.shuffle(out)
    return write_jsonl(out, path)


def code_lines(paths: list[str], limit: int = 200_000) -> list[str]:
    """Distinct non-blank code lines (under 80 characters, indentation kept) of the code-pretraining corpus's
    modules, or of the files the SFT conversations show: training-split programs only."""
    seen: dict[str, None] = {}
    for path in paths:
        for line in open(path):
            record = json.loads(line)
            texts = [record["text"]] if "text" in record else [
                m["content"] for m in record["messages"] if m["role"] == "tool" and isinstance(m.get("content"), str)]
            for text in texts:
                for x in text.splitlines():
                    x = re.sub(r"^ *\d+\t", "", x)  # read_file's line numbers
                    if x.strip() and len(x) < 80 and not x.startswith(("`", "files:", "[exit code", "edited ")):
                        seen.setdefault(x.rstrip())
                        if len(seen) >= limit:
                            return list(seen)
    return list(seen)


def with_copy_drills(sft_path: str, drills: int, seed: int, lines: list[str], path: str) -> str:
    """`sft_path`'s conversations and `drills` copy drills (agent_tasks.copy_drill), shuffled together, in `path`."""
    import random

    from megatron_ext.env.agent_tasks import copy_drill

    rng = random.Random(f"copy-drills:{seed}")
    records = [json.loads(line) for line in open(sft_path) if line.strip()]
    records += [{"id": f"drill-{k}", **copy_drill(rng, lines)} for k in range(drills)]
    rng.shuffle(records)
    return write_jsonl(records, path)


def write_jsonl(records: list[dict], path: str) -> str:
    """`records` as `path`, whole or not at all (a phase's output is its existence)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)
    return path


def tokenizer_corpus(out: str, sft_path: str, tasks_dir: str, code_corpus: str | None = None) -> str:
    """The text a tokenizer should cover: every SFT conversation's messages and calls, the RL tasks' files and the
    code-pretraining corpus (when there is one)."""
    path = os.path.join(out, "tokenizer_corpus.jsonl")
    with open(path, "w") as f:
        for line in open(sft_path):
            conversation = json.loads(line)
            for message in conversation["messages"]:
                text = message.get("content") or ""
                for call in message.get("tool_calls") or []:
                    text += "\n" + call["function"]["name"] + " " + call["function"]["arguments"]
                f.write(json.dumps({"text": text}) + "\n")
            f.write(json.dumps({"text": json.dumps(conversation.get("tools", []))}) + "\n")
        for line in open(os.path.join(tasks_dir, "rl.jsonl")):
            task = json.loads(line)
            repo = os.path.join(tasks_dir, task["repo"])
            f.write(json.dumps({"text": task["instruction"]}) + "\n")
            for base, _, names in os.walk(repo):
                for name in names:
                    if name.endswith(".py"):
                        f.write(json.dumps({"text": open(os.path.join(base, name)).read()}) + "\n")
        if code_corpus:
            with open(code_corpus) as g:
                f.writelines(g)
    return path


def oracle_read_paths(tasks_file: str, oracle_dir: str) -> dict:
    """task id -> the file its oracle reads (the one module a task's function lives in)."""
    paths = {}
    with open(tasks_file) as f:
        for line in f:
            task_id = json.loads(line)["id"]
            with open(os.path.join(oracle_dir, f"{task_id}.json")) as g:
                paths[task_id] = next(a["arguments"]["path"] for a in json.load(g) if a["name"] == "read_file")
    return paths


def first_reads(episodes: list, own: dict, trained: set) -> dict:
    """Where the first read_file of each episode went: the task's own module (copied from the instruction), a
    module of an SFT task (recalled from training), or elsewhere; the diagnosis of a policy that cannot copy."""
    where = {"own": 0, "sft_task": 0, "other": 0, "none": 0}
    for e in episodes:
        read = next((c for c in e["tool_calls"] if c["name"] == "read_file"), None)
        try:
            path = json.loads(read["arguments"]).get("path") if read else None
        except (ValueError, AttributeError):
            path = None
        key = "none" if read is None else "own" if path == own.get(e["task"]) else \
            "sft_task" if path in trained else "other"
        where[key] += 1
    return {k: v / max(len(episodes), 1) for k, v in where.items()}


def task_groups(tasks_file: str) -> dict:
    """task id -> (program depth: its primitives, kind) from the generated tasks' metadata."""
    out = {}
    with open(tasks_file) as f:
        for line in f:
            if line.strip():
                task = json.loads(line)
                meta = task.get("metadata") or {}
                shape = meta.get("program_shape")
                out[task["id"]] = (len(shape.split("|")) if shape else "?", meta.get("kind", "?"))
    return out


def program_shapes(tasks_file: str) -> dict:
    """task id -> the program shape its generator metadata names (None when it names none)."""
    tasks = [json.loads(line) for line in open(tasks_file) if line.strip()]
    return {task["id"]: (task.get("metadata") or {}).get("program_shape") for task in tasks}


def no_heldout_shapes(tasks_file: str, heldout_file: str):
    """Refuses RL tasks (--rl-prompts) whose program shape is one of the held-out tasks', or is held out by the
    generator's split rule (`agent_tasks.is_heldout` at the default fraction, which the benchmark generates with):
    RL on them would make a held-out evaluation, of this seed's tasks or of another seed's, a test of memory, not
    generalisation."""
    from megatron_ext.env.agent_tasks import is_heldout

    held = {shape for shape in program_shapes(heldout_file).values() if shape}
    given = program_shapes(tasks_file)
    unknown = sorted(task for task, shape in given.items() if not shape)
    if unknown:
        raise SystemExit(f"--rl-prompts {tasks_file}: {len(unknown)} task(s) name no program shape in their metadata "
                         f"({', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}), so they cannot be checked "
                         "against the held-out shapes; use tasks written by tools/make_agent_tasks.py")
    clash = sorted(task for task, shape in given.items() if shape in held or is_heldout(shape))
    if clash:
        raise SystemExit(f"--rl-prompts {tasks_file}: {len(clash)} task(s) have a held-out program shape "
                         f"({', '.join(clash[:5])}{', ...' if len(clash) > 5 else ''}); generate them with "
                         "tools/make_agent_tasks.py, whose training split never holds one")


def solved_by(outcomes: list, groups: dict) -> dict:
    """{"depth": {D: {"episodes", "solved"}}, "kind": {...}} over (task id, solved) pairs: held-out success falls
    with the number of primitives composed, which one mean hides."""
    out = {"depth": {}, "kind": {}}
    for task, solved in outcomes:
        for axis, key in zip(("depth", "kind"), groups.get(task, ("?", "?"))):
            cell = out[axis].setdefault(str(key), {"episodes": 0, "solved": 0})
            cell["episodes"] += 1
            cell["solved"] += int(solved)
    return {axis: dict(sorted(cells.items())) for axis, cells in out.items()}


def eval_metrics(run_dir: str, passes: int, own_paths: dict, sft_paths: set, groups: dict) -> dict:
    """What the issue asks per checkpoint, from run_eval's summary and episodes."""
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "episodes.jsonl")) if line.strip()]
    calls = [c for e in episodes for c in e["tool_calls"]]
    finished = [e for e in episodes if e["status"] == "finished"]

    def tested_before_finish(e) -> bool:
        names = [c["name"] for c in e["tool_calls"] if c["valid"]]
        return "finish" in names and any(
            n == "run_command" and "pytest" in json.loads(c["arguments"] or "{}").get("command", "")
            for n, c in zip(names, [c for c in e["tool_calls"] if c["valid"]]) if n == "run_command")

    def succeeded(name: str) -> float:  # calls of this tool that worked (a failed read or edit is invalid too)
        made = [c for c in calls if c["name"] == name]
        return sum(c["valid"] for c in made) / len(made) if made else 0.0

    solved = sum(1 for t in summary["per_task"].values() if max(t["correct"]) > 0)
    tasks = len(summary["per_task"])
    return {"success": summary["accuracy"], "success_ci": summary["accuracy_ci"],
            "success_wilson": summary["accuracy_wilson"],
            f"pass@{passes}": solved / tasks, f"pass@{passes}_ci": list(wilson(solved, tasks)),
            "episodes": len(episodes), "tasks": tasks,
            "valid_tool_call_rate": (sum(c["valid"] for c in calls) / len(calls)) if calls else 0.0,
            "tool_calls_per_episode": len(calls) / max(len(episodes), 1),
            "finished_rate": len(finished) / max(len(episodes), 1),
            # copying from the context: a read_file of an existing file, an edit_file whose old_text matched
            "read_file_ok_rate": succeeded("read_file"), "edit_file_ok_rate": succeeded("edit_file"),
            "first_read": first_reads(episodes, own_paths, sft_paths),
            "tests_before_finish_rate": sum(map(tested_before_finish, episodes)) / max(len(episodes), 1),
            "turns_per_episode": summary["efficiency"]["turns"],
            "output_tokens_per_episode": summary["efficiency"]["output_tokens"],
            "total_tokens_per_episode": summary["efficiency"]["total_tokens"],
            "forbidden_edits": sum(e["reward"].get("forbidden_edits", 0) for e in episodes),
            "solved_by": solved_by([(e["task"], e["reward"].get("correctness", 0.0) >= 1.0) for e in episodes],
                                   groups),
            "statuses": summary["statuses"]}


def rl_episodes(log_dir: str) -> list[dict]:
    """RL's training episodes in the order sampled (rollouts.jsonl holds one line per sampled sequence; an episode's
    reward parts are on its first sequence), read once for the curve, the depth split and the trained task ids."""
    with open(os.path.join(log_dir, "rollouts.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("sequence_index", 0) == 0]


def rl_solved_by(episodes: list[dict], groups: dict) -> dict:
    """solved_by over RL's training episodes."""
    return solved_by([(r["prompt_id"], (r.get("reward_parts") or {}).get("correctness", 0) >= 1) for r in episodes],
                     groups)


def rl_curve(episodes: list[dict]) -> list[dict]:
    """Per RL step: the mean total reward and the mean of each reward part over the step's episodes."""
    steps: dict[int, list] = {}
    for record in episodes:
        steps.setdefault(record["step"], []).append(record)
    curve = []
    for step in sorted(steps):
        records = steps[step]
        parts: dict[str, list] = {}
        for r in records:
            for k, v in (r.get("reward_parts") or {}).items():
                parts.setdefault(k, []).append(v)
        curve.append({"step": step, "reward": sum(r["reward"] for r in records) / len(records),
                      **{k: sum(v) / len(v) for k, v in sorted(parts.items()) if k != "length"}})
    return curve


def rl_split_effect(sft_run: str, rl_run: str, trained: set) -> dict:
    """SFT against RL on RL's own task file (run_eval's `--compare` pairing, `compare_pair`), separately over the
    tasks RL trained on and those it did not (the file's tail beyond --rl-iters x --prompts-per-step): whether RL
    learns at all (its trained tasks) apart from whether what it learns carries to unseen tasks."""
    from megatron_ext.eval.compare import compare_pair

    runs = [json.load(open(os.path.join(d, "summary.json"))) for d in (sft_run, rl_run)]
    out = {}
    for part, keep in (("trained", lambda t: t in trained), ("untrained", lambda t: t not in trained)):
        before, after = ({**s, "per_task": {t: v for t, v in s["per_task"].items() if keep(t)}} for s in runs)
        pair = compare_pair(before, after)
        out[part] = {"tasks": pair["shared_tasks"]} if not pair["shared_tasks"] else {
            "tasks": pair["shared_tasks"], "sft": pair["accuracy_a"], "rl": pair["accuracy_b"], "p": pair["p"],
            "test": pair["test"]}
    return out


RATE_PARTS = ("correctness", "tests_fraction", "communication")  # in [0, 1] per episode
COUNT_PARTS = ("invalid_calls", "repeated_calls", "unfinished_todos", "forbidden_edits")  # per episode
BEHAVIOUR = (("valid_tool_call_rate", "valid tool calls"), ("read_file_ok_rate", "read_file hit a file"),
             ("edit_file_ok_rate", "edit_file matched"), ("tests_before_finish_rate", "tests before finish"))


def plot(path: str, metrics: dict, curve: list, passes: int, title: str, split: dict | None = None,
         pooled: dict | None = None):
    """Held-out success per checkpoint (and, with --eval-rl-split, success on RL's own tasks, trained on and not;
    with --eval-heldout, success over every held-out set pooled), how the agent used its tools, and the reward's
    parts per RL step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(metrics)
    for offset, key, label in ((-0.15, "success", "mean over passes"), (0.15, f"pass@{passes}", f"pass@{passes}")):
        ys = [metrics[n][key] for n in names]
        cis = [metrics[n]["success_wilson" if key == "success" else key + "_ci"] for n in names]
        xs = [i + offset for i in range(len(names))]
        left.errorbar(xs, ys, yerr=[[y - c[0] for y, c in zip(ys, cis)], [c[1] - y for y, c in zip(ys, cis)]],
                      fmt="o", capsize=4, label=label)
    for part, marker in (("trained", "s"), ("untrained", "^")):
        c = (split or {}).get(part, {})
        if c.get("tasks") and names == ["sft", "rl"]:
            left.plot([0, 1], [c["sft"], c["rl"]], marker=marker, linestyle=":",
                      label=f"RL's {'own' if part == 'trained' else 'unseen'} tasks ({c['tasks']}), p = {c['p']:.2g}")
    if pooled and names == ["sft", "rl"]:
        ys = [pooled["sft"]["mean"], pooled["rl"]["mean"]]
        err = [[y - pooled[n]["low"] for y, n in zip(ys, names)], [pooled[n]["high"] - y for y, n in zip(ys, names)]]
        left.errorbar([0, 1], ys, yerr=err, fmt="D-", capsize=4, color="tab:green",
                      label=f"{pooled['set']} ({pooled['rl']['tasks']} tasks, bootstrap), p = {pooled['rl']['p']:.2g}")
    left.set_xticks(range(len(names)), names)
    left.set_xlim(-0.6, len(names) - 0.4)
    left.set_ylim(0, 1)
    left.set_ylabel("success (held-out: 95% Wilson interval)")
    left.legend()
    left.grid(alpha=0.3)
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        middle.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(BEHAVIOUR))],
                   [metrics[n][k] for k, _ in BEHAVIOUR], width, label=n)
    middle.set_xticks(range(len(BEHAVIOUR)), [label for _, label in BEHAVIOUR], fontsize=7)
    middle.set_ylim(0, 1)
    middle.set_ylabel("held-out episodes / calls")
    middle.legend()
    middle.grid(alpha=0.3, axis="y")
    steps = [c["step"] for c in curve]
    right.plot(steps, [c["reward"] for c in curve], marker="o", color="black", label="total reward")
    for key in RATE_PARTS:
        right.plot(steps, [c.get(key, 0.0) for c in curve], marker=".", label=key)
    right.set_xlabel("RL step")
    right.set_ylabel("mean per training episode")
    counts = right.twinx()
    for key in COUNT_PARTS:
        counts.plot(steps, [c.get(key, 0.0) for c in curve], linestyle="--", marker="x", label=f"{key} (right)")
    counts.set_ylabel("calls per training episode")
    lines = right.get_legend_handles_labels()
    more = counts.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7)
    right.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(title, 180), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --smoke: the pipeline at its smallest (every phase runs, nothing is expected to learn); these are its defaults,
# and a flag given on the command line still wins
SMOKE = dict(sft_tasks=12, rl_tasks=4, heldout=3, sft_iters=3, sft_batch=2, passes=1, corpus_tasks=100,
             pretrain_iters=2, pretrain_batch=4, group_size=2, prompts_per_step=2, ranks=1, max_turns=3,
             max_response_length=96, eval_max_tokens=48)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/agentic")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--smoke", action="store_true",
                   help="a few tasks and steps: checks the pipeline, not learning (sizes: " + ", ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()) + "; flags given still apply)")
    p.add_argument("--sft-tasks", type=int, default=400, help="train tasks whose oracle trajectories SFT learns")
    p.add_argument("--rl-tasks", type=int, default=48, help="train tasks RL sees (each once; disjoint from SFT's)")
    p.add_argument("--heldout", type=int, default=40, help="held-out tasks evaluated")
    p.add_argument("--task-kinds", default=None, help="tools/make_agent_tasks.py --kinds")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--model-flags", default="--model tiny --mtp-num-layers 0 --q-lora-rank 64 --kv-lora-rank 64 "
                                           "--qk-pos-emb-head-dim 16 --rotary-scaling-factor 1",
                   help="architecture flags (from scratch; the checkpoints record them)")
    p.add_argument("--seq-length", type=int, default=1536, help="context of SFT, RL and serving (a whole episode)")
    p.add_argument("--corpus-tasks", type=int, default=20000,
                   help="training-split tasks in the code-pretraining corpus (tools/make_agent_tasks.py --corpus)")
    p.add_argument("--pretrain-iters", type=int, default=600, help="code-pretraining steps (0: SFT from scratch)")
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--pretrain-seq-length", type=int, default=512,
                   help="pretraining context (a document is ~200 tokens; a token costs several times less than at "
                        "the episode's --seq-length on a CPU)")
    p.add_argument("--pretrain-batch", type=int, default=16, help="pretraining sequences per step")
    p.add_argument("--init", default=None,
                   help="start code pretraining from these weights (same architecture and tokenizer), e.g. a copy "
                        "warm-up: benchmarks/copy_probe.py --tokenizer-model DIR/tokenizer --save CKPT")
    p.add_argument("--pretrain-extra", default=None, metavar="JSONL",
                   help="more pretraining documents ({\"text\": ...} lines), shuffled into the code corpus (DIR/"
                        "pretrain/mixed.jsonl), e.g. a copy warm-up's own documents (copy_probe.py's OUT/copy.jsonl) "
                        "so that code pretraining from its --init keeps the skill")
    p.add_argument("--sft-renamed-copies", type=int, default=0, metavar="N",
                   help="SFT on N copies of each oracle conversation whose module, package and function names are "
                        "drawn afresh from the generator's pools (DIR/sft_renamed_xN.jsonl; the tokenizer still sees "
                        "DIR/sft.jsonl); 0: the conversations as played")
    p.add_argument("--sft-recovery", action="store_true",
                   help="add a recovery conversation of each SFT task (tools/build_agent_sft.py --recovery: a wrong "
                        "first edit kept as untrained context, the failing test run, the fix; DIR/sft_recovery.jsonl)"
                        ": the oracles alone only ever pass their first run, so after a failing one the policy stops; "
                        "the tokenizer still sees DIR/sft.jsonl")
    p.add_argument("--sft-copy-drills", type=int, default=0, metavar="N",
                   help="mix N copy drills into SFT (DIR/sft_drills_xN.jsonl): short conversations in which the "
                        "assistant writes back paths, function names and code lines the user lists, the copying "
                        "an episode needs, packed densely (agent_tasks.copy_drill)")
    p.add_argument("--sft-iters", type=int, default=200)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--rl-prompts", action="append", default=None, metavar="JSONL",
                   help="RL's tasks from this task file instead of the benchmark's own split (DIR/tasks/rl.jsonl), "
                        "e.g. tools/make_agent_tasks.py run with another seed, filtered: as many distinct tasks as "
                        "RL needs without regenerating (and re-running SFT on) the benchmark's tasks; refused if a "
                        "task has a held-out program shape; --rl-tasks still sizes the benchmark's own split. "
                        "Repeat it for several files (other seeds): RL takes their tasks in the order given, merged "
                        "into DIR/rl_prompts.jsonl with ids prefixed f1-, f2-, ... by file")
    p.add_argument("--rl-iters", type=int, default=None, help="RL steps (default: every RL task once)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=1e-3)
    p.add_argument("--kl-beta", type=float, default=0.001)
    p.add_argument("--max-response-length", type=int, default=384, help="model tokens per episode")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--env-reward-weight", action="append", default=[], metavar="NAME=VALUE",
                   help="an RL reward weight other than the environment's default (repeatable; rl_composer.py "
                        "--env-reward-weight), e.g. tests_fraction=0.5: partial credit for the hidden tests an "
                        "attempt passes")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the evaluation and, unless --rl-temperature says otherwise, of RL's "
                        "rollouts")
    p.add_argument("--rl-temperature", type=float, default=None,
                   help="sampling temperature of RL's rollouts only (rl_composer.py --rl-temperature; the trainer's "
                        "log-probabilities use it too), so that a nearly deterministic SFT policy's groups differ "
                        "while the evaluation keeps --temperature (default: --temperature)")
    p.add_argument("--passes", type=int, default=4, help="K: evaluation passes per held-out task")
    p.add_argument("--eval-max-tokens", type=int, default=160, help="tokens per model turn in evaluation")
    p.add_argument("--eval-rl-split", type=int, default=0, metavar="K",
                   help="also evaluate both checkpoints on RL's own task file (DIR/tasks/rl.jsonl or "
                        "--rl-prompts), K passes a task (DIR/eval/{sft,rl}_rl_split): SFT against RL over the tasks "
                        "RL trained on and, apart, over those it did not (the file's tail beyond --rl-iters x "
                        "--prompts-per-step tasks), paired per task; says whether RL learns at all and whether it "
                        "carries to unseen tasks (0: not run)")
    p.add_argument("--eval-heldout", action="append", default=[], metavar="JSONL",
                   help="another held-out task set (a heldout.jsonl of tools/make_agent_tasks.py with another --seed; "
                        "repeatable): both checkpoints are evaluated on it too, --eval-heldout-passes passes a task "
                        "(DIR/eval/{sft,rl}_heldout_N), and the report pools it with the benchmark's own held-out "
                        "tasks (paired per task): a larger test than one seed's --heldout tasks; refused if a task's "
                        "program shape is not held out")
    p.add_argument("--eval-heldout-passes", type=int, default=2, metavar="K",
                   help="passes per task of the --eval-heldout sets")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks of SFT and RL (torchrun)")
    p.add_argument("--rollout-workers", type=int, default=0,
                   help="the asynchronous path: RL rollouts on this many Ray workers (rl_composer.py "
                        "--rl-rollout-workers; 0: colocated on the trainer's ranks)")
    p.add_argument("--max-staleness", type=int, default=1, help="with --rollout-workers: --rl-max-staleness")
    p.add_argument("--rl-env", default="coding", choices=("coding", "swarm"),
                   help="swarm: RL as an orchestrator with sub-agents (the --swarm-* defaults; the SFT stays "
                        "single-agent)")
    p.add_argument("--plot", default=None, help="the figure (default: docs/agentic_learning.png; with --smoke: "
                                                "DIR/agentic_learning.png)")
    if p.parse_known_args(argv)[0].smoke:
        p.set_defaults(**SMOKE)
    a = p.parse_args(argv)
    for flag, value in (("--temperature", a.temperature), ("--rl-temperature", a.rl_temperature)):
        if value is not None and value <= 0:
            p.error(f"{flag} must be positive (got {value:g}): RL and the evaluation sample")
    if a.eval_rl_split < 0:
        p.error(f"--eval-rl-split is a number of passes (got {a.eval_rl_split})")
    if a.eval_heldout_passes < 1:
        p.error(f"--eval-heldout-passes must be at least 1 (got {a.eval_heldout_passes})")
    for flag, paths in (("--rl-prompts", a.rl_prompts or []), ("--eval-heldout", a.eval_heldout)):
        for path in paths:
            if not os.path.isfile(path):
                p.error(f"{flag} {path}: no such file")
    if a.plot is None:
        a.plot = os.path.join(a.out, "agentic_learning.png") if a.smoke else os.path.join(ROOT, "docs",
                                                                                          "agentic_learning.png")
    return a


def main(argv=None):
    a = parse_args(argv)
    out = os.path.abspath(a.out)
    tasks_dir, tokenizer = os.path.join(out, "tasks"), os.path.join(out, "tokenizer")
    if not a.rl_prompts:
        rl_tasks = os.path.join(tasks_dir, "rl.jsonl")
    elif len(a.rl_prompts) == 1:
        rl_tasks = os.path.abspath(a.rl_prompts[0])
    else:
        rl_tasks = merge_rl_prompts([os.path.abspath(path) for path in a.rl_prompts],
                                    os.path.join(out, "rl_prompts.jsonl"))
    extra_heldout = [os.path.abspath(path) for path in a.eval_heldout]
    for path in extra_heldout:
        only_heldout_shapes(path)
    if a.rl_iters is None:
        a.rl_iters = (len(task_groups(rl_tasks)) if a.rl_prompts else a.rl_tasks) // a.prompts_per_step
    sft_data = os.path.join(out, "sft.jsonl")
    sft_ckpt, rl_ckpt = os.path.join(out, "ckpt", "sft"), os.path.join(out, "ckpt", "rl")
    rl_logs, eval_dir = os.path.join(out, "rl_logs"), os.path.join(out, "eval")
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    log = lambda name: os.path.join(out, "logs", name + ".log")  # noqa: E731
    py = [sys.executable, "-W", "ignore"]
    model = a.model_flags.split() + ["--seq-length", a.seq_length, "--max-position-embeddings", a.seq_length]
    if "--original-max-position-embeddings" not in model:  # plain RoPE over the whole episode unless told otherwise
        model += ["--original-max-position-embeddings", a.seq_length]
    code_corpus = os.path.join(tasks_dir, "corpus.jsonl") if a.pretrain_iters else None
    # the same architecture at the pretraining context (RoPE's positions are relative: SFT then runs it longer)
    pretrain_model = [str(a.pretrain_seq_length) if prev == "--seq-length" else v
                      for prev, v in zip([None] + model[:-1], model)]
    pretrain_ckpt, pretrain_data = os.path.join(out, "ckpt", "pretrain"), os.path.join(out, "pretrain", "corpus")
    phases = Phases(out)

    def make_tasks():
        kinds = ["--kinds", a.task_kinds] if a.task_kinds else []
        corpus = ["--corpus", code_corpus, "--corpus-tasks", a.corpus_tasks] if code_corpus else []
        run(py + ["tools/make_agent_tasks.py", "--out", tasks_dir, "--seed", a.seed, "--train",
                  a.sft_tasks + a.rl_tasks, "--heldout", a.heldout, *kinds, *corpus], log("tasks"))
        split_train(tasks_dir, a.sft_tasks, a.rl_tasks)

    phases("tasks", lambda: os.path.exists(os.path.join(tasks_dir, "rl.jsonl")) and
           (code_corpus is None or os.path.exists(code_corpus)), make_tasks, outputs=[tasks_dir],
           settings=dict(seed=a.seed, sft_tasks=a.sft_tasks, rl_tasks=a.rl_tasks, heldout=a.heldout,
                         task_kinds=a.task_kinds, corpus_tasks=a.corpus_tasks if code_corpus else None))
    phases("sft_data", lambda: os.path.exists(sft_data), lambda: run(
        py + ["tools/build_agent_sft.py", "--tasks", os.path.join(tasks_dir, "sft.jsonl"), "--oracle",
              os.path.join(tasks_dir, "oracle"), "--output", sft_data, "--concurrency", 2, *PROMPT_OPTIONS],
        log("sft_data")), settings=dict(prompt=PROMPT_OPTIONS), after=["tasks"], outputs=[sft_data])
    phases("tokenizer", lambda: os.path.exists(os.path.join(tokenizer, "tokenizer.json")), lambda: run(
        py + ["tools/train_tokenizer.py", "--input", tokenizer_corpus(out, sft_data, tasks_dir, code_corpus),
              "--vocab-size", a.vocab_size, "--output", tokenizer], log("tokenizer")),
        settings=dict(vocab_size=a.vocab_size), after=["tasks", "sft_data"], outputs=[tokenizer])
    if code_corpus:
        extra = dict(pretrain_extra=a.pretrain_extra, modified=mtime(a.pretrain_extra) if a.pretrain_extra else None)
        phases("pretrain_data", lambda: os.path.exists(pretrain_data + "_text_document.idx"), lambda: run(
            py + ["tools/preprocess_data.py", "--input", mixed_corpus(code_corpus, a.pretrain_extra, pretrain_data),
                  "--output-prefix", pretrain_data,
                  "--tokenizer-type", "HFTokenizer", "--tokenizer-model", tokenizer, "--workers", 1, "--append-eod"],
            log("pretrain_data")), settings=extra, after=["tasks", "tokenizer"],
            outputs=[os.path.dirname(pretrain_data)])
    done = lambda ckpt, iters: lambda: saved_iteration(ckpt) == iters  # noqa: E731
    # a signalled phase's ranks finish their step and save: an RL step here takes over a minute, and torchrun's
    # default wait before SIGKILL is 30 s
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--shutdown-timeout", 600, "--nproc-per-node"]
    launcher = lambda ranks: py + (torchrun + [ranks] if ranks > 1 else [])  # noqa: E731
    seed = dict(seed=a.seed)
    if code_corpus:
        set_aside_if_stale([pretrain_ckpt], saved_marker(pretrain_ckpt), [pretrain_data + "_text_document.idx"])
        phases("pretrain", done(pretrain_ckpt, a.pretrain_iters), lambda: run(
            launcher(a.ranks) + [
                "pretrain_composer.py", *pretrain_model, "--data-path", pretrain_data + "_text_document",
                  "--tokenizer-model", tokenizer, "--micro-batch-size", max(1, a.pretrain_batch // a.ranks),
                  "--global-batch-size", a.pretrain_batch, "--lr", a.pretrain_lr,
                  "--min-lr", a.pretrain_lr / 10, "--lr-warmup-iters", max(1, a.pretrain_iters // 15),
                  "--lr-decay-style", "cosine", "--train-iters", a.pretrain_iters, "--split", "98,2,0",
                  "--eval-interval", a.pretrain_iters, "--eval-iters", 1, "--log-interval",
                  max(1, a.pretrain_iters // 10), "--save", pretrain_ckpt,
                  "--save-interval", save_interval(a.pretrain_iters),
                  "--seed", a.seed, *resume_or(pretrain_ckpt, ["--load", a.init, "--finetune"] if a.init else [])],
            log("pretrain")), after=["pretrain_data"], outputs=[pretrain_ckpt],
            settings=dict(model=pretrain_model, iters=a.pretrain_iters, lr=a.pretrain_lr, batch=a.pretrain_batch,
                          init=a.init, **seed))
    init = ["--load", pretrain_ckpt, "--finetune"] if code_corpus else []
    sft_input, sft_source = sft_data, "sft_data"
    if a.sft_recovery:
        recovery = os.path.join(out, "sft_recovery.jsonl")
        phases("sft_recovery", lambda: os.path.exists(recovery), lambda: run(
            py + ["tools/build_agent_sft.py", "--tasks", os.path.join(tasks_dir, "sft.jsonl"), "--oracle",
                  os.path.join(tasks_dir, "oracle"), "--output", recovery, "--recovery", "--seed", a.seed,
                  "--concurrency", 2, *PROMPT_OPTIONS], log("sft_recovery")),
            settings=dict(prompt=PROMPT_OPTIONS, **seed), after=["tasks"], outputs=[recovery])
        sft_input, sft_source = os.path.join(out, "sft_with_recovery.jsonl"), "sft_with_recovery"
        set_aside_if_stale([sft_input], sft_input, [sft_data, recovery])
        phases("sft_with_recovery", lambda: os.path.exists(sft_input), lambda: write_jsonl(
            [json.loads(line) for path in (sft_data, recovery) for line in open(path) if line.strip()], sft_input),
            after=["sft_data", "sft_recovery"], outputs=[sft_input])
    if a.sft_renamed_copies:
        source, sft_input = sft_input, os.path.join(out, f"sft_renamed_x{a.sft_renamed_copies}.jsonl")
        set_aside_if_stale([sft_input], sft_input, [source])
        phases("sft_renamed", lambda: os.path.exists(sft_input),
               lambda: renamed_conversations(source, a.sft_renamed_copies, a.seed, sft_input),
               settings=dict(copies=a.sft_renamed_copies, **seed), after=[sft_source], outputs=[sft_input])
        sft_source = "sft_renamed"
    if a.sft_copy_drills:
        source, sft_input = sft_input, os.path.join(out, f"sft_drills_x{a.sft_copy_drills}.jsonl")
        set_aside_if_stale([sft_input], sft_input, [source])
        phases("sft_drills", lambda: os.path.exists(sft_input), lambda: with_copy_drills(
            source, a.sft_copy_drills, a.seed, code_lines([code_corpus] if code_corpus else [sft_data]), sft_input),
            settings=dict(drills=a.sft_copy_drills, **seed), after=["tasks", "sft_data", sft_source],
            outputs=[sft_input])
        sft_source = "sft_drills"
    set_aside_if_stale([sft_ckpt], saved_marker(sft_ckpt),
                       [sft_input] + ([saved_marker(pretrain_ckpt)] if code_corpus else []))
    phases("sft", done(sft_ckpt, a.sft_iters), lambda: run(
        launcher(a.ranks) + [
            "pretrain_composer.py", *model, *resume_or(sft_ckpt, init), "--sft", "--data-path", sft_input,
              "--tokenizer-model", tokenizer,
              *PROMPT_OPTIONS, "--micro-batch-size", 1, "--global-batch-size", a.sft_batch, "--lr", a.sft_lr,
              "--min-lr", a.sft_lr / 10, "--lr-warmup-iters", max(1, a.sft_iters // 20), "--lr-decay-style",
              "cosine", "--train-iters", a.sft_iters, "--split", "95,5,0", "--eval-interval", a.sft_iters,
              "--eval-iters", 1, "--log-interval", max(1, a.sft_iters // 10), "--save", sft_ckpt,
              "--save-interval", save_interval(a.sft_iters), "--seed", a.seed], log("sft")),
        settings=dict(model=model, iters=a.sft_iters, lr=a.sft_lr, batch=a.sft_batch, prompt=PROMPT_OPTIONS, **seed),
        after=["tokenizer", sft_source] + (["pretrain"] if code_corpus else []), outputs=[sft_ckpt])
    rl_temperature = a.temperature if a.rl_temperature is None else a.rl_temperature
    async_flags = ["--rl-rollout-workers", a.rollout_workers, "--rl-max-staleness", a.max_staleness] \
        if a.rollout_workers else []
    if a.rl_prompts:
        no_heldout_shapes(rl_tasks, os.path.join(tasks_dir, "heldout.jsonl"))
    set_aside_if_stale([rl_ckpt, rl_logs], saved_marker(rl_ckpt), [saved_marker(sft_ckpt), rl_tasks])
    phases("rl", done(rl_ckpt, a.rl_iters), lambda: run(
        launcher(a.ranks) + [
            "rl_composer.py", "--rl-env", a.rl_env, *async_flags, "--rl-prompts", rl_tasks,
                    "--tokenizer-model", tokenizer, *resume_or(rl_ckpt, ["--load", sft_ckpt, "--finetune"]),
                    "--use-checkpoint-args",
                    *PROMPT_OPTIONS, "--seq-length", a.seq_length, "--save", rl_ckpt, "--rl-log-dir", rl_logs,
                    "--train-iters", a.rl_iters, "--save-interval", max(1, min(5, a.rl_iters)),
                    "--lr", a.rl_lr, "--lr-decay-style", "constant",
                    "--grpo-group-size", a.group_size, "--grpo-prompts-per-step", a.prompts_per_step,
                    "--grpo-max-response-length", a.max_response_length, "--grpo-kl-beta", a.kl_beta,
                    "--rl-max-turns", a.max_turns, "--rl-temperature", rl_temperature, "--log-interval", 1,
                    *[f"--env-reward-weight={w}" for w in a.env_reward_weight], "--seed", a.seed],
        log("rl")), after=["tasks", "sft"], outputs=[rl_ckpt, rl_logs],
        settings=dict(env=a.rl_env, async_flags=async_flags, iters=a.rl_iters, lr=a.rl_lr, kl_beta=a.kl_beta,
                      group_size=a.group_size, prompts_per_step=a.prompts_per_step, seq_length=a.seq_length,
                      max_response_length=a.max_response_length, max_turns=a.max_turns, prompt=PROMPT_OPTIONS,
                      temperature=rl_temperature, reward_weights=sorted(a.env_reward_weight), **seed,
                      **({"rl_prompts": rl_tasks if len(a.rl_prompts) == 1 else
                          [os.path.abspath(path) for path in a.rl_prompts]} if a.rl_prompts else {})))

    def evaluate(phase: str, ckpt: str, ckpt_phase: str, tasks: str, passes: int, run_dir: str, **settings):
        """run_eval of a checkpoint on a task file, the benchmark's sampling, with the local agent."""
        set_aside_if_stale([run_dir], os.path.join(run_dir, "run.json"), [saved_marker(ckpt), tasks])
        phases(phase, lambda: os.path.exists(os.path.join(run_dir, "summary.json")), lambda: run(
            py + ["tools/run_eval.py", "--tasks", tasks, "--agent", f"local:{ckpt}",
                  "--serve-arg=--tokenizer-model", f"--serve-arg={tokenizer}", "--passes", passes,
                  "--temperature", a.temperature, "--max-tokens", a.eval_max_tokens, "--max-turns", a.max_turns,
                  "--concurrency", 2, "--out", run_dir], log(phase)),
            settings=dict(passes=passes, max_tokens=a.eval_max_tokens, max_turns=a.max_turns,
                          temperature=a.temperature, **settings),
            after=["tasks", "tokenizer", ckpt_phase], outputs=[run_dir])

    heldout = os.path.join(tasks_dir, "heldout.jsonl")
    for name, ckpt in (("sft", sft_ckpt), ("rl", rl_ckpt)):
        evaluate(f"eval_{name}", ckpt, name, heldout, a.passes, os.path.join(eval_dir, name))
    heldout_oracle = os.path.join(out, "heldout_oracle.jsonl")
    phases("heldout_oracle", lambda: os.path.exists(heldout_oracle), lambda: run(
        py + ["tools/build_agent_sft.py", "--tasks", heldout, "--oracle", os.path.join(tasks_dir, "oracle"),
              "--output", heldout_oracle, "--concurrency", 2, *PROMPT_OPTIONS], log("heldout_oracle")),
        settings=dict(prompt=PROMPT_OPTIONS), after=["tasks"], outputs=[heldout_oracle])
    for name, ckpt in (("sft", sft_ckpt), ("rl", rl_ckpt)):
        turns_path = os.path.join(eval_dir, name, "turns.json")
        set_aside_if_stale([turns_path], turns_path, [saved_marker(ckpt), heldout_oracle])
        phases(f"turns_{name}", lambda turns_path=turns_path: os.path.exists(turns_path),
               lambda ckpt=ckpt, turns_path=turns_path: run(
            py + ["benchmarks/agent_turns.py", "--load", ckpt, "--tokenizer-model", tokenizer, "--conversations",
                  heldout_oracle, "--out", turns_path], log(f"turns_{name}")),
            after=["tokenizer", "heldout_oracle", name, f"eval_{name}"], outputs=[turns_path])
    compare_dir = os.path.join(eval_dir, "compare")
    set_aside_if_stale([compare_dir], os.path.join(compare_dir, "compare.json"),
                       [os.path.join(eval_dir, name, "summary.json") for name in ("sft", "rl")])
    phases("compare", lambda: os.path.exists(os.path.join(compare_dir, "compare.json")), lambda: run(
        py + ["tools/run_eval.py", "--compare", os.path.join(eval_dir, "sft"), os.path.join(eval_dir, "rl"),
              "--out", compare_dir], log("compare")), after=["eval_sft", "eval_rl"], outputs=[compare_dir])

    for name, ckpt in (("sft", sft_ckpt), ("rl", rl_ckpt)) if a.eval_rl_split else ():
        evaluate(f"eval_{name}_rl_split", ckpt, name, rl_tasks, a.eval_rl_split,
                 os.path.join(eval_dir, f"{name}_rl_split"))

    for i, path in enumerate(extra_heldout, 1):
        for name, ckpt in (("sft", sft_ckpt), ("rl", rl_ckpt)):
            evaluate(f"eval_{name}_heldout_{i}", ckpt, name, path, a.eval_heldout_passes,
                     os.path.join(eval_dir, f"{name}_heldout_{i}"), heldout=path)
    runs = lambda suffix: (os.path.join(eval_dir, "sft" + suffix), os.path.join(eval_dir, "rl" + suffix))  # noqa: E731
    heldout_sets = heldout_sets_effect(
        [(f"--seed {a.seed}'s held-out tasks", *runs(""))]
        + [(f"--eval-heldout {path}", *runs(f"_heldout_{i}")) for i, path in enumerate(extra_heldout, 1)]
    ) if extra_heldout else None

    oracle_dir = os.path.join(tasks_dir, "oracle")
    own_paths = oracle_read_paths(heldout, oracle_dir)
    sft_paths = set(oracle_read_paths(os.path.join(tasks_dir, "sft.jsonl"), oracle_dir).values())
    groups = task_groups(heldout)
    metrics = {name: eval_metrics(os.path.join(eval_dir, name), a.passes, own_paths, sft_paths, groups)
               for name in ("sft", "rl")}
    for name in ("sft", "rl"):
        with open(os.path.join(eval_dir, name, "turns.json")) as f:
            metrics[name]["teacher_forced"] = {tool: {k: r[k] for k in ("turns", "exact_rate", "token_accuracy")}
                                               for tool, r in json.load(f)["per_tool"].items()}
    compared = json.load(open(os.path.join(compare_dir, "compare.json")))
    episodes = rl_episodes(rl_logs)
    curve = rl_curve(episodes)
    rl_solved = rl_solved_by(episodes, task_groups(rl_tasks))
    split = rl_split_effect(os.path.join(eval_dir, "sft_rl_split"), os.path.join(eval_dir, "rl_rl_split"),
                            {r["prompt_id"] for r in episodes}) if a.eval_rl_split else None
    summary = {"settings": {k: v for k, v in vars(a).items() if k != "plot"}, "heldout": metrics,
               "compare": compared, "heldout_sets": heldout_sets, "rl_curve": curve, "rl_solved_by": rl_solved,
               "rl_split": split,
               "wall_s": phases.seconds}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(markdown(metrics, compared, curve, phases.seconds, a.passes, rl_solved, split, a.eval_rl_split,
                   heldout_sets))
    if a.plot:
        plot(a.plot, metrics, curve, a.passes,
             f"tiny K2.5 ({a.model_flags}): code pretraining {a.pretrain_iters} steps, "
             f"SFT on {a.sft_tasks} oracle episodes"
             + (f" x {a.sft_renamed_copies} renamed" if a.sft_renamed_copies else "")
             + (f" + {a.sft_copy_drills} copy drills" if a.sft_copy_drills else "")
             + f" ({a.sft_iters} steps), GRPO on {a.rl_iters * a.prompts_per_step} tasks x "
             f"{a.group_size}" + (f" at T={a.rl_temperature:g}" if a.rl_temperature is not None else "")
             + f"; held-out: {a.heldout} tasks x {a.passes} passes at T={a.temperature:g}", split,
             heldout_sets[-1] if heldout_sets else None)
        print(f"plot: {a.plot}")
    return 0


def solved_line(cells: dict) -> str:
    return ", ".join(f"{key} {c['solved']}/{c['episodes']}" for key, c in cells.items())


def markdown(metrics: dict, compared: dict, curve: list, seconds: dict, passes: int, rl_solved: dict,
             split: dict | None = None, split_passes: int = 0, heldout_sets: list | None = None) -> str:
    fmt_ci = lambda v, ci: f"{v:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"  # noqa: E731
    rows = ["| checkpoint | held-out success (mean of K, 95% Wilson) | pass@K (95% Wilson) | valid tool calls | "
            "tests run before finish | turns / episode | output tokens / episode | forbidden edits |",
            "|---|---|---|---|---|---|---|---|"]
    for name, m in metrics.items():
        rows.append(f"| {name} | {fmt_ci(m['success'], m['success_wilson'])} | "
                    f"{fmt_ci(m[f'pass@{passes}'], m[f'pass@{passes}_ci'])} | {m['valid_tool_call_rate']:.3f} | "
                    f"{m['tests_before_finish_rate']:.3f} | {m['turns_per_episode']:.2f} | "
                    f"{m['output_tokens_per_episode']:.0f} | {m['forbidden_edits']:.0f} |")
    rows.append("")
    for name, m in metrics.items():
        r = m["first_read"]
        rows.append(f"first read_file of a {name} episode: the task's own module {r['own']:.2f}, a module of an SFT "
                    f"task {r['sft_task']:.2f}, elsewhere {r['other']:.2f}, no read {r['none']:.2f}")
    rows.append("")
    for name, m in metrics.items():
        rows.append(f"held-out episodes solved by a {name} policy, by program depth: "
                    f"{solved_line(m['solved_by']['depth'])}; by kind: {solved_line(m['solved_by']['kind'])}")
    rows.append(f"RL's training episodes solved, by program depth: {solved_line(rl_solved['depth'])}; by kind: "
                f"{solved_line(rl_solved['kind'])}")
    rows.append("")
    tools = sorted({t for m in metrics.values() for t in m.get("teacher_forced", {})})
    if tools:
        rows.append("| teacher-forced held-out oracle turns written verbatim (greedy) | " + " | ".join(tools) + " |")
        rows.append("|---|" + "---|" * len(tools))
        for name, m in metrics.items():
            tf = m.get("teacher_forced", {})
            rows.append(f"| {name} | " + " | ".join(
                f"{tf[t]['exact_rate']:.3f} (tokens {tf[t]['token_accuracy']:.3f})" if t in tf else "-"
                for t in tools) + " |")
        rows.append("")
    pair = compared["against_baseline"]["rl"]
    rows.append("")
    rows.append(f"compare, RL against SFT over {pair['shared_tasks']} held-out tasks: accuracy "
                f"{pair['accuracy_a']:.3f} -> {pair['accuracy_b']:.3f}, p = {pair['p']:.4g} ({pair['test']})")
    if heldout_sets:
        rows += ["", "| held-out set | tasks | SFT success (95% CI) | RL success (95% CI) | p (paired over tasks) | "
                 "pass@K SFT -> RL |", "|---|---|---|---|---|---|"]
        for r in heldout_sets:
            sft, rl = r["sft"], r["rl"]
            rows.append(f"| {r['set']} | {rl['tasks']} | {sft['mean']:.3f} [{sft['low']:.3f}, {sft['high']:.3f}] | "
                        f"{rl['mean']:.3f} [{rl['low']:.3f}, {rl['high']:.3f}] | {rl['p']:.3g} | "
                        f"{sft['pass_at_k']:.3f} -> {rl['pass_at_k']:.3f} |")
    if split:
        rows.append("")
        parts = (("trained on", split["trained"]), ("not trained on", split["untrained"]))
        passes_a_task = f"{split_passes} pass{'es' if split_passes != 1 else ''} a task"
        rows.append(f"RL's own task split, {passes_a_task}, SFT -> RL: " + "; ".join(
            f"{label} {c['tasks']} tasks {c['sft']:.3f} -> {c['rl']:.3f}, p = {c['p']:.4g}" if c["tasks"] else
            f"{label}: none" for label, c in parts))
    rows.append("")
    rows.append("| RL step | reward | " + " | ".join(k for k in curve[0] if k not in ("step", "reward")) + " |"
                if curve else "")
    if curve:
        keys = [k for k in curve[0] if k not in ("step", "reward")]
        rows.append("|---|---|" + "---|" * len(keys))
        for c in curve:
            rows.append(f"| {c['step']} | {c['reward']:.3f} | " + " | ".join(f"{c.get(k, 0):.3f}" for k in keys)
                        + " |")
    rows.append("")
    rows.append("wall time per phase (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
