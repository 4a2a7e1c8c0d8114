"""Agent swarm (Kimi K2.5's parallel-agent RL, PARL): an orchestrator delegates parts of a coding task to
sub-agents that run concurrently; only the orchestrator is trained.

    orchestrator turn (trainable) --tool calls--> SwarmToolbox
        create_subagent(name, instructions, tools)   a role: system prompt + allowed tools (finish always)
        assign_task(subagent, task)                  copy the orchestrator's workspace NOW into a new sandbox and
                                                     start an episode there on a worker thread (returns at once)
        wait(subagents?, timeout_s?)                 block until they end; their reports are the observation
        merge(subagent)                              three-way merge of a collected result into the workspace
        + every coding tool (read_file ... finish)   the orchestrator can also work itself
    sub-agent episode (thread; frozen policy, never trained): its own Session (context, sandbox, token budget,
        turn limit, wall-clock limit); `SubAgentPolicy.agent(name).act(messages, tools)` per turn

Sub-agents are I/O bound (HTTP calls to a served policy, sandbox commands), so threads give real concurrency: while
the orchestrator generates its next turn (the RL engine, the main thread) the sub-agents it started keep acting.
At most `max_subagents` sub-agents are created and run at once. Nothing a sub-agent does raises into the episode:
a policy that fails ("agent_error"), a runner that crashes ("crashed"), a wall-clock limit ("timeout"), the turn
limit ("max_turns") or the token budget ("budget") all come back as a report in `wait`'s observation.

Workspaces: each assignment works on a private copy of the orchestrator's workspace taken at assign time (the
base). `merge` applies the sub-agent's changes file by file: a file the orchestrator has not touched since the base
takes the sub-agent's version; one already equal is skipped; one both changed differently is a conflict, left as
the orchestrator has it and reported with the sub-agent's diff, so the orchestrator decides.

Definitions (K2.5 report section 3; REFERENCE.md "Kimi K2.5 agent swarm"):

* step: one model turn (an `act` call) of the orchestrator or of a sub-agent.
* stage: the orchestrator's turns up to and including the next turn that collects sub-agent results (a `wait`
  that returns at least one ended sub-agent), or to the end of the episode. S_main = the orchestrator's turns in
  the stage; S_sub = the most steps taken by any sub-agent collected in the stage (0 if none). A sub-agent's steps
  count whole in the stage that collects it, even where they overlapped earlier orchestrator turns (an upper
  bound of the latency); sub-agents never collected do not delay the orchestrator and count nothing (their work is
  cancelled and never merged).
* critical_steps = sum over stages of (S_main + S_sub); total_steps = orchestrator turns + every sub-agent step.
  A single agent has one stage without sub-agents: critical_steps = total_steps = its turns.
* r_parallel = min(sub-agents that were assigned a task, max_subagents) / max_subagents (rewards instantiating
  sub-agents, against collapse to serial work); r_finish = assignments that ended with the sub-agent's own
  `finish` / assignments (0 without any; rewards completed sub-tasks, against spurious parallelism).
* reward = r_task + lambda_1 r_parallel + lambda_2 r_finish, r_task the coding reward (rewards.score) of the
  orchestrator's episode; lambda_k(step) = lambda_k(0) * s(step / anneal_steps), s(p) = 1 - p (linear) or
  (1 + cos(pi p)) / 2 (cosine) for p <= 1 and 0 after; anneal_steps 0 keeps the lambdas constant.
* concurrency: peak = the most sub-agents running at the same moment; mean = summed sub-agent run time over the
  time at least one ran.

The episode result is env/episode.py's `EpisodeResult` extended (`SwarmResult`): critical_steps, total_steps,
stages, the swarm statistics and every sub-agent's transcript, next to wall_s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol

from megatron_ext.env.agents import AgentError, EndpointAgent, LocalAgent, ScriptAgent, check_actions
from megatron_ext.env.episode import (Agent, ContextExceeded, EpisodeConfig, EpisodeResult, Session, _restore, _text,
                                      changed_paths, drive, snapshot)
from megatron_ext.env.tasks import Task
from megatron_ext.env.tools import SCHEMAS, TOOL_SCHEMAS, Toolbox, ToolError, _fn, declarations, truncate

SWARM_SYSTEM_PROMPT = (
    "You are the orchestrator of a team of coding agents. The repository is at /workspace; there is no network. "
    "Split the task into independent parts and delegate them: create_subagent defines a helper, assign_task starts "
    "it on a copy of the workspace (helpers run at the same time), wait collects their reports, merge brings a "
    "helper's edits into the workspace. You can also use the coding tools yourself. When the task is done, call "
    "finish with a short message saying what changed and how it was checked.")
SUBAGENT_SYSTEM_PROMPT = (
    "You are a coding agent working on one part of a larger task; the repository is at /workspace (your own copy) "
    "and there is no network. Do only your part; call finish with a short report of what you changed and how you "
    "checked it when you are done.")

_S, _I = {"type": "string"}, {"type": "integer"}
_NAMES = {"type": "array", "items": _S}
SWARM_ONLY_SCHEMAS = [
    _fn("create_subagent", "Define a sub-agent: a unique name, its instructions (its role) and optionally the coding "
        "tools it may use (default: all; finish is always allowed).",
        {"name": _S, "instructions": _S, "tools": _NAMES}, ["name", "instructions"], "Define a sub-agent."),
    _fn("assign_task", "Start a sub-agent on a task, on a copy of the current workspace; returns at once (sub-agents "
        "run concurrently). Optional timeout_s bounds its wall-clock time.",
        {"subagent": _S, "task": _S, "timeout_s": _I}, ["subagent", "task"], "Start a sub-agent on a task."),
    _fn("wait", "Wait until the given sub-agents (default: all running) end, or timeout_s passes; returns each "
        "one's report: status, steps, final message and changed files.", {"subagents": _NAMES, "timeout_s": _I}, [],
        "Wait for sub-agents' reports."),
    _fn("merge", "Apply a collected sub-agent's edits to the workspace; files both of you changed are conflicts, "
        "reported and left as they are.", {"subagent": _S}, ["subagent"], "Apply a sub-agent's edits."),
]
SWARM_TOOL_SCHEMAS = TOOL_SCHEMAS + SWARM_ONLY_SCHEMAS
SWARM_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in SWARM_TOOL_SCHEMAS}
ENDED = ("finished", "no_tool_calls", "max_turns", "budget", "agent_error", "context_exceeded", "crashed", "timeout",
         "cancelled")


# ---------------------------------------------------------------------------------------------------------------
# configuration and the PARL reward
# ---------------------------------------------------------------------------------------------------------------

ANNEAL_KINDS = ("linear", "cosine")


@dataclass
class ParlSchedule:
    """lambda_1 (r_parallel) and lambda_2 (r_finish) as functions of the RL step (module docstring)."""

    parallel_weight: float = 0.1
    finish_weight: float = 0.1
    anneal_steps: int = 100       # 0: constant
    kind: str = "linear"

    def __post_init__(self):
        if self.kind not in ANNEAL_KINDS:
            raise ValueError(f"--swarm-reward-anneal {self.kind!r}: choose one of {ANNEAL_KINDS}")
        if self.anneal_steps < 0:
            raise ValueError(f"--swarm-reward-anneal-steps must be >= 0, got {self.anneal_steps}")

    def factor(self, step: int) -> float:
        if self.anneal_steps == 0:
            return 1.0
        p = min(max(step, 0) / self.anneal_steps, 1.0)
        return 1.0 - p if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))

    def weights(self, step: int) -> dict:
        f = self.factor(step)
        return {"r_parallel": self.parallel_weight * f, "r_finish": self.finish_weight * f, "step": step}


@dataclass
class SwarmConfig:
    max_subagents: int = 4
    subagent_max_turns: int = 20
    subagent_max_tokens: int = 32768      # context budget of one assignment (config.count_tokens)
    subagent_timeout_s: float = 600.0     # wall clock of one assignment (assign_task's timeout_s may lower it)
    close_grace_s: float = 10.0           # how long closing the episode waits for sub-agents still running
    schedule: ParlSchedule = field(default_factory=ParlSchedule)

    def __post_init__(self):
        for name in ("max_subagents", "subagent_max_turns", "subagent_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--swarm-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.subagent_timeout_s <= 0:
            raise ValueError(f"--swarm-subagent-timeout-s must be positive, got {self.subagent_timeout_s}")


def parl_reward(reward: dict, r_parallel: float, r_finish: float, lambdas: dict) -> dict:
    """The episode's reward object (rewards.Score.to_json()) with the PARL terms: r_task is its total, the new
    total is r_task + lambda_1 r_parallel + lambda_2 r_finish, the lambdas stand in 'weights'."""
    out = {**reward, "weights": dict(reward["weights"])}
    out["r_task"] = reward["total"]
    out["r_parallel"], out["r_finish"] = r_parallel, r_finish
    out["weights"]["r_parallel"], out["weights"]["r_finish"] = lambdas["r_parallel"], lambdas["r_finish"]
    out["total"] = reward["total"] + lambdas["r_parallel"] * r_parallel + lambdas["r_finish"] * r_finish
    return out


# ---------------------------------------------------------------------------------------------------------------
# sub-agent policies
# ---------------------------------------------------------------------------------------------------------------

class SubAgentPolicy(Protocol):
    """Where sub-agents' turns come from: `agent(name)` gives a fresh Agent (own context) for one assignment; calls
    come from several threads at once. The rollout fleet plugs in here (an agent whose act() is a fleet request)."""

    def agent(self, name: str) -> Agent: ...

    def close(self) -> None: ...


class ScriptedPolicy:
    """Scripted sub-agents: name -> actions (agents.ScriptAgent; '*' for any other name); `delay_s` sleeps before
    each turn (a stand-in for a model's latency in tests and demos)."""

    def __init__(self, scripts: dict, delay_s: float = 0.0):
        self.scripts, self.delay_s = scripts, delay_s

    def agent(self, name: str) -> Agent:
        if name not in self.scripts and "*" not in self.scripts:
            raise AgentError(f"no script for sub-agent {name!r} (scripts: {sorted(self.scripts)})")
        agent = ScriptAgent(self.scripts.get(name, self.scripts.get("*")))
        return Delayed(agent, self.delay_s) if self.delay_s else agent

    def close(self):
        pass


class Delayed:
    """An agent whose every turn first sleeps delay_s: a model's latency, for tests and benchmarks."""

    def __init__(self, agent: Agent, delay_s: float):
        self.agent, self.delay_s = agent, delay_s

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        time.sleep(self.delay_s)
        return self.agent.act(messages, tools)

    def close(self):
        getattr(self.agent, "close", lambda: None)()


class EndpointPolicy:
    """A frozen policy behind an OpenAI-compatible endpoint (tools/serve.py, vLLM, SGLang); one request per turn."""

    def __init__(self, url: str, **kwargs):
        self.url, self.kwargs = url, kwargs

    def agent(self, name: str) -> Agent:
        return EndpointAgent(self.url, **self.kwargs)

    def close(self):
        pass


class LocalPolicy(EndpointPolicy):
    """A frozen checkpoint served by tools/serve.py (one server for every sub-agent) for the policy's lifetime."""

    def __init__(self, checkpoint: str, serve_args: tuple = (), **kwargs):
        self.server = LocalAgent(checkpoint, serve_args=serve_args, **kwargs)
        super().__init__(self.server.url, **kwargs)

    def close(self):
        self.server.close()


class _ModelTurns:
    """A sub-agent policy whose turns a model samples: the chat rendered to token ids (fitting `context`), the
    sampled ids parsed back into a message; stateless agents (the context is in the messages)."""

    def _init_turns(self, tokenizer, max_tokens: int, temperature: float):
        from megatron_ext.data.sft import IM_END

        self.tokenizer, self.max_tokens, self.temperature = tokenizer, max_tokens, temperature
        self.stop = (tokenizer.token_id(IM_END),)
        self.lock, self.turns = threading.Lock(), 0

    def _prompt(self, messages: list[dict], tools: list[dict], context: int) -> tuple[list[int], int]:
        """The prompt's ids and the tokens left for the reply; ContextExceeded when none are."""
        from megatron_ext.data.sft import render_chat

        prompt = render_chat(self.tokenizer, messages, tools=tools, add_generation_prompt=True).ids
        room = context - len(prompt)
        if room < 1:
            raise ContextExceeded(f"the prompt ({len(prompt)} tokens) fills the model's context of {context} tokens",
                                  len(prompt), context)
        return prompt, min(self.max_tokens, room)

    def _reply(self, token_ids: list[int]) -> dict:
        from megatron_ext.data.sft import parse_assistant

        reply = parse_assistant(self.tokenizer, token_ids)
        reply.pop("incomplete", None)
        return reply

    def agent(self, name: str) -> Agent:
        return self

    def close(self):
        pass


class EnginePolicy(_ModelTurns):
    """The trained policy's weights at a pinned version, in a local engine copy (megatron_ext/inference), separate
    from the engine the orchestrator samples from: sub-agent turns never wait behind the orchestrator's generation.
    Sub-agents share the copy one turn at a time (a lock); `pin(model, version)` copies newer weights in."""

    def __init__(self, engine, tokenizer, max_tokens: int = 1024, temperature: float = 1.0):
        self.engine = engine
        self._init_turns(tokenizer, max_tokens, temperature)

    @property
    def version(self) -> int:
        return self.engine.weights_version

    def pin(self, model, version: int):
        with self.lock:
            self.engine.update_weights(model, version=version)

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        from megatron_ext.inference.engine import SamplingParams

        prompt, max_tokens = self._prompt(messages, tools, self.engine.model.max_sequence_length)
        with self.lock:
            self.turns += 1
            params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, stop_token_ids=self.stop,
                                    seed=self.turns)
            [completion] = self.engine.generate([prompt], params)
        return self._reply(completion.token_ids)


