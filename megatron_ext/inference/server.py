"""An OpenAI-compatible HTTP endpoint over the inference engine, so RL workers and the evaluation harness talk to
our model exactly as they would to vLLM or SGLang.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (prompt as text or token ids; returns
token ids and, with ``logprobs``, per-token log-probabilities), ``POST /v1/chat/completions`` (messages rendered
with the tokenizer's chat template, when one is given), ``POST /v1/reload`` ({"load": CKPT}: new weights without a
restart, as the RL trainer publishes them). Bad requests get a 4xx with a message and the server keeps serving.
Generation is serialised behind a lock (one model, CPU or one GPU rank); ``"speculative": true`` uses MTP drafting.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

import torch.distributed as dist

from megatron_ext import platform
from megatron_ext.data.sft import IM_END, parse_assistant
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.inference.speculative import SpeculationStats, generate_speculative


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _int(body: dict, key: str, default, lo=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        raise RequestError(f"'{key}' must be an integer{f' >= {lo}' if lo is not None else ''}, got {value!r}")
    return value


def _float(body: dict, key: str, default):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {value!r}")
    return float(value)


class ModelService:
    """Request parsing and generation, independent of HTTP (the handler only moves JSON)."""

    def __init__(self, engine: InferenceEngine, name: str, tokenizer=None,
                 reload: Optional[Callable[[str], None]] = None, peers: Optional["ModelParallelServing"] = None):
        self.engine, self.name, self.tokenizer, self._reload = engine, name, tokenizer, reload
        self.peers = peers
        if tokenizer is not None and engine.detokenize is None:
            engine.detokenize = tokenizer.decode  # stop strings and response text
        self.lock = threading.Lock()
        self.version = 0
        self.stats = SpeculationStats()

    def _sampling(self, body: dict) -> SamplingParams:
        stop = body.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) for s in stop):
            raise RequestError("'stop' must be a string or a list of strings")
        if stop and self.tokenizer is None:
            raise RequestError("'stop' strings need a server started with a tokenizer; use 'stop_token_ids'")
        stop_ids = body.get("stop_token_ids") or ()
        if not all(isinstance(t, int) for t in stop_ids):
            raise RequestError("'stop_token_ids' must be a list of integers")
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise RequestError(f"'seed' must be an integer, got {seed!r}")
        params = SamplingParams(max_tokens=_int(body, "max_tokens", 16, lo=1),
                                temperature=_float(body, "temperature", 1.0), top_p=_float(body, "top_p", 1.0),
                                top_k=_int(body, "top_k", 0, lo=0), seed=seed, stop=tuple(stop),
                                stop_token_ids=tuple(stop_ids), return_routing=bool(body.get("return_routing")))
        try:
            params.validate(self.engine.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return params

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need a server started with a tokenizer; send token ids instead")
            return self.tokenizer.encode(prompt)
        raise RequestError("'prompt' must be a string or a non-empty list of token ids")

    def execute(self, name: str, *args):
        """One engine call; under model parallelism every rank makes it together (`ModelParallelServing`)."""
        platform.ensure_mode_on_this_thread()
        if name == "generate":
            prompt_ids, params, speculative = args
            if speculative:
                return generate_speculative(self.engine, prompt_ids, params, self.stats)
            return self.engine.generate([prompt_ids], params)[0]
        if name == "reload":
            return self._reload(*args)
        if name == "noop":
            return None
        raise ValueError(f"unknown engine call {name!r}")

    def _call(self, name: str, *args):
        if self.peers is not None:
            self.peers.announce(name, args)
        return self.execute(name, *args)

    def _run(self, prompt_ids: list[int], params: SamplingParams, speculative: bool):
        with self.lock:
            try:
                return self._call("generate", prompt_ids, params, speculative)
            except ValueError as e:
                raise RequestError(str(e)) from None

    def _choice(self, completion, want_logprobs: bool) -> dict:
        text = completion.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(completion.token_ids)
        choice = {"index": 0, "text": text, "token_ids": completion.token_ids,
                  "finish_reason": completion.finish_reason}
        if want_logprobs:
            choice["logprobs"] = {"token_ids": completion.token_ids, "token_logprobs": completion.logprobs}
        if completion.routing is not None:
            choice["routing"] = completion.routing.tolist()
        return choice

    def completions(self, body: dict) -> dict:
        prompt_ids = self._prompt_ids(body.get("prompt"))
        completion = self._run(prompt_ids, self._sampling(body), bool(body.get("speculative")))
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "weights_version": self.version,
                "choices": [self._choice(completion, bool(body.get("logprobs")))],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion.token_ids),
                          "total_tokens": len(prompt_ids) + len(completion.token_ids)}}

    def chat(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty list of message objects")
        if self.tokenizer is None or not hasattr(self.tokenizer, "apply_chat_template"):
            raise RequestError("chat completions need a server started with a tokenizer that has a chat template",
                               status=501)
        try:
            prompt_ids = self.tokenizer.apply_chat_template(messages, tools=body.get("tools"),
                                                            add_generation_prompt=True)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RequestError(f"cannot render 'messages': {e}") from None
        params = self._sampling(body)
        end_of_turn = self._end_of_turn()
        if end_of_turn is not None:  # an assistant turn ends at <|im_end|>
            params.stop_token_ids = tuple(params.stop_token_ids) + (end_of_turn,)
        completion = self._run(prompt_ids, params, bool(body.get("speculative")))
        choice = self._choice(completion, bool(body.get("logprobs")))
        choice.pop("text")
        message = {"role": "assistant", **parse_assistant(self.tokenizer, completion.token_ids)}
        if message["tool_calls"]:
            choice["finish_reason"] = "tool_calls"
        else:
            del message["tool_calls"]
        choice["message"] = message
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "weights_version": self.version, "choices": [choice],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion.token_ids)}}

    def _end_of_turn(self):
        try:
            return self.tokenizer.token_id(IM_END)
        except (AttributeError, ValueError):
            return None

    def reload(self, body: dict) -> dict:
        path = body.get("load")
        if not isinstance(path, str) or not path:
            raise RequestError("'load' must name a checkpoint directory")
        if self._reload is None:
            raise RequestError("this server was started without a way to reload weights", status=501)
        with self.lock:
            try:
                self._call("reload", path)
            except Exception as e:  # a bad checkpoint must not take the server down
                raise RequestError(f"cannot load {path}: {e}", status=422) from None
            self.version += 1
        return {"status": "ok", "weights_version": self.version, "load": path}


class ModelParallelServing:
    """The ranks of a model split over tensor- or expert-parallel ranks serve together.

    Rank 0 serves HTTP; before every engine call (generate, reload) it broadcasts the call, and the other ranks,
    waiting in `follow`, make the same call, so the engine's collectives line up. A call that fails fails alike
    everywhere (same inputs, same checks); rank 0 reports it. While idle, rank 0 sends a no-op every
    `heartbeat` seconds so that waiting ranks never reach the process group's timeout."""

    def __init__(self, heartbeat: float = 60.0):
        self.group = None  # the default (world) group: all ranks of the job hold one model
        self.heartbeat = heartbeat
        self._stopped = threading.Event()

    @staticmethod
    def needed() -> bool:
        return dist.is_initialized() and dist.get_world_size() > 1

    def announce(self, name: str, args: tuple):
        box = [(name, args)]
        dist.broadcast_object_list(box, src=0, group=self.group)

    def follow(self, service: ModelService):
        """Ranks other than 0: make every call rank 0 announces until it says stop."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            name, args = box[0]
            if name == "stop":
                return
            try:
                service.execute(name, *args)
            except Exception:  # rank 0 makes the same call, fails the same way and reports it
                pass

    def keep_alive(self, service: ModelService):
        """Rank 0: a background thread sending no-ops while no request comes."""
        def beat():
            while not self._stopped.wait(self.heartbeat):
                with service.lock:
                    if not self._stopped.is_set():
                        self.announce("noop", ())

        threading.Thread(target=beat, daemon=True).start()

    def stop(self, service: ModelService):
        """Rank 0: release the other ranks from `follow`."""
        self._stopped.set()
        with service.lock:
            self.announce("stop", ())


def make_handler(service: ModelService):
    routes_post = {"/v1/completions": service.completions, "/v1/chat/completions": service.chat,
                   "/v1/reload": service.reload}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: one line per request is noise for RL workers
            pass

        def _send(self, status: int, payload: dict):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str):
            self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok", "weights_version": service.version})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": service.name, "object": "model"}]})
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self):
            route = routes_post.get(self.path)
            if route is None:
                return self._error(404, f"no such endpoint: POST {self.path}")
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
            except (ValueError, UnicodeDecodeError) as e:
                return self._error(400, f"request body is not valid JSON: {e}")
            if not isinstance(body, dict):
                return self._error(400, "request body must be a JSON object")
            try:
                self._send(200, route(body))
            except RequestError as e:
                self._error(e.status, str(e))
            except Exception as e:  # keep serving; report the failure to the caller
                self._error(500, f"{type(e).__name__}: {e}")

    return Handler


def serve(service: ModelService, host: str, port: int) -> ThreadingHTTPServer:
    """A started server (in a background thread); call .shutdown() to stop it."""
    server = ThreadingHTTPServer((host, port), make_handler(service))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server
