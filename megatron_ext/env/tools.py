"""The agent's tools: schemas in the OpenAI function shape (what the Kimi-K2 chat template declares and the server
parses back into ``tool_calls``) and their implementations over a `Sandbox`.

read_file (line ranges), list_dir, grep (regex, globs), edit_file (exact search/replace), write_file,
run_command, todo (add/complete/list) and finish(message). Every call is validated strictly (a JSON object with
exactly the declared fields and types); a malformed or invalid call returns an ``error: ...`` observation, is
recorded as invalid, and never raises. Observations longer than the limit keep their head and tail around a
``[... N characters truncated ...]`` marker. Files are read on the host side, so only regular files up to
`ToolLimits.read_bytes` are opened: a FIFO, socket or device the agent made is refused with an error observation
instead of blocking the trainer.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from megatron_ext.env.sandbox import Sandbox, SandboxError


TOOL_DECLARATIONS = ("full", "compact")
_SHORT: dict[str, str] = {}   # tool name -> its compact description (every _fn schema registers one)
_FULL: dict[str, dict] = {}    # tool name -> its full declaration


def _fn(name: str, description: str, properties: dict, required: list, short: str) -> dict:
    _SHORT[name] = short
    _FULL[name] = {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}
    return _FULL[name]


def declarations(schemas: list[dict], kind: str = "full") -> list[dict]:
    """The tool list an episode declares to the model. "compact" swaps each description for a few words and leaves
    out the constant ``"additionalProperties": false``, so a small model's context holds a multi-turn episode
    (docs/agent-prompt.md has the token counts); names, parameter names, types, enums and required lists are the
    same, and calls are still validated by the full schemas (`SCHEMAS`), extra arguments refused as before."""
    if kind == "full":
        return schemas
    if kind != "compact":
        raise ValueError(f"tool declarations must be one of {TOOL_DECLARATIONS}, got {kind!r}")
    out = []
    for t in schemas:
        fn = t["function"]
        parameters = {k: v for k, v in fn["parameters"].items() if k != "additionalProperties"}
        out.append({**t, "function": {**fn, "description": _SHORT[fn["name"]], "parameters": parameters}})
    return out


def declared_kind(tools) -> str | None:
    """ "full" or "compact" when `tools` is a declaration list of known tools in that form, else None."""
    if not isinstance(tools, list) or not tools:
        return None
    try:
        full = [_FULL[t["function"]["name"]] for t in tools]
    except (KeyError, TypeError):
        return None
    return next((kind for kind in TOOL_DECLARATIONS if tools == declarations(full, kind)), None)


_S, _I, _B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
TOOL_SCHEMAS = [
    _fn("read_file", "Read a text file, with line numbers; optionally only lines start_line..end_line (1-based).",
        {"path": _S, "start_line": _I, "end_line": _I}, ["path"], "Read a file."),
    _fn("list_dir", "List a directory (default: the workspace root) to the given depth (default 1).",
        {"path": _S, "depth": _I}, [], "List a directory."),
    _fn("grep", "Search files for a regular expression (Perl syntax); optional globs such as '*.py' restrict "
        "the files searched.", {"pattern": _S, "path": _S, "globs": {"type": "array", "items": _S},
                                "ignore_case": _B}, ["pattern"], "Search files by regex."),
    _fn("edit_file", "Replace the exact text old_text, which must occur exactly once in the file, by new_text.",
        {"path": _S, "old_text": _S, "new_text": _S}, ["path", "old_text", "new_text"], "Replace unique old_text."),
    _fn("write_file", "Create or overwrite a file with the given content.", {"path": _S, "content": _S},
        ["path", "content"], "Write a file."),
    _fn("run_command", "Run a shell command in the workspace (no network); returns its output and exit code.",
        {"command": _S, "timeout_s": _I}, ["command"], "Run a shell command."),
    _fn("todo", "Keep a todo list: action 'add' (with item), 'complete' (with id) or 'list'.",
        {"action": {"type": "string", "enum": ["add", "complete", "list"]}, "item": _S, "id": _I}, ["action"],
        "Todo list: add, complete, list."),
    _fn("finish", "End the episode with a short message: what you changed and how you checked it.",
        {"message": _S}, ["message"], "End with a summary."),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
EDITING_TOOLS = ("edit_file", "write_file")


class ToolError(ValueError):
    """An invalid tool call; the message is the observation the agent sees."""


@dataclass
class ToolLimits:
    observation_chars: int = 8000     # longer observations are truncated in the middle
    read_lines: int = 400             # most lines read_file returns at once
    command_timeout_s: float = 60.0   # run_command's default and maximum timeout
    list_entries: int = 500
    read_bytes: int = 8 << 20         # largest file read_file/edit_file load into the host process


@dataclass
class ToolCall:
    """One call as the agent made it and what came of it."""

    id: str
    name: str
    arguments: str                    # the raw argument text
    parsed: Optional[dict]            # the validated arguments (None if invalid)
    observation: str
    error: Optional[str] = None       # why the call was invalid (None: valid)

    @property
    def valid(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments, "valid": self.valid,
                "error": self.error, "observation": self.observation}


def _lines(text: str) -> int:
    """Lines a piece of text spans: a final newline ends its last line rather than starting another."""
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - head - tail} characters truncated ...]\n{text[-tail:]}"


def validate(name: str, arguments, schemas: Optional[dict] = None) -> dict:
    """The arguments as a dict, checked against the tool's schema (in `schemas`, default every coding tool's);
    raises ToolError with a precise message."""
    schemas = SCHEMAS if schemas is None else schemas
    if name not in schemas:
        raise ToolError(f"unknown tool {name!r}; tools: {', '.join(schemas)}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ToolError(f"{name}: arguments are not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ToolError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
    schema = schemas[name]
    unknown = set(arguments) - set(schema["properties"])
    if unknown:
        raise ToolError(f"{name}: unknown arguments {sorted(unknown)}; allowed: {sorted(schema['properties'])}")
    missing = [k for k in schema["required"] if k not in arguments]
    if missing:
        raise ToolError(f"{name}: missing required arguments {missing}")
    for key, value in arguments.items():
        spec = schema["properties"][key]
        ok = {"string": lambda v: isinstance(v, str),
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool),
              "array": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}[spec["type"]](value)
        if not ok:
            raise ToolError(f"{name}: argument '{key}' must be {spec['type']}"
                            f"{' of strings' if spec['type'] == 'array' else ''}, got {type(value).__name__}")
        if "enum" in spec and value not in spec["enum"]:
            raise ToolError(f"{name}: argument '{key}' must be one of {spec['enum']}, got {value!r}")
    return arguments


@dataclass
class Todo:
    id: int
    item: str
    done: bool = False


@dataclass
class Toolbox:
    """The tools of one episode over one sandbox; keeps the todo list and the record of every call. A subclass (or
    an instance) that sets `schemas` offers other tools: each named tool NAME is the method `_NAME`."""

    schemas: ClassVar[dict] = SCHEMAS
    sandbox: Sandbox
    limits: ToolLimits = field(default_factory=ToolLimits)
    calls: list = field(default_factory=list)
    todos: list = field(default_factory=list)
    finished: Optional[str] = None   # the finish message, once finish was called

    def call(self, name: str, arguments, call_id: str = "") -> ToolCall:
        """Run one call; never raises for anything the agent sent."""
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        try:
            parsed = validate(name, arguments, self.schemas)
            observation = getattr(self, "_" + name)(**parsed)
            record = ToolCall(call_id, name, raw, parsed, truncate(observation, self.limits.observation_chars))
        except (ToolError, SandboxError) as e:
            record = ToolCall(call_id, name, raw, None, f"error: {e}", error=str(e))
        self.calls.append(record)
        return record

    @property
    def invalid_calls(self) -> int:
        return sum(not c.valid for c in self.calls)

    @property
    def unfinished_todos(self) -> int:
        return sum(not t.done for t in self.todos)

    def _text(self, path: str) -> str:
        data = self.sandbox.read_file(path, max_bytes=self.limits.read_bytes)
        if b"\0" in data[:8192]:
            raise ToolError(f"{path}: binary file")
        return data.decode("utf-8", "replace")

    # ---- the tools (arguments already validated) --------------------------------------------------------
    def _read_file(self, path: str, start_line: int = 1, end_line: Optional[int] = None) -> str:
        lines = self._text(path).splitlines()
        if start_line < 1 or (end_line is not None and end_line < start_line):
            raise ToolError(f"read_file: need 1 <= start_line <= end_line, got {start_line}..{end_line}")
        if lines and start_line > len(lines):
            raise ToolError(f"read_file: {path} has {len(lines)} lines; start_line {start_line} is past the end")
        last = min(len(lines), end_line or len(lines), start_line + self.limits.read_lines - 1)
        out = [f"{n:6d}\t{lines[n - 1]}" for n in range(start_line, last + 1)]
        if last < (end_line or len(lines)):
            out.append(f"[... showing lines {start_line}-{last} of {len(lines)}; read on with start_line={last + 1}]")
        return "\n".join(out) if out else f"{path} is empty"

    def _run(self, command: str, timeout_s: Optional[float] = None):
        return self.sandbox.exec(command, timeout_s=timeout_s or self.limits.command_timeout_s)

    def _list_dir(self, path: str = ".", depth: int = 1) -> str:
        if depth < 1 or depth > 5:
            raise ToolError("list_dir: depth must be between 1 and 5")
        r = self._run(f"find {shlex.quote(path)} -mindepth 1 -maxdepth {depth} -not -path '*/.*/*' "
                      f"-printf '%y %P\\n' | LC_ALL=C sort -k2 | head -n {self.limits.list_entries + 1}")
        if not r.ok or r.output.startswith("find:"):
            raise ToolError(f"list_dir: {r.output.strip() or 'failed'}")
        entries = [line.split(" ", 1) for line in r.output.splitlines() if " " in line]
        lines = [f"{p}/" if kind == "d" else p for kind, p in entries[: self.limits.list_entries]]
        if len(entries) > self.limits.list_entries:
            lines.append(f"[... more than {self.limits.list_entries} entries; list a subdirectory]")
        return "\n".join(lines) if lines else f"{path} is empty"

    def _grep(self, pattern: str, path: str = ".", globs: Optional[list] = None, ignore_case: bool = False) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ToolError(f"grep: invalid regular expression {pattern!r} ({e})") from None
        flags = "-rnIP" + ("i" if ignore_case else "")
        includes = " ".join(f"--include={shlex.quote(g)}" for g in globs or [])
        r = self._run(f"grep {flags} --exclude-dir=.git {includes} -e {shlex.quote(pattern)} -- {shlex.quote(path)}")
        if r.killed:
            return r.describe()
        if r.exit_code == 1:
            return "no matches"
        if r.exit_code != 0:
            raise ToolError(f"grep: {r.output.strip()}")
        return r.output.rstrip("\n")

    def _edit_file(self, path: str, old_text: str, new_text: str) -> str:
        if not old_text:
            raise ToolError("edit_file: old_text is empty; use write_file to create a file")
        text = self._text(path)
        count = text.count(old_text)
        if count == 0:
            raise ToolError(f"edit_file: old_text not found in {path}; copy it exactly (whitespace included) from "
                            "read_file output, without the line numbers")
        if count > 1:
            start, where = 0, []
            for _ in range(count):
                start = text.index(old_text, start)
                where.append(text.count("\n", 0, start) + 1)
                start += 1
            raise ToolError(f"edit_file: old_text occurs {count} times in {path} (lines "
                            f"{', '.join(map(str, where))}); include more surrounding text so it is unique")
        self.sandbox.write_file(path, text.replace(old_text, new_text).encode())
        line = text.count("\n", 0, text.index(old_text)) + 1
        return f"edited {path}: replaced {_lines(old_text)} line(s) at line {line} with {_lines(new_text)} line(s)"

    def _write_file(self, path: str, content: str) -> str:
        self.sandbox.write_file(path, content.encode())
        return f"wrote {path} ({_lines(content)} lines, {len(content.encode())} bytes)"

    def _run_command(self, command: str, timeout_s: Optional[int] = None) -> str:
        if not command.strip():
            raise ToolError("run_command: command is empty")
        if timeout_s is not None and not 1 <= timeout_s <= self.limits.command_timeout_s:
            raise ToolError(f"run_command: timeout_s must be between 1 and {self.limits.command_timeout_s:g}")
        return self._run(command, timeout_s).describe()

    def _todo(self, action: str, item: Optional[str] = None, id: Optional[int] = None) -> str:
        if action == "add":
            if not item or not item.strip() or id is not None:
                raise ToolError("todo: 'add' takes a non-empty 'item' (and no 'id')")
            self.todos.append(Todo(len(self.todos) + 1, item.strip()))
        elif action == "complete":
            if id is None or item is not None:
                raise ToolError("todo: 'complete' takes the 'id' of an item (and no 'item')")
            if not 1 <= id <= len(self.todos):
                raise ToolError(f"todo: no item {id}; ids are 1..{len(self.todos)}")
            self.todos[id - 1].done = True
        elif item is not None or id is not None:
            raise ToolError("todo: 'list' takes no other arguments")
        return "\n".join(f"{t.id}. [{'x' if t.done else ' '}] {t.item}" for t in self.todos) or "todo list is empty"

    def _finish(self, message: str) -> str:
        if not message.strip():
            raise ToolError("finish: message is empty; say what you changed and how you checked it")
        self.finished = message
        return "finished"