class GeneratePolicy(_ModelTurns):
    """Sub-agent turns as requests to a GenerateFn (megatron_ext/rl/rollout.py): the RL run's remote inference
    servers (`RemoteGenerate`, --swarm-subagent-policy fleet), which hold the policy's newest published weights.
    Thread-safe without a lock around generation: concurrent turns are concurrent requests, batched by the servers,
    never queued behind the orchestrator's own generation nor behind each other."""

    def __init__(self, generate, tokenizer, max_context: int, max_tokens: int = 1024, temperature: float = 1.0,
                 seed: int = 0):
        self.generate, self.max_context, self.seed = generate, max_context, seed
        self._init_turns(tokenizer, max_tokens, temperature)

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        from megatron_ext.rl.rollout import Sampling

        prompt, max_tokens = self._prompt(messages, tools, self.max_context)
        with self.lock:  # only the seed counter is shared
            self.turns += 1
            seed = self.seed * 1_000_003 + self.turns
        sampling = Sampling(max_tokens=max_tokens, temperature=self.temperature, stop_token_ids=self.stop, seed=seed)
        [[sample]] = self.generate([prompt], 1, sampling)
        return self._reply(sample.token_ids)


def make_subagent_policy(spec: str, **endpoint_kwargs) -> SubAgentPolicy:
    """script:SCRIPTS.json ({name: actions}) | endpoint:URL | local:CKPT ('pinned' is built by the RL factory)."""
    kind, sep, value = spec.partition(":")
    if kind == "script" and value:
        try:
            with open(value) as f:
                scripts = json.load(f)
        except (OSError, ValueError) as e:
            raise AgentError(f"--swarm-subagent-policy {spec}: cannot read ({e})") from None
        if not isinstance(scripts, dict) or not scripts:
            raise AgentError(f"--swarm-subagent-policy {spec}: expected a JSON object {{sub-agent name: actions}}")
        return ScriptedPolicy({name: check_actions(actions, f"{value}[{name!r}]") for name, actions in scripts.items()})
    if kind == "endpoint" and value:
        return EndpointPolicy(value, **endpoint_kwargs)
    if kind == "local" and value:
        if not os.path.isdir(value):
            raise AgentError(f"--swarm-subagent-policy local:{value}: not a checkpoint directory")
        return LocalPolicy(value, **endpoint_kwargs)
    raise AgentError(f"--swarm-subagent-policy {spec!r}: expected script:SCRIPTS.json, endpoint:URL, local:CKPT "
                     "or (rl_composer.py) pinned / fleet")


