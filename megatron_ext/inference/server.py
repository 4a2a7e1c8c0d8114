"""An OpenAI-compatible HTTP endpoint over the inference engine, so RL workers and the evaluation harness talk to
our model exactly as they would to vLLM or SGLang.

Endpoints: ``GET /health``, ``GET /v1/models`` (with ``max_model_len``, the context length, as vLLM reports it),
``POST /v1/completions`` (prompt as text or token ids; returns token ids and, with ``logprobs``, per-token
log-probabilities), ``POST /v1/chat/completions`` (messages rendered with the tokenizer's chat template, when one
is given; a request that does not fit the context gets a 400 with ``prompt_tokens`` and ``max_model_len``),
``POST /v1/reload`` ({"load": CKPT}: new weights without a
restart, as the RL trainer publishes them; validated first, the previous weights keep serving if it fails).
SGLang's native shapes (``POST /generate``, ``POST /update_weights_from_disk``, ``GET /get_model_info``, ``GET
/health_generate``; inference/native.py) serve clients written for SGLang deployments (rl/remote.py).
``"n"`` samples share the prompt's prefill, ``"stream": true`` answers with server-sent events in OpenAI's chunk
format, ``"speculative": true`` uses MTP drafting. Bad requests get a 4xx naming the field and the server keeps
serving.

FastAPI on uvicorn serves HTTP; requests are parsed and validated on the event loop and queued. One batching
thread runs the engine: it takes every request queued (up to `max_batch_rows` samples) into one batched
generation, so requests arriving while a batch runs join the next one. Under model parallelism the batching
thread of rank 0 announces each engine call to the other ranks (ModelParallelServing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import socket
import threading
import time
import uuid
from typing import Callable, Optional

import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from megatron_ext import platform
from megatron_ext.data.sft import IM_END, parse_assistant
from megatron_ext.inference import native
from megatron_ext.inference.engine import InferenceEngine, SamplingParams
from megatron_ext.inference.protocol import (MAX_N, Job, RequestError, bool_field, check_unicode, float_field,
                                             int_field)
from megatron_ext.inference.speculative import SpeculationStats
from megatron_ext.inference.speculative_batch import generate_speculative_groups

SEED_MAX = 2**63 - 1 - MAX_N  # a 64-bit signed seed, and sample j of n draws with seed + j


def _tools(value):
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError(f"'tools' must be a list of tool objects, got {type(value).__name__}")
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"'tools[{i}].function.name' must be a non-empty string")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise RequestError(f"'tools[{i}].function.parameters' must be a JSON schema object")
        if "description" in fn and not isinstance(fn["description"], str):
            raise RequestError(f"'tools[{i}].function.description' must be a string")
    return value


class ModelService:
    """Request parsing, the batching loop and responses, independent of HTTP (the app only moves JSON)."""

    def __init__(self, engine: InferenceEngine, name: str, tokenizer=None,
                 reload: Optional[Callable[[str], None]] = None, peers: Optional["ModelParallelServing"] = None,
                 max_batch_rows: int = 64, speculation: str = "always"):
        if speculation not in ("auto", "always"):
            raise ValueError(f"speculation must be 'auto' or 'always', got {speculation!r}")
        self.engine, self.name, self.tokenizer, self._reload = engine, name, tokenizer, reload
        self.speculation = speculation  # "auto": speculative batches that would not gain decode plainly
        self.peers, self.max_batch_rows = peers, max_batch_rows
        self.random_weights = False  # tools/serve.py --random-weights, until a checkpoint is reloaded
        if tokenizer is not None:
            if engine.detokenize is None:
                engine.detokenize = tokenizer.decode  # stop strings and response text
            engine.set_vocab_size(tokenizer.vocab_size)  # the embedding's padding rows are never sampled
        self.lock = threading.Lock()  # one engine call at a time (batches, reloads, heartbeats)
        self.stats = SpeculationStats()
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._loop_thread: Optional[threading.Thread] = None
        self._loop_start = threading.Lock()

    @property
    def version(self) -> int:
        return self.engine.weights_version

    # ---------------------------------------------------------------------------------------------------
    # parsing
    # ---------------------------------------------------------------------------------------------------

    def _sampling(self, body: dict) -> SamplingParams:
        stop = body.get("stop")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"'stop' must be a string or a list of non-empty strings, got {body.get('stop')!r}")
        if stop and self.tokenizer is None:
            raise RequestError("'stop' strings need a server started with a tokenizer; use 'stop_token_ids'")
        stop_ids = body.get("stop_token_ids")
        stop_ids = [] if stop_ids is None else stop_ids
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise RequestError(f"'stop_token_ids' must be a list of integers, got {body.get('stop_token_ids')!r}")
        params = SamplingParams(max_tokens=int_field(body, "max_tokens", 16, lo=1),
                                temperature=float_field(body, "temperature", 1.0),
                                top_p=float_field(body, "top_p", 1.0),
                                top_k=int_field(body, "top_k", 0, lo=0), seed=int_field(body, "seed", None, lo=0, hi=SEED_MAX),
                                stop=tuple(stop), stop_token_ids=tuple(stop_ids),
                                return_routing=bool_field(body, "return_routing"))
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

    def _job(self, kind: str, body: dict, prompt_ids: list[int], params: SamplingParams) -> Job:
        n = int_field(body, "n", 1, lo=1, hi=MAX_N)
        speculative, stream = bool_field(body, "speculative"), bool_field(body, "stream")
        logprobs = body.get("logprobs")
        if logprobs is not None and not (isinstance(logprobs, bool) or (isinstance(logprobs, int) and logprobs >= 0)):
            raise RequestError(f"'logprobs' must be true/false or an integer >= 0, got {logprobs!r}")
        if not isinstance(logprobs, bool) and isinstance(logprobs, int) and logprobs > 1:
            raise RequestError(f"'logprobs' {logprobs}: this server returns the sampled token's logprob only (top-N "
                               "alternatives are not implemented); send 1 or true")
        if speculative and not self.engine.mtp_layers:
            raise RequestError("'speculative' needs a model with MTP layers (--mtp-num-layers >= 1)")
        if n > self.max_batch_rows:
            raise RequestError(f"'n' is at most {self.max_batch_rows} on this server, got {n}")
        self.check_context(len(prompt_ids), params.max_tokens)
        try:
            self.engine.check_request([prompt_ids], [params])
        except ValueError as e:
            raise RequestError(str(e)) from None
        return Job(kind, prompt_ids, params, n, speculative, stream, bool(logprobs))

    @property
    def context_length(self) -> int:
        """The longest prompt + generation the model serves (GET /v1/models reports it as max_model_len)."""
        return self.engine.model.max_sequence_length

    def check_context(self, prompt_tokens: int, max_tokens: int):
        """A request that does not fit the context gets a 400 naming both numbers, and the fields prompt_tokens
        and max_model_len, so that a client can ask again with max_tokens = max_model_len - prompt_tokens."""
        context = self.context_length
        if prompt_tokens + max_tokens <= context:
            return
        fix = (f"at most {context - prompt_tokens} tokens fit: lower max_tokens" if prompt_tokens < context else
               "the prompt alone fills it: shorten the messages, or serve with a longer --inference-max-seq-length")
        total = prompt_tokens + max_tokens
        raise RequestError(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
                           f"exceeds the model's context of {context} tokens; {fix}",
                           fields={"reason": "context_length_exceeded", "param": "max_tokens",
                                   "prompt_tokens": prompt_tokens, "max_model_len": context})

    def parse_completion(self, body: dict) -> Job:
        check_unicode(body, "body")
        return self._job("completion", body, self._prompt_ids(body.get("prompt")), self._sampling(body))

    def parse_chat(self, body: dict) -> Job:
        check_unicode(body, "body")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty list of message objects")
        tools = _tools(body.get("tools"))
        if tools and bool_field(body, "stream"):
            raise RequestError("'stream' with 'tools' is not supported: tool calls are parsed from the whole "
                               "reply; send \"stream\": false")
        if self.tokenizer is None or not hasattr(self.tokenizer, "apply_chat_template"):
            raise RequestError("chat completions need a server started with a tokenizer that has a chat template",
                               status=501)
        try:
            prompt_ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RequestError(f"cannot render 'messages': {e}") from None
        params = self._sampling(body)
        end_of_turn = self._end_of_turn()
        if end_of_turn is not None:  # an assistant turn ends at <|im_end|>
            params.stop_token_ids = tuple(params.stop_token_ids) + (end_of_turn,)
        return self._job("chat", body, prompt_ids, params)

    def _end_of_turn(self):
        try:
            return self.tokenizer.token_id(IM_END)
        except (AttributeError, ValueError):
            return None

    # ---------------------------------------------------------------------------------------------------
    # the batching loop
    # ---------------------------------------------------------------------------------------------------

    def submit(self, job: Job) -> concurrent.futures.Future:
        if self._loop_thread is None:
            with self._loop_start:
                if self._loop_thread is None:
                    self._loop_thread = threading.Thread(target=self._batching_loop, daemon=True)
                    self._loop_thread.start()
        self._queue.put(job)
        return job.future

    def stop_batching(self):
        if self._loop_thread is not None:
            self._queue.put(None)
            self._loop_thread.join(timeout=60)

    def _batching_loop(self):
        platform.ensure_mode_on_this_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch, rows = [job], job.n
            while rows < self.max_batch_rows:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(job)
                rows += job.n
            with self.lock:
                self._run_batch(batch)

    def _run_batch(self, batch: list[Job]):
        plain = [j for j in batch if not j.speculative and not j.future.done()]
        if plain:
            self._settle(plain, lambda: self._call("generate", [j.prompt_ids for j in plain], [j.n for j in plain],
                                                   [j.params for j in plain], on_token=_row_callback(plain)))
        drafted = [j for j in batch if j.speculative and not j.future.done()]
        if drafted:  # every speculative sample of the batch drafts and verifies together
            self._settle(drafted, lambda: self._call("speculative_groups", [j.prompt_ids for j in drafted],
                                                     [j.n for j in drafted], [j.params for j in drafted],
                                                     on_token=_row_callback(drafted)))

    @staticmethod
    def _settle(jobs: list[Job], run):
        try:
            results = run()
        except ValueError as e:
            for job in jobs:
                job.future.set_exception(RequestError(str(e)))
        except Exception as e:  # noqa: BLE001 - reported to the callers; the server keeps serving
            for job in jobs:
                job.future.set_exception(e)
        else:
            for job, completions in zip(jobs, results):
                job.future.set_result(completions)

    def execute(self, name: str, *args, on_token=None):
        """One engine call; under model parallelism every rank makes it together (`ModelParallelServing`).
        `on_token` (rank 0 only, never announced) sees each token as it is drawn."""
        platform.ensure_mode_on_this_thread()
        if name == "generate":
            prompts, counts, params = args
            return self.engine.generate_groups(prompts, counts, params, on_token=on_token)
        if name == "speculative_groups":
            prompts, counts, params = args
            return generate_speculative_groups(self.engine, prompts, counts, params, self.stats, on_token=on_token,
                                               policy=self.speculation)
        if name == "reload":  # (path) or (path, version): new weights, the version given or the next one
            path, version = args if len(args) == 2 else (args[0], None)
            self._reload(path)
            self.engine.weights_version = self.engine.weights_version + 1 if version is None else version
            return self.engine.weights_version
        if name == "noop":
            return None
        raise ValueError(f"unknown engine call {name!r}")

    def _call(self, name: str, *args, on_token=None):
        if self.peers is not None:
            self.peers.announce(name, args)
        return self.execute(name, *args, on_token=on_token)

    # ---------------------------------------------------------------------------------------------------
    # responses
    # ---------------------------------------------------------------------------------------------------

    def _text(self, completion) -> Optional[str]:
        if completion.text is not None or self.tokenizer is None:
            return completion.text
        return self.tokenizer.decode(completion.token_ids)

    def _choice(self, job: Job, index: int, completion) -> dict:
        choice = {"index": index, "token_ids": completion.token_ids, "finish_reason": completion.finish_reason}
        if job.logprobs:
            choice["logprobs"] = {"token_ids": completion.token_ids, "token_logprobs": completion.logprobs,
                                  "sampled_logprobs": completion.sampled_logprobs}
        if completion.routing is not None:
            choice["routing"] = completion.routing.tolist()
        if job.kind == "completion":
            choice["text"] = self._text(completion)
            return choice
        message = {"role": "assistant", **parse_assistant(self.tokenizer, completion.token_ids)}
        if message["tool_calls"]:
            choice["finish_reason"] = "tool_calls"
        else:
            del message["tool_calls"]
        choice["message"] = message
        return choice

    def respond(self, job: Job, completions: list) -> dict:
        completion_tokens = sum(len(c.token_ids) for c in completions)
        chat = job.kind == "chat"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "weights_version": completions[0].versions[0],  # the version that generated it
                "choices": [self._choice(job, i, c) for i, c in enumerate(completions)],
                "usage": {"prompt_tokens": len(job.prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(job.prompt_ids) + completion_tokens}}

    def reload(self, body: dict) -> dict:
        path = body.get("load")
        if not isinstance(path, str) or not path:
            raise RequestError("'load' must name a checkpoint directory")
        return {"status": "ok", "weights_version": self.reload_checkpoint(path), "load": path}

    def reload_checkpoint(self, path: str, version: Optional[int] = None) -> int:
        """Validated reload of every rank's weights from `path` (the previous weights keep serving on failure);
        the new weights_version (`version`, or the old one + 1)."""
        from megatron_ext.inference.reload import ReloadError

        if self._reload is None:
            raise RequestError("this server was started without a way to reload weights", status=501)
        with self.lock:
            try:
                version = self._call("reload", path) if version is None else self._call("reload", path, version)
                self.random_weights = False
                return version
            except ReloadError as e:
                raise RequestError(f"cannot load {path}: {e}", status=e.status) from None
            except Exception as e:  # noqa: BLE001 - a bad checkpoint must not take the server down
                raise RequestError(f"cannot load {path}: {type(e).__name__}: {e}", status=500) from None


def _row_callback(jobs: list[Job]):
    """An engine call's per-row token callback (rows job by job, sample by sample) to each job's own."""
    rows = [(j, s) for j in jobs for s in range(j.n)]

    def on_token(row, token, logprob):
        job, sample = rows[row]
        if job.on_token is not None:
            job.on_token(sample, token, logprob)

    return on_token


class _Stream:
    """Server-sent events for one streamed request, in OpenAI's chunk format: a chunk per drawn token (text
    deltas hold back what could still turn into a stop string), then each sample's finish reason, then
    ``data: [DONE]``."""

    def __init__(self, service: ModelService, job: Job, loop: asyncio.AbstractEventLoop):
        self.service, self.job, self.loop = service, job, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.tokens = [[] for _ in range(job.n)]
        self.sent = [""] * job.n
        self.holdback = max((len(s) for s in job.params.stop), default=1) - 1
        self.id = f"{'chatcmpl' if job.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:12]}"
        job.on_token = lambda sample, token, logprob: self._post(("token", sample, token, logprob))
        job.future.add_done_callback(lambda f: self._post(("done",)))

    def _post(self, event):
        """From the batching thread; a closed loop (the server stopping) must not fail the batch."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass

    def _chunk(self, choices: list[dict], version: Optional[int] = None) -> bytes:
        chat = self.job.kind == "chat"
        payload = {"id": self.id, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": int(time.time()), "model": self.service.name, "choices": choices}
        if version is not None:
            payload["weights_version"] = version
        return f"data: {json.dumps(payload)}\n\n".encode()

    def _delta(self, sample: int, text: Optional[str], final: bool) -> Optional[str]:
        """The new text of a sample to send now (None without a tokenizer)."""
        if text is None:
            return None
        ready = text if final else text[: max(len(text) - self.holdback, 0)]
        if not ready.startswith(self.sent[sample]):
            return ""  # the detokenizer revised earlier text (a partial multi-byte character): nothing new
        delta = ready[len(self.sent[sample]):]
        self.sent[sample] = ready
        return delta

    def _choice(self, sample: int, text: Optional[str], tokens: list[int], logprobs: list[float],
                finish_reason: Optional[str]) -> dict:
        choice = {"index": sample, "finish_reason": finish_reason, "token_ids": tokens}
        if self.job.kind == "chat":
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text if text is not None else ""
        if self.job.logprobs:
            choice["logprobs"] = {"token_logprobs": logprobs}
        return choice

    async def events_bytes(self):
        job, tokenizer = self.job, self.service.tokenizer
        if job.kind == "chat":
            yield self._chunk([{"index": s, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                               for s in range(job.n)])
        while True:
            event = await self.events.get()
            if event[0] == "token":
                _, sample, token, logprob = event
                self.tokens[sample].append(token)
                text = None
                if tokenizer is not None:
                    ids = self.tokens[sample]
                    if job.kind == "chat" and self.service._end_of_turn() in ids:
                        ids = ids[: ids.index(self.service._end_of_turn())]
                    text = self._delta(sample, tokenizer.decode(ids), final=False)
                yield self._chunk([self._choice(sample, text, [token], [logprob], None)])
                continue
            break
        try:
            completions = job.future.result()
        except Exception as e:  # noqa: BLE001 - the stream has started: report the error in it
            status = e.status if isinstance(e, RequestError) else 500
            yield f"data: {json.dumps({'error': {'message': str(e), 'code': status}})}\n\n".encode()
        else:
            for sample, completion in enumerate(completions):
                full = self.service._choice(job, sample, completion)
                text = full.get("text") if job.kind == "completion" else full["message"].get("content")
                delta = self._delta(sample, text, final=True) if tokenizer is not None else None
                yield self._chunk([self._choice(sample, delta, [], [], full["finish_reason"])],
                                  version=completion.versions[0])
        yield b"data: [DONE]\n\n"


def create_app(service: ModelService):
    """The FastAPI application serving `service`."""
    app = FastAPI(title=f"megatron_ext serving {service.name}", docs_url=None, redoc_url=None, openapi_url=None)

    def error(status: int, message: str, fields: Optional[dict] = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status,
                                       **(fields or {})}}, status_code=status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error(404, f"no such endpoint: {request.method} {request.url.path}")
        return error(exc.status_code, str(exc.detail))

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    async def generation(request: Request, parse):
        try:
            job = parse(await body_of(request))
        except RequestError as e:
            return error(e.status, str(e), e.fields)
        if job.stream:
            stream = _Stream(service, job, asyncio.get_running_loop())
            service.submit(job)
            return StreamingResponse(stream.events_bytes(), media_type="text/event-stream")
        try:
            completions = await asyncio.wrap_future(service.submit(job))
            return JSONResponse(service.respond(job, completions))
        except RequestError as e:
            return error(e.status, str(e))
        except Exception as e:  # noqa: BLE001 - keep serving; report the failure to the caller
            return error(500, f"{type(e).__name__}: {e}")

    random = {"random_weights": True}  # said only when true: a checkpoint's answers stay as before

    @app.get("/health")
    async def health():
        return {"status": "ok", "weights_version": service.version, **(random if service.random_weights else {})}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.name, "object": "model",
                                            "max_model_len": service.context_length,
                                            **(random if service.random_weights else {})}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, service.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generation(request, service.parse_chat)

    @app.post("/v1/reload")
    async def reload(request: Request):
        try:
            body = await body_of(request)
            return await asyncio.to_thread(service.reload, body)
        except RequestError as e:
            return error(e.status, str(e))

    # SGLang's native protocol (inference/native.py)
    @app.post("/generate")
    async def generate(request: Request):
        try:
            parsed = native.parse_generate(service, await body_of(request))
            results = await asyncio.gather(*(asyncio.wrap_future(service.submit(j)) for j in parsed.jobs))
            return JSONResponse(native.respond(service, parsed, results))
        except RequestError as e:
            return error(e.status, str(e))
        except Exception as e:  # noqa: BLE001 - keep serving; report the failure to the caller
            return error(500, f"{type(e).__name__}: {e}")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        try:
            path, version = native.parse_update(await body_of(request))
            version = await asyncio.to_thread(service.reload_checkpoint, path, version)
        except RequestError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=e.status)
        return {"success": True, "message": f"loaded {path}; weights version {version}", "num_paused_requests": 0,
                "weight_version": str(version)}

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info():
        return native.model_info(service)

    @app.get("/health_generate")
    async def health_generate():
        """A one-token generation through the batching loop: the engine answers, not just HTTP."""
        job = Job("native", [0], SamplingParams(max_tokens=1, temperature=0.0), 1, False, False, False)
        try:
            await asyncio.wrap_future(service.submit(job))
        except Exception as e:  # noqa: BLE001
            return error(503, f"generation failed: {type(e).__name__}: {e}")
        return {"status": "ok", "weights_version": service.version}

    return app


