"""Run an agent over a task suite, K passes each, N episodes at a time, resumably.

    tasks x passes --(skip those with a result file)--> thread pool (N) --> run_episode (the environment's episode
    code: sandbox, tools, grading in a fresh sandbox, reward parts) --> usage (tokens by category) -->
    RUN/episodes/<task>/pass-<k>.json, written atomically as each episode finishes --> progress line

A run directory holds `run.json` (the suite, the agent and the task ids it was started with) and one file per
finished episode. Resuming (the same command again, also after kill -9) runs only the episodes without a file;
more --passes adds passes (fewer keeps the stored ones: `start` returns the passes the run holds). The manifest is
written only once the agent is ready (`check` first refuses a directory that holds another run without writing),
so a run that fails to start leaves nothing behind. An episode that could not run at all (a sandbox that failed to start, an agent server
that could not be reached) writes nothing and is retried on the next resume. Episodes share nothing but the agent factory, so threads suffice: the work
happens in sandboxed subprocesses and in the model server.

With a `SwarmSetup` (--agent-mode swarm) each episode is an orchestrator's (megatron_ext/env/swarm.py
run_swarm_episode): the record adds critical_steps, total_steps, stages, the swarm statistics and the sub-agents'
transcripts, and its usage counts the sub-agents' tokens too (`usage_by_role` splits them). A sub-agent server
that cannot be reached makes the episode unstored and retried, as the orchestrator's does.

An episode whose test command could not be started (exit 126/127 from the grading shell: a missing test runner)
says nothing about the agent either: it is reported as could-not-run, naming the task and the command, instead of
being stored as wrong. ``episode_timeout_s`` ends an episode at the agent's first turn after that many seconds (a
command already running is bounded by the task's command_timeout_s); it is graded as it stands, with status
``episode_timeout``.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import sys
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Optional

from megatron_ext.atomic import atomic_output
from megatron_ext.env.episode import EpisodeConfig, approx_tokens, run_episode
from megatron_ext.env.tasks import Task
from megatron_ext.env.tools import TOOL_SCHEMAS, declarations
from megatron_ext.eval.agents import AgentFactory, SwarmSetup
from megatron_ext.eval.usage import episode_usage

MANIFEST = "run.json"
EPISODES = "episodes"


# what a manifest written before a key existed meant by leaving it out
PINNED_DEFAULTS = {"agent_mode": "single", "swarm": None, "limits": None, "tool_declarations": "full"}
PINNED = ("agent", "model", "task_ids", "agent_mode", "swarm", "limits", "tool_declarations", "sampling")
NOT_STARTED = (126, 127)  # /bin/sh: the test command is not executable / not found


class RunError(RuntimeError):
    """A run directory that cannot be used for this run; the message says why and what to do."""


def episode_dir(task_id: str) -> str:
    """A file-system-safe folder name for a task id (readable prefix + hash, so distinct ids never collide)."""
    slug = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in task_id)[:80].lstrip(".") or "task"
    return f"{slug}-{hashlib.sha1(task_id.encode()).hexdigest()[:8]}"


class RunDir:
    """RUN/run.json and RUN/episodes/<task>/pass-<k>.json."""

    def __init__(self, root: str):
        self.root = root

    def manifest_path(self) -> str:
        return os.path.join(self.root, MANIFEST)

    def episode_path(self, task_id: str, index: int) -> str:
        return os.path.join(self.root, EPISODES, episode_dir(task_id), f"pass-{index}.json")

    def manifest(self) -> Optional[dict]:
        try:
            with open(self.manifest_path()) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise RunError(f"{self.manifest_path()}: unreadable ({e}); remove the run directory to start again")

    def check(self, manifest: dict) -> Optional[dict]:
        """Refuse (RunError) a directory that holds something else than this run; writes nothing. Returns the
        existing manifest (None for a new run)."""
        old = self.manifest()
        if old is None:
            if os.path.isdir(self.root) and os.listdir(self.root):
                raise RunError(f"--out {self.root} exists and is not an evaluation run (no {MANIFEST}); "
                               "choose an empty or new directory")
            return None
        for key in PINNED:
            if key not in old and key not in PINNED_DEFAULTS:
                continue  # recorded since, with nothing to say what an older run used (its sampling): not checked
            if old.get(key, PINNED_DEFAULTS.get(key)) != manifest.get(key, PINNED_DEFAULTS.get(key)):
                raise RunError(f"--out {self.root} holds a run with another {key} ({str(old.get(key))[:200]}); "
                               "resume it with the same --tasks/--agent/--model/--agent-mode/--swarm-*/--filter/"
                               "--task-ids/--max-turns/--episode-timeout-s/--env-tool-declarations/--temperature/"
                               "--max-tokens, or choose another --out")
        return old

    def start(self, manifest: dict) -> int:
        """Write the manifest of a new run, or check that an existing run is the same run (agent and tasks).
        Returns the passes the run holds from now on (a resumed run keeps a larger count it was started with)."""
        old = self.check(manifest)
        if old is None:
            with atomic_output(self.manifest_path()) as f:
                json.dump(manifest, f, indent=1)
            return manifest["passes"]
        if manifest["passes"] > old.get("passes", 0):
            with atomic_output(self.manifest_path()) as f:
                json.dump({**old, "passes": manifest["passes"]}, f, indent=1)
        self.remove_partial_writes()
        return max(manifest["passes"], old.get("passes", 0))

    def remove_partial_writes(self):
        """Temporary files a killed run left behind (atomic_output's .NAME.*.tmp)."""
        for base, _, files in os.walk(os.path.join(self.root, EPISODES)):
            for name in files:
                if name.startswith(".") and name.endswith(".tmp"):
                    os.remove(os.path.join(base, name))

    def load(self, task_id: str, index: int) -> Optional[dict]:
        path = self.episode_path(task_id, index)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def write(self, record: dict):
        with atomic_output(self.episode_path(record["task"], record["pass"])) as f:
            json.dump(record, f, ensure_ascii=False)

    def records(self, tasks: list[Task], passes: int) -> list[dict]:
        """Every finished episode of the run, in suite order then pass order."""
        return [r for t in tasks for k in range(passes) if (r := self.load(t.id, k)) is not None]


def task_config(config: EpisodeConfig, task: Task) -> EpisodeConfig:
    """The episode config for one task: commands time out at the task's command_timeout_s (a copy per task, so
    concurrent episodes never share a mutated config)."""
    limits = dataclasses.replace(config.sandbox.limits, wall_s=task.command_timeout_s)
    return dataclasses.replace(config, sandbox=dataclasses.replace(config.sandbox, limits=limits))


class Unreachable(RuntimeError):
    """The agent's server could not be reached: the episode says nothing about the agent, so it is not stored."""


class TestCommandNotStarted(RuntimeError):
    """The task's test command could not be started: grading says nothing about the agent, so it is not stored."""


class EpisodeTimeout(RuntimeError):
    """The episode's wall-clock budget (--episode-timeout-s) is spent."""


class _Deadline:
    """An agent that refuses to take another turn once the episode's time is up (the episode is then graded)."""

    def __init__(self, agent, seconds: float):
        self.agent, self.seconds, self.deadline = agent, seconds, time.monotonic() + seconds

    def act(self, messages, tools):
        if time.monotonic() >= self.deadline:
            raise EpisodeTimeout(f"the episode ran past --episode-timeout-s {self.seconds:g}")
        return self.agent.act(messages, tools)

    def close(self):
        getattr(self.agent, "close", lambda: None)()


class _Watched:
    """An agent whose failures to reach its server (no HTTP response: refused, reset, timed out) are remembered.
    EndpointAgent re-raises them as AgentError; the original stays the exception's __context__."""

    def __init__(self, agent, seen: Optional[list] = None):
        self.agent = agent
        self.seen = [] if seen is None else seen  # shared by an orchestrator and its sub-agents

    @property
    def unreachable(self):
        return self.seen[0] if self.seen else None

    def act(self, messages, tools):
        try:
            return self.agent.act(messages, tools)
        except Exception as e:
            cause = e.__cause__ or e.__context__ or e
            if isinstance(cause, OSError) and not isinstance(cause, urllib.error.HTTPError):
                self.seen.append(e)
            raise

    def close(self):
        getattr(self.agent, "close", lambda: None)()


class _WatchedPolicy:
    """A sub-agent policy whose agents report failures to reach their server into the episode's `seen` list."""

    def __init__(self, policy, seen: list):
        self.policy, self.seen = policy, seen

    def agent(self, name: str):
        return _Watched(self.policy.agent(name), self.seen)

    def close(self):
        pass  # the run closes its policies once (SwarmSetup.close)


def swarm_usage(record: dict, count, tool_declarations: str = "full") -> dict:
    """Tokens of a swarm episode by role: the orchestrator (with the swarm tools) and every sub-agent assignment
    (with the tools it was allowed)."""
    from megatron_ext.env.swarm import SWARM_TOOL_SCHEMAS

    orchestrator = episode_usage(record["summarized_segments"] + [record["transcript"]],
                                 declarations(SWARM_TOOL_SCHEMAS, tool_declarations), count)
    subagents = dict.fromkeys(orchestrator, 0)
    for run in record.get("subagents", []):
        allowed = set(run.get("tools") or [t["function"]["name"] for t in TOOL_SCHEMAS])
        usage = episode_usage([run["transcript"]], declarations(
            [t for t in TOOL_SCHEMAS if t["function"]["name"] in allowed], tool_declarations), count)
        for key, value in usage.items():
            subagents[key] += value
    return {"orchestrator": orchestrator, "subagents": subagents}


def run_one(task: Task, index: int, factory: AgentFactory, config: EpisodeConfig,
            swarm: Optional[SwarmSetup] = None, episode_timeout_s: Optional[float] = None) -> dict:
    """One episode as the record the run stores: the episode's JSON plus pass index and token usage."""
    agent = factory(task, index)
    watched = _Watched(agent if episode_timeout_s is None else _Deadline(agent, episode_timeout_s))
    try:
        if swarm is None:
            result = run_episode(task, watched, task_config(config, task))
        else:
            from megatron_ext.env.swarm import run_swarm_episode

            policy = _WatchedPolicy(swarm.policy_for(task), watched.seen)
            result = run_swarm_episode(task, watched, policy, task_config(config, task), swarm.config)
    finally:
        agent.close()
    if watched.unreachable is not None:
        raise Unreachable(str(watched.unreachable))
    if result.grading.get("exit_code") in NOT_STARTED:
        raise TestCommandNotStarted(
            f"task {task.id}: its test_command could not be started (exit {result.grading['exit_code']}: "
            f"{(result.grading.get('output') or '').strip()[-200:]!r}); command: {task.test_command[:200]}")
    record = {"pass": index, **result.to_json()}
    if (result.error or "").startswith(EpisodeTimeout.__name__ + ":"):
        record["status"] = "episode_timeout"
    if swarm is None:
        record["usage"] = episode_usage(result.segments + [result.messages],
                                        declarations(TOOL_SCHEMAS, config.tool_declarations), config.count_tokens)
    else:
        record["usage_by_role"] = swarm_usage(record, config.count_tokens, config.tool_declarations)
        record["usage"] = {k: sum(u[k] for u in record["usage_by_role"].values())
                           for k in record["usage_by_role"]["orchestrator"]}
    record["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return record


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_suite(tasks: list[Task], factory: AgentFactory, run: RunDir, passes: int, concurrency: int = 1,
              config: Optional[EpisodeConfig] = None, log: Optional[Callable[[str], None]] = None,
              swarm: Optional[SwarmSetup] = None, episode_timeout_s: Optional[float] = None) -> dict:
    """Run every (task, pass) without a result in `run`; returns {"ran", "skipped", "failed": [(task, pass, error)]}.
    With `swarm`, the agent is an orchestrator with sub-agents (module docstring)."""
    config = config or EpisodeConfig()
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    todo, correct_so_far, done_so_far = [], 0, 0
    for task in tasks:
        for k in range(passes):
            record = run.load(task.id, k)
            if record is None:
                todo.append((task, k))
            else:
                done_so_far += 1
                correct_so_far += record["reward"].get("correctness", 0.0) == 1.0
    total, skipped = len(tasks) * passes, done_so_far
    if skipped:
        log(f"resuming {run.root}: {skipped} of {total} episodes already finished, {len(todo)} to run")
    lock, start, failed, ran = threading.Lock(), time.monotonic(), [], 0
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="episode") as pool:
        futures = {pool.submit(run_one, task, k, factory, config, swarm, episode_timeout_s): (task, k)
                   for task, k in todo}
        try:
            for future in as_completed(futures):
                task, k = futures[future]
                try:
                    record = future.result()
                except Exception as e:  # the episode could not run (sandbox, grading): retried on resume
                    failed.append((task.id, k, f"{type(e).__name__}: {e}"))
                    log(f"[{done_so_far}/{total}] {task.id} pass {k}: could not run ({type(e).__name__}: {e}); "
                        "it is retried when the run is resumed")
                    continue
                run.write(record)
                with lock:
                    ran += 1
                    done_so_far += 1
                    correct = record["reward"].get("correctness", 0.0) == 1.0
                    correct_so_far += correct
                    per_episode = (time.monotonic() - start) / ran  # wall clock, episodes overlapping
                    remaining = len(todo) - ran - len(failed)
                    steps = (f", {record['critical_steps']} critical of {record['total_steps']} steps"
                             if "critical_steps" in record else "")
                    log(f"[{done_so_far}/{total}] {task.id} pass {k}: {record['status']}, "
                        f"{'correct' if correct else 'wrong'}, reward {record['reward'].get('total', 0.0):.3f}, "
                        f"{record['wall_s']:.1f} s{steps} | accuracy so far {correct_so_far / done_so_far:.3f} | "
                        f"eta {_eta(per_episode * remaining)}")
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return {"ran": ran, "skipped": skipped, "failed": failed}


def token_counter(tokenizer_model: Optional[str], tokenizer_type: Optional[str] = None):
    """(count function, description): a tokenizer's exact counts, or the 4-bytes-a-token estimate."""
    if not tokenizer_model:
        return approx_tokens, "estimate: 4 bytes a token"
    from megatron_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)
    return (lambda text: len(tokenizer.tokenize(text)) if text else 0), f"tokenizer {tokenizer_model}"