# ---------------------------------------------------------------------------------------------------------------
# sub-agent episodes
# ---------------------------------------------------------------------------------------------------------------

class ScopedToolbox(Toolbox):
    """The coding tools a sub-agent was allowed (finish always); other names are invalid calls."""


@dataclass
class SubAgentSpec:
    name: str
    instructions: str
    tools: list          # allowed coding tool names (finish included)


@dataclass
class SubAgentRun:
    """One assignment: a sub-agent's episode on its own copy of the workspace."""

    spec: SubAgentSpec
    task: str
    index: int                          # order of assignment within the episode
    session: Session
    deadline: float                     # time.monotonic() after which the run times out
    timeout_s: float
    status: Optional[str] = None        # one of ENDED once over
    error: Optional[str] = None
    start: float = 0.0
    end: Optional[float] = None
    final: Optional[dict] = None        # snapshot of its workspace when it ended (None: nothing to merge)
    collected: bool = False
    merged: bool = False
    ended_steps: Optional[int] = None   # steps when it ended (a timed-out thread may still finish a turn)
    done: threading.Event = field(default_factory=threading.Event)          # the run is over (reported)
    thread_done: threading.Event = field(default_factory=threading.Event)   # its worker has freed everything
    lock: threading.Lock = field(default_factory=threading.Lock)
    future: Optional[concurrent.futures.Future] = None

    @property
    def steps(self) -> int:
        return self.session.turn_count if self.ended_steps is None else self.ended_steps

    def end_with(self, status: str, error: Optional[str] = None):
        """Mark the run over (call with `lock` held)."""
        self.status, self.error, self.end, self.ended_steps = status, error, time.monotonic(), self.session.turn_count
        self.done.set()

    def changed(self) -> list[str]:
        return changed_paths(self.session.pristine, self.final) if self.final is not None else []

    def report(self) -> str:
        seconds = (self.end or time.monotonic()) - self.start
        s = f"sub-agent {self.spec.name}: {self.status} after {self.steps} steps ({seconds:.1f} s)"
        if self.status == "timeout":
            s += f"; wall-clock limit {self.timeout_s:g} s; no result to merge"
        if self.error:
            s += f"\n  error: {truncate(self.error, 600)}"
        if self.session.toolbox.finished is not None:
            s += f"\n  message: {truncate(self.session.toolbox.finished, 1500)}"
        if self.final is not None:
            s += f"\n  files changed: {', '.join(self.changed()) or '(none)'}"
        return s

    def to_json(self) -> dict:
        return {"name": self.spec.name, "task": self.task, "tools": self.spec.tools, "status": self.status,
                "error": self.error,
                "steps": self.steps, "wall_s": round((self.end or time.monotonic()) - self.start, 3),
                "changed_files": self.changed(), "collected": self.collected, "merged": self.merged,
                "transcript": self.session.all_messages(),
                "tool_calls": [c.to_json() for c in self.session.toolbox.calls]}


