"""Agents for an episode: scripted tool calls, an OpenAI-compatible endpoint, a local checkpoint behind tools/serve.py.

Each has ``act(messages, tools) -> assistant message`` (the OpenAI chat shape) and ``close()``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import Optional

from megatron_ext.env.episode import SUMMARY_REQUEST

SCRIPT_FINISH = "Scripted agent: all actions played."


class AgentError(RuntimeError):
    """An agent that cannot be built or reached; the message names the cause."""


def load_actions(path: str) -> list[dict]:
    """ACTIONS.json: a JSON list of {"name": ..., "arguments": {...} or a raw argument string}, one per turn; an
    entry that is itself a list of such calls is one turn making several calls (e.g. an orchestrator that creates
    and assigns sub-agents at once).

    The shape of each entry is checked here; the arguments are not (a script may test malformed calls)."""
    try:
        with open(path) as f:
            actions = json.load(f)
    except OSError as e:
        raise AgentError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise AgentError(f"{path}: invalid JSON ({e})") from None
    return check_actions(actions, path)


def check_actions(actions, where: str) -> list:
    """actions, checked to be a list of tool calls (or lists of them, one turn each); errors name `where`."""
    if not isinstance(actions, list):
        raise AgentError(f"{where}: expected a JSON list of tool calls")
    for i, turn in enumerate(actions):
        for a in turn if isinstance(turn, list) and turn else [turn]:
            if not isinstance(a, dict) or not isinstance(a.get("name"), str) or set(a) - {"name", "arguments"}:
                raise AgentError(f"{where}[{i}]: each action is {{\"name\": TOOL, \"arguments\": {{...}}}} (or a "
                                 "non-empty list of them: one turn with several calls)")
    return actions


class ScriptAgent:
    """Plays the given tool calls in order, one per turn (a list of calls: one turn), then calls finish."""

    def __init__(self, actions: list[dict], finish_message: str = SCRIPT_FINISH):
        self.actions, self.finish_message, self.next = list(actions), finish_message, 0

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        if messages[-1]["role"] == "user" and messages[-1]["content"] == SUMMARY_REQUEST:
            played = ", ".join(a["name"] for turn in self.actions[: self.next]
                               for a in (turn if isinstance(turn, list) else [turn])) or "nothing"
            return {"content": f"Scripted agent: played {played}; {len(self.actions) - self.next} actions left."}
        if self.next < len(self.actions):
            action = self.actions[self.next]
            self.next += 1
        else:
            action = {"name": "finish", "arguments": {"message": self.finish_message}}
        calls = []
        for a in action if isinstance(action, list) else [action]:
            arguments = a.get("arguments", {})
            calls.append({"type": "function", "function": {
                "name": a["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        return {"content": "", "tool_calls": calls}

    def close(self):
        pass


class EndpointAgent:
    """A model behind an OpenAI-compatible /v1/chat/completions (tools/serve.py, vLLM, SGLang)."""

    def __init__(self, url: str, model: Optional[str] = None, max_tokens: int = 1024, temperature: float = 0.0,
                 timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        if not self.url.endswith("/v1/chat/completions"):
            self.url += "/v1/chat/completions"
        self.model, self.max_tokens, self.temperature, self.timeout_s = model, max_tokens, temperature, timeout_s

    def act(self, messages: list[dict], tools: list[dict]) -> dict:
        body = {"messages": messages, "tools": tools, "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        if self.model:
            body["model"] = self.model
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.load(response)
        except urllib.error.HTTPError as e:
            raise AgentError(f"{self.url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
        except (urllib.error.URLError, OSError) as e:
            raise AgentError(f"{self.url}: {e}") from None
        try:
            return reply["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise AgentError(f"{self.url}: unexpected reply {str(reply)[:300]}") from None

    def close(self):
        pass


class LocalAgent(EndpointAgent):
    """A checkpoint served by tools/serve.py on a free loopback port for the episode's lifetime."""

    def __init__(self, checkpoint: str, serve_args: tuple = (), startup_timeout_s: float = 900.0, **kwargs):
        serve = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "tools", "serve.py")
        argv = [sys.executable, serve, "--load", checkpoint, "--use-checkpoint-args", "--host", "127.0.0.1",
                "--port", "0", *serve_args]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in self.process.stdout:  # tools/serve.py prints "serving NAME on http://HOST:PORT" when ready
            lines.append(line)
            found = re.search(r"serving .* on (http://\S+)", line)
            if found:
                super().__init__(found.group(1), **kwargs)
                # keep draining the server's output so a full pipe never blocks it
                threading.Thread(target=lambda: self.process.stdout.read(), daemon=True).start()
                return
        self.process.wait()
        raise AgentError(f"tools/serve.py --load {checkpoint} exited ({self.process.returncode}) before serving:\n"
                         + "".join(lines[-20:]))

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def make_agent(spec: str, **endpoint_kwargs):
    """script:ACTIONS.json | endpoint:URL | local:CKPT."""
    kind, sep, value = spec.partition(":")
    if not sep or not value or kind not in ("script", "endpoint", "local"):
        raise AgentError(f"--agent {spec!r}: expected script:ACTIONS.json, endpoint:URL or local:CKPT")
    if kind == "script":
        return ScriptAgent(load_actions(value))
    if kind == "endpoint":
        return EndpointAgent(value, **endpoint_kwargs)
    if not os.path.isdir(value):
        raise AgentError(f"--agent local:{value}: not a checkpoint directory")
    return LocalAgent(value, **endpoint_kwargs)
