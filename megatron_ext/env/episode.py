"""One agentic coding episode: a task, an agent, a sandbox, tools, grading in a fresh sandbox, reward parts.

    task.repo --copy (no .git)--> agent sandbox /workspace
    loop (at most task.max_turns): agent.act(messages, TOOL_SCHEMAS) -> assistant message
         each tool call -> Toolbox -> observation (a tool message); finish(...) or a turn without calls ends it
    grading: files the task forbids and files that can steer a test run (grading.steering_paths) that changed
             are restored from the original repository or removed (and counted) -> a fresh sandbox gets the
             restored workspace plus the hidden tests -> a pytest test_command runs under the grader's runner:
             per-test outcomes vs the expected ids; any other command: its exit code (grading.py, docs/grading.md)
    reward: rewards.score(EpisodeFacts, weights) -> parts and total

The episode speaks messages (OpenAI chat shape: what tools/serve.py and the Kimi-K2 chat template exchange); an
agent is anything with ``act(messages, tools) -> assistant message``, so scripted agents, a remote
OpenAI-compatible server and a local checkpoint take the same path. Nothing the agent sends raises: malformed
calls become error observations and a failing agent ends the episode with status ``agent_error``; an agent whose
conversation no longer fits its model's context (`ContextExceeded`) ends it with ``context_exceeded``: graded like
any other ending (so counted as wrong unless the work was done), not an infrastructure error.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from megatron_ext.env.grading import (GradingRun, evaluate, expected_tests, is_bytecode, is_tool_cache,
                                      parse_pytest_command, runner_command, steering_paths)
from megatron_ext.env.rewards import DEFAULT_WEIGHTS, EpisodeFacts, last_test_run, score
from megatron_ext.env.environments import sandbox_for
from megatron_ext.env.sandbox import BubblewrapConfig, BubblewrapSandbox, copy_source
from megatron_ext.env.tasks import Task
from megatron_ext.env.tools import TOOL_SCHEMAS, Toolbox, ToolLimits, declarations, truncate
from megatron_ext.env.workspace import (TRUSTED, WorkspaceError, _restore, _text, changed_paths,  # noqa: F401
                                        clear_path, diff_lines, overlay, snapshot)

SYSTEM_PROMPT = (
    "You are a coding agent. The repository is at /workspace (your working directory); there is no network. "
    "Use the tools to read, search, edit and run code. Keep a todo list for multi-step work. When you are done, "
    "call finish with a short message saying what you changed and how you checked it.")
SUMMARY_REQUEST = (
    "Your context is getting long. Summarise your progress for yourself: what you found, what you changed and "
    "where, what is left and what to do next. Reply with the summary only, without tool calls; the conversation "
    "will continue from it.")


class ContextExceeded(RuntimeError):
    """The conversation (prompt) leaves no room to generate in the model's context: the agent's episode is over."""

    def __init__(self, message: str, prompt_tokens: Optional[int] = None, context: Optional[int] = None):
        super().__init__(message)
        self.prompt_tokens, self.context = prompt_tokens, context


class Agent(Protocol):
    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        """The next assistant message: {"content", optional "reasoning_content", optional "tool_calls"}."""


def approx_tokens(text: str) -> int:
    """Token count estimate (4 bytes a token) when no tokenizer is given."""
    return math.ceil(len(text.encode()) / 4)


@dataclass
class EpisodeConfig:
    sandbox: BubblewrapConfig = field(default_factory=BubblewrapConfig)
    tools: ToolLimits = field(default_factory=ToolLimits)
    weights: Optional[dict] = None                       # a rewards config (WeightFile.current()); None: defaults
    count_tokens: Callable[[str], int] = approx_tokens
    summarize_at: Optional[int] = None                   # context tokens past which the agent summarises
    summary_chars: int = 8000                            # longest summary carried into the next segment
    grading_output_bytes: int = 16 << 20
    grading_cache_dir: Optional[str] = None              # expected test ids collected per task (also in memory)
    tool_declarations: str = "full"                      # "compact": short tool descriptions (tools.declarations)


@dataclass
class EpisodeResult:
    task_id: str
    status: str                      # "finished" | "no_tool_calls" | "max_turns" | "agent_error" |
    #                                  "context_exceeded" | "abandoned"
    messages: list                   # the last segment's transcript
    calls: list
    grading: dict
    reward: dict
    counts: dict
    wall_s: float
    error: Optional[str] = None
    segments: list = field(default_factory=list)  # earlier transcripts, each ended by a summary (self-summarising)

    def to_json(self) -> dict:
        return {"task": self.task_id, "status": self.status, "error": self.error, "wall_s": round(self.wall_s, 3),
                "transcript": self.messages, "summarized_segments": self.segments,
                "tool_calls": [c.to_json() for c in self.calls],
                "grading": self.grading, "counts": self.counts, "reward": self.reward}


def _normalise(message, call_index: int) -> dict:
    """An agent's reply as a transcript message; tool-call ids default to Kimi's functions.NAME:INDEX."""
    if not isinstance(message, dict):
        raise TypeError(f"the agent returned {type(message).__name__}, not a message object")
    out = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["reasoning_content"] = str(message["reasoning_content"])
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        name = fn.get("name") if isinstance(fn.get("name"), str) else ""
        arguments = fn.get("arguments", "")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append({"id": call.get("id") or f"functions.{name}:{call_index + len(calls)}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    if calls:
        out["tool_calls"] = calls
    return out


class Session:
    """One episode driven step by step: `messages` so far, `apply(reply)` runs a reply's tool calls, `finish()`
    grades and scores (and frees the sandbox). The agent loop (`run_episode`) and the token-level wrapper for RL
    (`megatron_ext/env/token_env.py`) both drive a Session, so they share every rule.

    Self-summarisation (``config.summarize_at``): once the context passes that many tokens, the next message the
    agent gets is SUMMARY_REQUEST; its reply is the summary, which closes the segment: the conversation restarts
    from the system prompt and the instruction plus the summary, the todo list and the files changed so far
    (``restarted`` is set). Every segment is a generation of the same episode and shares its final reward."""

    system_prompt = SYSTEM_PROMPT  # a subclass (the swarm's orchestrator) sets its own

    def __init__(self, task: Task, config: Optional[EpisodeConfig] = None):
        self.task, self.config = task, config or EpisodeConfig()
        self.start = time.monotonic()
        self.status: Optional[str] = None  # set when the episode has ended
        self.error: Optional[str] = None
        self.messages = [{"role": "system", "content": self.system_prompt},
                         {"role": "user", "content": task.instruction}]
        self.result: Optional[EpisodeResult] = None
        self.segments: list[list[dict]] = []
        self.turn_count = 0
        self.summarizing = False   # the last message asks for a summary
        self.restarted = False     # the last apply() closed a segment: messages is a new conversation
        self.segment_start_tokens = 0
        self.sandbox = sandbox_for(self.config.sandbox, task.environment)
        self.box = BubblewrapSandbox(task.repo, self.sandbox)
        try:
            if os.path.isdir(task.repo):
                self.pristine = snapshot(task.repo, TRUSTED)
            else:
                with tempfile.TemporaryDirectory(prefix="megatron-env-pristine-") as folder:
                    copy_source(task.repo, folder)
                    self.pristine = snapshot(folder, TRUSTED)
        except BaseException:
            self.box.close()
            raise
        self.toolbox = Toolbox(self.box, dataclasses.replace(self.config.tools,
                                                             command_timeout_s=task.command_timeout_s))

    @property
    def done(self) -> bool:
        return self.status is not None

    def all_messages(self) -> list[dict]:
        return [m for segment in self.segments for m in segment] + self.messages

    def context_tokens(self) -> int:
        count = self.config.count_tokens
        return sum(count(m.get("content") or "") + count(m.get("reasoning_content") or "") +
                   sum(count(c["function"]["name"] + c["function"]["arguments"]) for c in m.get("tool_calls", []))
                   for m in self.messages)

    def apply(self, reply) -> list[dict]:
        """Append the agent's reply, run its tool calls in order (up to finish), return the tool messages."""
        if self.done:
            raise RuntimeError(f"episode {self.task.id} has ended ({self.status})")
        try:
            reply = _normalise(reply, len(self.toolbox.calls))
        except (TypeError, AttributeError) as e:
            self.fail(e)
            return []
        self.turn_count += 1
        self.restarted = False
        self.messages.append(reply)
        if self.summarizing:
            self._restart(reply["content"])
            return []
        if not reply.get("tool_calls"):
            self.status = "no_tool_calls"
            return []
        out = []
        for call in reply["tool_calls"]:
            record = self.toolbox.call(call["function"]["name"], call["function"]["arguments"], call["id"])
            out.append({"role": "tool", "tool_call_id": call["id"], "content": record.observation})
            if self.toolbox.finished is not None:
                self.status = "finished"
                break
        self.messages += out
        if not self.done and self.turn_count >= self.task.max_turns:
            self.status = "max_turns"
        summarize_at = self.config.summarize_at
        context = self.context_tokens() if summarize_at else 0
        # a new segment summarises again only after it has grown by half the budget (no summary loops)
        if not self.done and summarize_at and context > summarize_at and \
                context - self.segment_start_tokens > summarize_at // 2:
            self.summarizing = True
            request = {"role": "user", "content": SUMMARY_REQUEST}
            self.messages.append(request)
            out.append(request)
        return out

    def _restart(self, summary: str):
        """Close the segment with the agent's summary; the next conversation starts from it and the task state."""
        self.segments.append(self.messages)
        self.summarizing, self.restarted = False, True
        try:
            changed = changed_paths(self.pristine, snapshot(self.box.workspace))
        except WorkspaceError as e:
            changed = [f"(the workspace cannot be listed: {e})"]
        todos = "\n".join(f"{t.id}. [{'x' if t.done else ' '}] {t.item}" for t in self.toolbox.todos) or "(empty)"
        state = (f"{self.task.instruction}\n\n## Summary of your work so far\n"
                 f"{truncate(summary.strip() or '(no summary given)', self.config.summary_chars)}\n\n"
                 f"## Todo list\n{todos}\n\n## Files changed so far\n{chr(10).join(changed) or '(none)'}")
        self.messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": state}]
        self.segment_start_tokens = self.context_tokens()
        if self.turn_count >= self.task.max_turns:
            self.status = "max_turns"

    def fail(self, error: BaseException):
        """The agent could not produce a reply: the episode ends (and is still graded)."""
        status = "context_exceeded" if isinstance(error, ContextExceeded) else "agent_error"
        self.status, self.error = status, f"{type(error).__name__}: {error}"

    def finish(self) -> EpisodeResult:
        """Grade in a fresh sandbox, score, remove the sandbox; idempotent."""
        if self.result is not None:
            return self.result
        if self.status is None:
            self.status = "abandoned"
        try:
            final_message = self.toolbox.finished
            if final_message is None and self.status == "no_tool_calls":
                final_message = self.messages[-1]["content"]  # a plain reply ends the episode and is its message
            try:
                grading, facts = self._grade(final_message)
            except WorkspaceError as e:  # the agent's workspace broke host-side grading: a wrong answer
                grading, facts = self._ungradable(e, final_message)
        finally:
            self.close()
        result = score(facts, self.config.weights or DEFAULT_WEIGHTS)
        self.result = EpisodeResult(self.task.id, self.status, self.messages, self.toolbox.calls, grading,
                                    result.to_json(), facts.counts, time.monotonic() - self.start, self.error,
                                    self.segments)
        return self.result

    def close(self):
        self.box.close()

    def _counts(self, messages: list[dict]) -> dict:
        count = self.config.count_tokens
        assistant = [m for m in messages if m["role"] == "assistant"]
        return {
            "thinking_tokens": sum(count(m.get("reasoning_content", "")) for m in assistant),
            "tool_call_tokens": sum(count(c["function"]["name"] + c["function"]["arguments"])
                                    for m in assistant for c in m.get("tool_calls", [])),
            "tool_output_tokens": sum(count(m["content"]) for m in messages if m["role"] == "tool"),
            "message_tokens": sum(count(m["content"]) for m in assistant),
            "tool_calls": len(self.toolbox.calls),
            "turns": len(assistant),
        }

    def _ungradable(self, error: WorkspaceError, final_message: Optional[str]):
        """Grading of a workspace whose content the host refuses to handle (too deep, too many entries): the
        episode is scored wrong and counted, like any failed attempt."""
        messages = self.all_messages()
        grading = {"mode": "ungradable", "correct": False, "tests_fraction": 0.0, "exit_code": None, "killed": None,
                   "wall_s": 0.0, "output": f"ungradable workspace: {error}",
                   "changed_files": [], "forbidden_edits": [], "diff_lines": 0, "error": str(error)}
        facts = EpisodeFacts(correct=False, tests_fraction=0.0, test_output=grading["output"],
                             final_message=final_message,
                             calls=[(c.name, c.arguments) for c in self.toolbox.calls],
                             invalid_calls=self.toolbox.invalid_calls, unfinished_todos=self.toolbox.unfinished_todos,
                             counts=self._counts(messages))
        return grading, facts

    def _grade(self, final_message: Optional[str]):
        box, pristine, toolbox, messages = self.box, self.pristine, self.toolbox, self.all_messages()
        final = snapshot(box.workspace)
        changed = changed_paths(pristine, final)
        steering = set(steering_paths(changed, pristine, final))
        forbidden = [p for p in changed if p in steering or self._task_forbidden(p)]
        for rel in forbidden:
            _restore(box.workspace, rel, pristine.get(rel))
        self._remove_emptied_folders(forbidden)
        bytecode = [p for p in forbidden if is_bytecode(p) and not self._task_forbidden(p)]
        changes = {}
        for rel in changed:
            if rel not in forbidden and not is_tool_cache(rel):
                old, new = _text(pristine.get(rel)), _text(final.get(rel))
                if old is not None and new is not None:
                    changes[rel] = (old, new)
        sandbox = self.sandbox
        grading_config = dataclasses.replace(sandbox, limits=dataclasses.replace(
            sandbox.limits, output_bytes=self.config.grading_output_bytes))
        pytest_cmd = parse_pytest_command(self.task.test_command)
        ids = None
        if pytest_cmd is None:  # exit-code grading (weaker: see grading.py)
            with BubblewrapSandbox(box.workspace, grading_config) as grader:
                if self.task.hidden_tests:
                    overlay(self.task.hidden_tests, grader.workspace)
                r = grader.exec(self.task.test_command, timeout_s=self.task.timeout_s)
            correct = r.exit_code == 0 and r.killed is None
            fraction, mode = float(correct), "exit code"
        else:
            expected = expected_tests(self.task, pytest_cmd, grading_config, self.config.grading_cache_dir,
                                      self.task.timeout_s)
            with BubblewrapSandbox(box.workspace, grading_config) as grader:
                run = GradingRun(grader)
                if self.task.hidden_tests:
                    overlay(self.task.hidden_tests, grader.workspace)
                    run.protect_hidden(self.task.hidden_tests)
                r = grader.exec(runner_command(pytest_cmd, "run"), timeout_s=self.task.timeout_s)
                report, why = run.report() if r.killed is None else (None, f"killed ({r.killed})")
            ids = evaluate(report, expected)
            correct, fraction, mode = ids["correct"], ids["tests_fraction"], "pytest ids"
            ids["report_error"] = why or None
            ids["expected_source"] = expected.source
        grading = {"mode": mode, "correct": correct, "tests_fraction": fraction, "exit_code": r.exit_code,
                   "killed": r.killed, "wall_s": round(r.wall_s, 3), "output": truncate(r.output, 20000),
                   "changed_files": changed, "forbidden_edits": [p for p in forbidden if p not in bytecode],
                   "removed_bytecode": bytecode,
                   "diff_lines": sum(diff_lines(old, new) for old, new in changes.values()), **(ids or {})}
        facts = EpisodeFacts(correct=correct, tests_fraction=fraction, changes=changes,
                             final_message=final_message, calls=[(c.name, c.arguments) for c in toolbox.calls],
                             invalid_calls=toolbox.invalid_calls, unfinished_todos=toolbox.unfinished_todos,
                             forbidden_edits=grading["forbidden_edits"], counts=self._counts(messages),
                             last_test_run=last_test_run(toolbox.calls))
        return grading, facts

    def _task_forbidden(self, rel: str) -> bool:
        """A glob also covers the folder it names ("tests/*" covers a "tests" the agent replaced by a link or file)."""
        return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(rel + "/", g) for g in self.task.forbidden)

    def _remove_emptied_folders(self, restored: list[str]):
        """Folders left empty by removing forbidden files that the original did not have (an emptied
        evil.dist-info/ or pytest/ goes too)."""
        kept = {os.path.dirname(p) for p in self.pristine}
        kept |= {"/".join(p.split("/")[:i]) for p in kept for i in range(1, p.count("/") + 1)}
        for rel in sorted({os.path.dirname(p) for p in restored}, key=lambda p: -p.count("/")):
            while rel and rel not in kept:
                path = os.path.join(self.box.workspace, rel)
                if os.path.islink(path) or not os.path.isdir(path) or os.listdir(path):
                    break
                os.rmdir(path)
                rel = os.path.dirname(rel)


def run_episode(task: Task, agent: Agent, config: Optional[EpisodeConfig] = None) -> EpisodeResult:
    """The agent loop: ask the agent, run its calls, until finish, a reply without calls or max_turns."""
    session = Session(task, config)
    return drive(session, agent, declarations(TOOL_SCHEMAS, session.config.tool_declarations))


def drive(session: Session, agent: Agent, tools: list[dict]) -> EpisodeResult:
    """run_episode's loop over any Session (a subclass offers other tools: the swarm's orchestrator)."""
    try:
        while not session.done:
            try:
                reply = agent.act([dict(m) for m in session.messages], tools)
            except Exception as e:  # a broken agent or server ends this episode, not the run
                session.fail(e)
                break
            session.apply(reply)
        return session.finish()
    finally:
        session.close()
