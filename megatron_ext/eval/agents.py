"""`--agent SPEC` for a whole suite: a factory that gives each episode its agent.

* ``script:DIR``: DIR/<task id>.json holds the task's tool calls in the environment's ACTIONS.json format
  (megatron_ext/env/agents.py `load_actions`), played in order, then finish; a task without a file gets no actions
  (it finishes at once). Every file is checked before the run starts.
* ``endpoint:URL``: any OpenAI-compatible /v1/chat/completions (``--model NAME`` is sent as the model);
* ``local:CKPT``: tools/run_eval.py serves the checkpoint in this process (tools/serve.py's model service on a
  free loopback port) and hands its URL here as an endpoint.

The factory is called once per episode (scripted agents keep a cursor, so each episode gets its own).
"""

from __future__ import annotations

import os
from typing import Callable

from megatron_ext.env.agents import AgentError, EndpointAgent, ScriptAgent, load_actions
from megatron_ext.env.tasks import Task

AgentFactory = Callable[[Task, int], object]  # (task, pass index) -> an agent with act() and close()


def script_factory(folder: str, tasks: list[Task]) -> AgentFactory:
    if not os.path.isdir(folder):
        raise AgentError(f"--agent script:{folder}: not a directory (one <task id>.json actions file per task)")
    actions = {}
    for task in tasks:
        path = os.path.join(folder, f"{task.id}.json")
        actions[task.id] = load_actions(path) if os.path.exists(path) else []
    known = {t.id for t in tasks}
    strays = sorted(n for n in os.listdir(folder) if n.endswith(".json") and n[:-len(".json")] not in known)
    if strays and not any(actions.values()):
        raise AgentError(f"--agent script:{folder}: none of its files names a task of the suite (found "
                         f"{strays[:5]}; expected <task id>.json, e.g. {min(known)}.json)")
    return lambda task, index: ScriptAgent(actions[task.id])


def endpoint_factory(url: str, **kwargs) -> AgentFactory:
    return lambda task, index: EndpointAgent(url, **kwargs)


def make_factory(spec: str, tasks: list[Task], **endpoint_kwargs) -> AgentFactory:
    """The factory for script:DIR or endpoint:URL (local:CKPT is served by the caller, then passed as endpoint)."""
    kind, sep, value = spec.partition(":")
    if not sep or not value or kind not in ("script", "endpoint"):
        raise AgentError(f"--agent {spec!r}: expected script:DIR, endpoint:URL or local:CKPT")
    if kind == "script":
        return script_factory(value, tasks)
    return endpoint_factory(value, **endpoint_kwargs)
