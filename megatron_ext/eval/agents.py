"""`--agent SPEC` for a whole suite: a factory that gives each episode its agent.

* ``script:DIR``: DIR/<task id>.json holds the task's tool calls in the environment's ACTIONS.json format
  (megatron_ext/env/agents.py `load_actions`), played in order, then finish; a task without a file gets no actions
  (it finishes at once). Every file is checked before the run starts; files that name no task of the suite are
  named in a warning (a typo in a file name would otherwise grade that task as a no-op).
* ``endpoint:URL``: any OpenAI-compatible /v1/chat/completions (``--model NAME`` is sent as the model);
* ``local:CKPT``: tools/run_eval.py serves the checkpoint in this process (tools/serve.py's model service on a
  free loopback port) and hands its URL here as an endpoint.

The factory is called once per episode (scripted agents keep a cursor, so each episode gets its own).

``--agent-mode swarm`` (`SwarmSetup`): the agent is an orchestrator (megatron_ext/env/swarm.py) and each episode's
sub-agents come from ``--swarm-subagent-policy``: ``script:DIR`` (DIR/<task id>.json = {sub-agent name: actions};
a task without a file gets sub-agents that finish at once), ``script:SCRIPTS.json`` (the same scripts for every
task), ``endpoint:URL``, or ``local:CKPT`` (tools/serve.py started for the run; the orchestrator's own
in-process server when CKPT is the ``--agent local:`` checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_ext.env.agents import AgentError, EndpointAgent, ScriptAgent, check_actions, load_actions
from megatron_ext.env.tasks import Task

AgentFactory = Callable[[Task, int], object]  # (task, pass index) -> an agent with act() and close()


def script_factory(folder: str, tasks: list[Task], suite_ids=None) -> AgentFactory:
    """suite_ids: every id of the suite when `tasks` is a selection of it (files for the others are not strays)."""
    if not os.path.isdir(folder):
        raise AgentError(f"--agent script:{folder}: not a directory (one <task id>.json actions file per task)")
    actions = {}
    for task in tasks:
        path = os.path.join(folder, f"{task.id}.json")
        actions[task.id] = load_actions(path) if os.path.exists(path) else []
    known = {t.id for t in tasks}
    ids = known if suite_ids is None else set(suite_ids) | known
    files = [os.path.relpath(os.path.join(base, n), folder) for base, _, names in os.walk(folder) for n in names
             if n.endswith(".json")]  # nested too: a mined id holds '/' (pkg-1.0:pkg/mod.py::fn)
    strays = sorted(n for n in files if n[:-len(".json")] not in ids)
    if strays and not any(actions.values()):
        raise AgentError(f"--agent script:{folder}: none of its files names a task of the suite (found "
                         f"{strays[:5]}; expected <task id>.json, e.g. {min(known)}.json)")
    if strays:
        without = sorted(t.id for t in tasks if not actions[t.id])
        logging.getLogger(__name__).warning(
            f"warning: --agent script:{folder}: {len(strays)} files name no task of the suite: {strays[:10]}"
            f"{'...' if len(strays) > 10 else ''}; tasks without a file get no actions: {without[:10]}"
            f"{'...' if len(without) > 10 else ''}")
    return lambda task, index: ScriptAgent(actions[task.id])


def endpoint_factory(url: str, **kwargs) -> AgentFactory:
    return lambda task, index: EndpointAgent(url, **kwargs)


def make_factory(spec: str, tasks: list[Task], suite_ids=None, **endpoint_kwargs) -> AgentFactory:
    """The factory for script:DIR or endpoint:URL (local:CKPT is served by the caller, then passed as endpoint)."""
    kind, sep, value = spec.partition(":")
    if not sep or not value or kind not in ("script", "endpoint"):
        raise AgentError(f"--agent {spec!r}: expected script:DIR, endpoint:URL or local:CKPT")
    if kind == "script":
        return script_factory(value, tasks, suite_ids)
    return endpoint_factory(value, **endpoint_kwargs)


@dataclass
class SwarmSetup:
    """What an orchestrator episode needs besides its agent: the swarm's limits and, per task, a sub-agent policy.
    `close()` stops any server the policies started (once, at the end of the run)."""

    config: object                                  # env/swarm.py SwarmConfig
    policy_for: Callable[[Task], object]            # task -> SubAgentPolicy
    closers: tuple = ()

    def close(self):
        for close in self.closers:
            close()


def _read_scripts(path: str, where: str) -> dict:
    try:
        with open(path) as f:
            scripts = json.load(f)
    except (OSError, ValueError) as e:
        raise AgentError(f"{where}: cannot read {path} ({e})") from None
    if not isinstance(scripts, dict):
        raise AgentError(f"{where}: {path} must hold a JSON object {{sub-agent name: actions}}")
    return {name: check_actions(actions, f"{path}[{name!r}]") for name, actions in scripts.items()}


def swarm_setup(spec: str, tasks: list[Task], config, agent_url: Optional[str] = None,
                agent_checkpoint: Optional[str] = None, **endpoint_kwargs) -> SwarmSetup:
    """The SwarmSetup for --swarm-subagent-policy SPEC (module docstring). `agent_url` is the URL the orchestrator's
    checkpoint (`agent_checkpoint`) is served on in this process, reused by sub-agents of the same checkpoint."""
    from megatron_ext.env.swarm import EndpointPolicy, ScriptedPolicy, make_subagent_policy

    where = f"--swarm-subagent-policy {spec}"
    kind, _, value = (spec or "").partition(":")
    if kind == "script" and value and os.path.isdir(value):
        scripts = {}
        for task in tasks:
            path = os.path.join(value, f"{task.id}.json")
            scripts[task.id] = _read_scripts(path, where) if os.path.exists(path) else {"*": []}
        known = {t.id for t in tasks}
        if not any(n.endswith(".json") and n[:-len(".json")] in known for n in os.listdir(value)):
            raise AgentError(f"{where}: none of its files names a task of the suite (expected <task id>.json, e.g. "
                             f"{min(known)}.json, holding {{sub-agent name: actions}})")
        policies = {task_id: ScriptedPolicy(s if s else {"*": []}) for task_id, s in scripts.items()}
        return SwarmSetup(config, lambda task: policies[task.id])
    if kind == "local" and value and agent_url is not None and agent_checkpoint is not None and \
            os.path.realpath(value) == os.path.realpath(agent_checkpoint):
        policy = EndpointPolicy(agent_url, **endpoint_kwargs)
        return SwarmSetup(config, lambda task: policy)
    if not spec or spec == "pinned":
        raise AgentError("--agent-mode swarm needs --swarm-subagent-policy script:DIR, script:SCRIPTS.json, "
                         "endpoint:URL or local:CKPT (pinned exists only inside rl_composer.py)")
    policy = make_subagent_policy(spec, **({} if kind == "script" else endpoint_kwargs))
    return SwarmSetup(config, lambda task: policy, (policy.close,))