class Swarm:
    """The sub-agents of one orchestrator episode: their definitions, runs, worker threads and statistics."""

    def __init__(self, parent: Session, config: SwarmConfig, policy: SubAgentPolicy):
        self.parent, self.config, self.policy = parent, config, policy
        self.specs: dict[str, SubAgentSpec] = {}
        self.runs: list[SubAgentRun] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(config.max_subagents, thread_name_prefix="subagent")
        self.running, self.peak = 0, 0
        self.count_lock = threading.Lock()
        self.turn_collected: list[int] = []   # steps of the sub-agents collected during the current turn
        self.merges, self.conflicts = 0, 0
        self.closed = False

    # ---- the tools ------------------------------------------------------------------------------------------
    def create(self, name: str, instructions: str, tools: Optional[list] = None) -> str:
        if not name.strip() or len(name) > 64 or any(c.isspace() for c in name):
            raise ToolError("create_subagent: name must be 1-64 characters without spaces")
        if name in self.specs:
            raise ToolError(f"create_subagent: a sub-agent named {name!r} exists; use another name")
        if not instructions.strip():
            raise ToolError("create_subagent: instructions are empty; describe the sub-agent's role")
        allowed = list(SCHEMAS) if tools is None else list(dict.fromkeys(tools))
        unknown = [t for t in allowed if t not in SCHEMAS]
        if unknown:
            raise ToolError(f"create_subagent: unknown tools {unknown}; sub-agents may use {list(SCHEMAS)}")
        if len(self.specs) >= self.config.max_subagents:
            raise ToolError(f"create_subagent: at most {self.config.max_subagents} sub-agents "
                            f"(--swarm-max-subagents); reuse one with assign_task")
        if "finish" not in allowed:
            allowed.append("finish")
        self.specs[name] = SubAgentSpec(name, instructions.strip(), allowed)
        return f"created sub-agent {name} with tools {', '.join(allowed)}"

    def assign(self, subagent: str, task: str, timeout_s: Optional[int] = None) -> str:
        spec = self._spec(subagent, "assign_task")
        if any(r.spec.name == subagent and not r.done.is_set() for r in self.runs):
            raise ToolError(f"assign_task: {subagent} is still working on its task; wait for it first")
        if not task.strip():
            raise ToolError("assign_task: task is empty")
        limit = self.config.subagent_timeout_s
        if timeout_s is not None:
            if not 1 <= timeout_s <= limit:
                raise ToolError(f"assign_task: timeout_s must be between 1 and {limit:g}")
            limit = float(timeout_s)
        parent = self.parent
        sub = Task(id=f"{parent.task.id}/{subagent}#{len(self.runs)}", repo=parent.box.workspace, instruction=task,
                   test_command="true", timeout_s=1.0, max_turns=self.config.subagent_max_turns,
                   command_timeout_s=parent.task.command_timeout_s)
        # no self-summarisation: a sub-agent past its token budget ends ("budget") and reports what it has
        session = Session(sub, dataclasses.replace(parent.config, summarize_at=None))
        session.messages[0]["content"] = f"{SUBAGENT_SYSTEM_PROMPT}\n\n{spec.instructions}"
        session.toolbox = ScopedToolbox(session.box, session.toolbox.limits)
        session.toolbox.schemas = {name: SCHEMAS[name] for name in spec.tools}
        now = time.monotonic()
        run = SubAgentRun(spec, task, len(self.runs), session, now + limit, limit, start=now)
        self.runs.append(run)
        run.future = self.pool.submit(self._run, run)
        return f"assigned to {subagent} (run {run.index}); it works on a copy of the workspace as of now"

    def wait(self, subagents: Optional[list] = None, timeout_s: Optional[int] = None) -> str:
        if subagents is None:
            targets = [r for r in self.runs if not r.collected]
        else:
            for name in subagents:
                self._spec(name, "wait")
            targets = [r for r in self.runs if r.spec.name in subagents and not r.collected]
        if not targets:
            raise ToolError("wait: no sub-agent result is pending; assign_task first")
        until = time.monotonic() + timeout_s if timeout_s is not None else math.inf
        lines = []
        for run in targets:
            run.done.wait(max(0.0, min(run.deadline, until) - time.monotonic()))
            with run.lock:
                if not run.done.is_set() and time.monotonic() >= run.deadline:
                    run.end_with("timeout")  # its thread stops before its next turn
                if not run.done.is_set():
                    lines.append(f"sub-agent {run.spec.name}: still running ({run.steps} steps so far)")
                    continue
                run.collected = True
            self.turn_collected.append(run.steps)
            lines.append(run.report())
        return "\n".join(lines)

    def merge(self, subagent: str) -> str:
        self._spec(subagent, "merge")
        runs = [r for r in self.runs if r.spec.name == subagent and r.collected and not r.merged]
        if not runs:
            raise ToolError(f"merge: {subagent} has no collected, unmerged result; wait for it first")
        run = runs[-1]
        if run.final is None:
            raise ToolError(f"merge: {subagent}'s run ended with {run.status}; it left no workspace to merge")
        run.merged = True
        workspace = self.parent.box.workspace
        ours = snapshot(workspace)
        applied, same, conflicts = [], [], []
        for rel in run.changed():
            base, theirs = run.session.pristine.get(rel), run.final.get(rel)
            if ours.get(rel) == theirs:
                same.append(rel)
            elif ours.get(rel) == base:
                _restore(workspace, rel, theirs)
                applied.append(rel)
            else:
                conflicts.append(rel)
        self.merges += 1
        self.conflicts += len(conflicts)
        out = [f"merged {subagent}: {len(applied)} file(s) applied" + (f": {', '.join(applied)}" if applied else "")]
        if same:
            out.append(f"already identical: {', '.join(same)}")
        for rel in conflicts:
            old, new = _text(run.session.pristine.get(rel)), _text(run.final.get(rel))
            diff = "".join(difflib.unified_diff((old or "").splitlines(True), (new or "").splitlines(True),
                                                f"a/{rel}", f"b/{rel}")) if old is not None and new is not None \
                else "(binary or removed)"
            out.append(f"CONFLICT {rel}: you changed it too since the assignment; kept yours. {subagent}'s change:\n"
                       f"{truncate(diff, 2000)}")
        return "\n".join(out)

    def _spec(self, name: str, tool: str) -> SubAgentSpec:
        if name not in self.specs:
            raise ToolError(f"{tool}: no sub-agent named {name!r}; created: {sorted(self.specs) or 'none'} "
                            "(create_subagent first)")
        return self.specs[name]

    # ---- the worker -----------------------------------------------------------------------------------------
    def _run(self, run: SubAgentRun):
        run.start = time.monotonic()  # a run queued behind busy workers starts now
        with self.count_lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        session, agent = run.session, None
        status, error = None, None
        try:
            agent = self.policy.agent(run.spec.name)
            tools = declarations([t for t in TOOL_SCHEMAS if t["function"]["name"] in run.spec.tools],
                                 session.config.tool_declarations)
            while not session.done and not run.done.is_set() and not self.closed:
                if time.monotonic() >= run.deadline:
                    status = "timeout"
                    break
                try:
                    reply = agent.act([dict(m) for m in session.messages], tools)
                except Exception as e:  # the policy failed: this run ends, the episode goes on
                    session.fail(e)
                    break
                if run.done.is_set():  # timed out while acting: its late reply is dropped
                    break
                session.apply(reply)
                if not session.done and session.context_tokens() > self.config.subagent_max_tokens:
                    session.status = "budget"
            status = status or session.status or "cancelled"  # the episode ended under it
            error = session.error
        except Exception as e:  # the runner itself broke (sandbox, policy construction): a report, not a crash
            status, error = "crashed", f"{type(e).__name__}: {e}"
        finally:
            with run.lock:
                if not run.done.is_set():
                    if status != "timeout":
                        try:
                            run.final = snapshot(session.box.workspace)
                        except OSError as e:
                            status, error = "crashed", f"reading its workspace: {e}"
                    run.end_with(status or "crashed", error)
            session.close()
            if agent is not None and agent is not self.policy and hasattr(agent, "close"):
                agent.close()
            with self.count_lock:
                self.running -= 1
            run.thread_done.set()

    def close(self):
        """Stop every run (at its next turn), wait up to close_grace_s for the threads, free their sandboxes."""
        if self.closed:
            return
        self.closed = True
        for run in self.runs:  # queued behind busy workers: never started
            if run.future is not None and run.future.cancel():
                with run.lock:
                    run.end_with("cancelled")
                run.session.close()
                run.thread_done.set()
        deadline = time.monotonic() + self.config.close_grace_s
        for run in self.runs:
            run.thread_done.wait(max(0.0, deadline - time.monotonic()))
        self.pool.shutdown(wait=False)
        for run in self.runs:
            with run.lock:
                if not run.done.is_set():  # still acting after the grace period: its sandbox goes when it returns
                    run.end_with("cancelled")

    # ---- statistics -----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        assigned = {r.spec.name for r in self.runs}
        spans = sorted((r.start, r.end or time.monotonic()) for r in self.runs)
        busy, union, reach = sum(e - s for s, e in spans), 0.0, -math.inf
        for s, e in spans:
            union += max(0.0, e - max(s, reach))
            reach = max(reach, e)
        statuses = [r.status for r in self.runs]
        return {"subagents_created": len(self.specs), "subagents_assigned": len(assigned),
                "assignments": len(self.runs), "finished": statuses.count("finished"),
                "failures": statuses.count("agent_error") + statuses.count("crashed"),
                "timeouts": statuses.count("timeout"), "cancelled": statuses.count("cancelled"),
                "peak_concurrency": self.peak,
                "mean_concurrency": busy / union if union > 0 else 0.0,
                "subagent_steps": sum(r.steps for r in self.runs), "merges": self.merges, "conflicts": self.conflicts}

    def parl_terms(self) -> tuple[float, float]:
        """(r_parallel, r_finish) as the module docstring defines them."""
        s = self.stats()
        r_parallel = min(s["subagents_assigned"], self.config.max_subagents) / self.config.max_subagents
        r_finish = s["finished"] / s["assignments"] if s["assignments"] else 0.0
        return r_parallel, r_finish