class HTTPServer:
    """uvicorn serving the app from a background thread on a socket bound here (so port 0 works and the
    backlog is ours)."""

    def __init__(self, service: ModelService, host: str, port: int, backlog: int = 2048):
        import uvicorn

        self.service = service
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.socket.listen(backlog)
        self.server_address = self.socket.getsockname()[:2]
        config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, loop="asyncio",
                                http="h11", lifespan="off", backlog=backlog, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port}")

    def shutdown(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()
        self.service.stop_batching()


def serve(service: ModelService, host: str, port: int) -> HTTPServer:
    """A started server (in a background thread); call .shutdown() to stop it."""
    return HTTPServer(service, host, port)


class ModelParallelServing:
    """The ranks of a model split over tensor- or expert-parallel ranks serve together.

    Rank 0 serves HTTP; before every engine call (a generation batch, a reload) its batching thread broadcasts
    the call, and the other ranks, waiting in `follow`, make the same call, so the engine's collectives line up.
    A generation that fails fails alike everywhere (same inputs, same checks) and rank 0 reports it; a reload
    agrees on every rank's outcome itself (CheckpointReload), so rank 0 reports any rank's failure. While idle,
    rank 0 sends a no-op every `heartbeat` seconds so that waiting ranks never reach the process group's
    timeout."""

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
            except Exception:  # noqa: BLE001 - rank 0 fails the same way (or learns the reload's outcome)
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