@dataclass
class SwarmToolbox(Toolbox):
    """The orchestrator's tools: every coding tool plus the swarm's."""

    schemas = SWARM_SCHEMAS
    swarm: Optional[Swarm] = None

    def _create_subagent(self, name: str, instructions: str, tools: Optional[list] = None) -> str:
        return self.swarm.create(name, instructions, tools)

    def _assign_task(self, subagent: str, task: str, timeout_s: Optional[int] = None) -> str:
        try:
            return self.swarm.assign(subagent, task, timeout_s)
        except OSError as e:  # copying the workspace failed: the call fails, the episode goes on
            raise ToolError(f"assign_task: cannot copy the workspace ({e})") from None

    def _wait(self, subagents: Optional[list] = None, timeout_s: Optional[int] = None) -> str:
        return self.swarm.wait(subagents, timeout_s)

    def _merge(self, subagent: str) -> str:
        try:
            return self.swarm.merge(subagent)
        except OSError as e:
            raise ToolError(f"merge: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# the orchestrator's episode
# ---------------------------------------------------------------------------------------------------------------

# statistics carried as weight-0 reward parts (RL logs each as "reward NAME" and writes it to rollouts.jsonl)
SWARM_PARTS = ("swarm_critical_steps", "swarm_total_steps", "swarm_wall_s", "swarm_subagents",
               "swarm_peak_concurrency", "swarm_mean_concurrency", "swarm_failures", "swarm_timeouts")


@dataclass
class SwarmResult(EpisodeResult):
    critical_steps: int = 0
    total_steps: int = 0
    stages: list = field(default_factory=list)       # [S_main, S_sub] per stage
    swarm: dict = field(default_factory=dict)        # Swarm.stats()
    subagents: list = field(default_factory=list)    # SubAgentRun.to_json() per assignment

    def to_json(self) -> dict:
        return {**super().to_json(), "critical_steps": self.critical_steps, "total_steps": self.total_steps,
                "stages": self.stages, "swarm": self.swarm, "subagents": self.subagents}


class SwarmSession(Session):
    """An orchestrator's episode: a Session whose toolbox is a SwarmToolbox, with stage accounting (module
    docstring) and the PARL terms added to the reward at `finish()`. The lambdas come from the reward config's
    'swarm' section (the RL factory writes the step's values there) or else the schedule at step 0."""

    system_prompt = SWARM_SYSTEM_PROMPT

    def __init__(self, task: Task, config: Optional[EpisodeConfig], swarm: SwarmConfig, policy: SubAgentPolicy):
        super().__init__(task, config)
        self.swarm = Swarm(self, swarm, policy)
        self.toolbox = SwarmToolbox(self.box, self.toolbox.limits, swarm=self.swarm)
        self.stages: list[list[int]] = []
        self.stage_turns = 0

    def apply(self, reply) -> list[dict]:
        self.swarm.turn_collected = []
        before = self.turn_count
        out = super().apply(reply)
        if self.turn_count > before:
            self.stage_turns += 1
            if self.swarm.turn_collected:
                self.stages.append([self.stage_turns, max(self.swarm.turn_collected)])
                self.stage_turns = 0
        return out

    def finish(self) -> EpisodeResult:
        if isinstance(self.result, SwarmResult):
            return self.result
        self.swarm.close()
        if self.stage_turns:
            self.stages.append([self.stage_turns, 0])
            self.stage_turns = 0
        base = super().finish()
        stats = self.swarm.stats()
        critical = sum(a + b for a, b in self.stages)
        total = self.turn_count + stats["subagent_steps"]
        lambdas = ((self.config.weights or {}).get("swarm") or self.swarm.config.schedule.weights(0))
        reward = parl_reward(base.reward, *self.swarm.parl_terms(), lambdas)
        values = (critical, total, base.wall_s, stats["subagents_assigned"], stats["peak_concurrency"],
                  stats["mean_concurrency"], stats["failures"], stats["timeouts"])
        for name, value in zip(SWARM_PARTS, values):
            reward[name], reward["weights"][name] = float(value), 0.0
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(EpisodeResult)}
        self.result = SwarmResult(**{**fields, "reward": reward}, critical_steps=critical, total_steps=total,
                                  stages=[list(s) for s in self.stages], swarm=stats,
                                  subagents=[r.to_json() for r in self.swarm.runs])
        return self.result

    def close(self):
        self.swarm.close()
        super().close()


def run_swarm_episode(task: Task, orchestrator: Agent, policy: SubAgentPolicy, config: Optional[EpisodeConfig] = None,
                      swarm: Optional[SwarmConfig] = None) -> SwarmResult:
    """env/episode.py's agent loop for an orchestrator (SWARM_TOOL_SCHEMAS) with sub-agents from `policy`."""
    session = SwarmSession(task, config, swarm or SwarmConfig(), policy)
    return drive(session, orchestrator, declarations(SWARM_TOOL_SCHEMAS, session.config.tool_declarations))
