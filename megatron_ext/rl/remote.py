"""GenerateFn over remote inference servers speaking SGLang's native protocol (ours: tools/serve.py; or SGLang).

    gen = RemoteGenerate(["http://node1:30000", "http://node2:30000"])
    groups = gen(prompts, n, Sampling(max_tokens=512, seed=7, return_routing=True))   # list[list[Sample]]
    gen.reload("/ckpts/rl/v12", version=12)   # every server loads the directory, then reports version 12

Token ids in, token ids out: a prompt goes as ``input_ids``, the sample is the ``output_ids`` the server drew, with
per-token raw log-probabilities (``meta_info.output_token_logprobs``), the weights version of every token, and the
routed experts for replay (base64 int32 in ``meta_info.routed_experts``). Nothing is ever re-tokenised.

Each prompt is one HTTP request carrying its n samples (``input_ids`` repeated n times, sample j seeded with
seed + i * n + j, exactly as EngineGenerate seeds them, so the same seeds give the same tokens as the local engine
on the same weights); the requests of a call run concurrently, each sent to the server with the fewest requests
in flight. Our server folds the repeated prompt back into one shared prefill; SGLang shares it through its
prefix cache.

Failures raise a `RemoteServerError` naming the server:
  `ServerUnavailable` (retryable = True): the server could not be reached, closed the connection or died
      mid-request, timed out, answered 5xx, or aborted the request. The generation did not happen on that
      server; the caller (the orchestrator) requeues the prompts of the call (`prompt_indices`) on other workers.
  `RequestRejected` (retryable = False): a 4xx; the request itself is wrong (the message is the server's).
  `BadResponse` (retryable = False): the answer lacks a field or does not add up (a protocol mismatch).
  `ReloadFailed`: a server did not load the weights or did not reach the version in time.

Against SGLang itself: start it with ``--enable-return-routed-experts`` for routing replay and
``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so the logprobs are the raw distribution's at any temperature; it also stops at
the tokenizer's EOS ids, so put them in ``stop_token_ids`` for identical behaviour; its routing has no row for the
last generated token (never an input to the trainer) and it sends one weight version per request; pass
``routing_shape=(moe_layers, topk)`` since its /get_model_info does not say. See docs/design-notes.md.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from megatron_ext.rl.rollout import Sampling
from megatron_ext.rl.types import Sample


class RemoteServerError(RuntimeError):
    """A remote server failed; `url` names it, `prompt_indices` the prompts of the call it did not answer."""

    retryable = False

    def __init__(self, url: str, message: str, prompt_indices: Sequence[int] = ()):
        super().__init__(f"{url}: {message}")
        self.url, self.prompt_indices = url, list(prompt_indices)


class ServerUnavailable(RemoteServerError):
    """Unreachable, died mid-request, timed out, 5xx or aborted: requeue the prompts on another worker."""

    retryable = True


class RequestRejected(RemoteServerError):
    """The server refused the request (4xx): sending it again elsewhere fails the same way."""


class BadResponse(RemoteServerError):
    """The answer is not the protocol's (a field missing or inconsistent)."""


class ReloadFailed(RemoteServerError):
    """A server did not load new weights, or did not report the version in time."""


def _version(value, url: str, prompts: Sequence[int] = ()) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if value == "default":  # SGLang's name for the weights it started with
        return 0
    raise BadResponse(url, f"weight_version {value!r} is not an integer version (publish weights with "
                           "weight_version=str(step))", prompts)


class RemoteGenerate:
    """`GenerateFn` (rollout.py) over SGLang-native HTTP servers; `reload(path, version)` publishes weights."""

    def __init__(self, urls: Sequence[str], timeout: float = 3600.0, max_concurrency: int = 64,
                 routing_shape: Optional[tuple[int, int]] = None, reload_timeout: float = 1800.0,
                 connect_timeout: float = 10.0, speculative: bool = False):
        urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not urls:
            raise ValueError("RemoteGenerate needs at least one server URL")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"server URLs must start with http:// or https://, got {bad}")
        self.urls, self.timeout, self.max_concurrency = urls, timeout, max_concurrency
        self.routing_shape, self.reload_timeout, self.connect_timeout = routing_shape, reload_timeout, connect_timeout
        self.speculative = speculative  # our servers' MTP drafting ("speculative": true; SGLang: a launch option)
        self._in_flight = {u: 0 for u in urls}
        self._speculation = {"drafted": 0, "accepted": 0, "main_forwards": 0, "tokens": 0}
        self._next = 0
        self._lock = threading.Lock()

    def __getstate__(self):  # picklable (a Ray actor's constructor argument): the lock is rebuilt
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ---- HTTP -------------------------------------------------------------------------------------------------
    def _request(self, url: str, path: str, body: Optional[dict] = None, timeout: Optional[float] = None,
                 prompts: Sequence[int] = ()):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            detail = _error_message(e)
            kind = ServerUnavailable if e.code >= 500 and e.code != 501 else RequestRejected
            raise kind(url, f"{path} answered HTTP {e.code}: {detail}", prompts) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerUnavailable(url, f"{path} failed: {type(reason).__name__}: {reason} (server down, "
                                         "unreachable, or died mid-request)", prompts) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise BadResponse(url, f"{path} answered something that is not JSON: {raw[:200]!r}", prompts) from None

    def _pick(self) -> str:
        with self._lock:
            low = min(self._in_flight.values())
            free = [u for u in self.urls if self._in_flight[u] == low]
            url = free[self._next % len(free)]
            self._next += 1
            self._in_flight[url] += 1
            return url

    def _done(self, url: str):
        with self._lock:
            self._in_flight[url] -= 1

    # ---- generation -------------------------------------------------------------------------------------------
    def __call__(self, prompts: list[list[int]], n: int, sampling: Sampling) -> list[list[Sample]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sampling.return_routing and self.routing_shape is None:
            self.routing_shape = self._routing_shape()
        results: list[Optional[list[Sample]]] = [None] * len(prompts)
        errors: list[RemoteServerError] = []

        def one(i: int):
            url = self._pick()
            try:
                results[i] = self._generate(url, i, prompts[i], n, sampling)
            except RemoteServerError as e:
                errors.append(e)
            finally:
                self._done(url)

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), self.max_concurrency))) as pool:
            list(pool.map(one, range(len(prompts))))
        if errors:
            first = errors[0]
            failed = sorted(i for e in errors for i in e.prompt_indices)
            others = "" if len(errors) == 1 else f" (and {len(errors) - 1} more failed request(s): " + \
                "; ".join(str(e) for e in errors[1:4]) + ")"
            raise type(first)(first.url, str(first)[len(first.url) + 2:] + others, failed)
        return results

    def _body(self, prompt: list[int], n: int, sampling: Sampling, seed: Optional[int]) -> dict:
        def params(j: int) -> dict:
            sp = {"max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                  "stop_token_ids": list(sampling.stop_token_ids)}
            if seed is not None:
                sp["sampling_seed"] = seed + j
            return sp

        body = {"input_ids": [list(prompt)] * n, "sampling_params": [params(j) for j in range(n)],
                "return_logprob": True, "return_routed_experts": bool(sampling.return_routing)}
        if self.speculative:
            body["speculative"] = True
        return body

    def _generate(self, url: str, i: int, prompt: list[int], n: int, sampling: Sampling) -> list[Sample]:
        seed = None if sampling.seed is None else sampling.seed + i * n  # EngineGenerate's seeds
        out = self._request(url, "/generate", self._body(prompt, n, sampling, seed), prompts=[i])
        if not isinstance(out, list) or len(out) != n:
            raise BadResponse(url, f"/generate answered {type(out).__name__}"
                                   f"{f' of {len(out)}' if isinstance(out, list) else ''} for {n} samples", [i])
        return [self._sample(url, i, prompt, o, sampling) for o in out]

    def _sample(self, url: str, i: int, prompt: list[int], out, sampling: Sampling) -> Sample:
        def bad(msg):
            return BadResponse(url, f"/generate output for prompt {i}: {msg}", [i])

        if not isinstance(out, dict) or not isinstance(out.get("meta_info"), dict):
            raise bad("no 'meta_info' object")
        ids, meta = out.get("output_ids"), out["meta_info"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise bad("'output_ids' missing or not a list of token ids")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            raise ServerUnavailable(url, f"/generate: the server aborted prompt {i}'s request ({finish})", [i])
        if kind not in ("stop", "length"):
            raise bad(f"meta_info.finish_reason {finish!r} is not stop/length")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list) or len(triples) != len(ids):
            raise bad(f"meta_info.output_token_logprobs missing or of length "
                      f"{len(triples) if isinstance(triples, list) else None} for {len(ids)} tokens")
        try:
            logprobs = [float(t[0]) for t in triples]
            same = [int(t[1]) for t in triples] == ids
        except (TypeError, ValueError, IndexError):
            raise bad("meta_info.output_token_logprobs entries are not [logprob, token_id, ...]") from None
        if not same:
            raise bad("meta_info.output_token_logprobs token ids differ from output_ids")
        sampled = meta.get("output_token_sampled_logprobs", logprobs)
        versions = meta.get("output_token_weight_versions")
        if versions is None:
            if "weight_version" not in meta:
                raise bad("neither meta_info.output_token_weight_versions nor meta_info.weight_version")
            versions = [_version(meta["weight_version"], url, [i])] * len(ids)
        if not isinstance(sampled, list) or len(sampled) != len(ids) or not isinstance(versions, list) \
                or len(versions) != len(ids):
            raise bad("meta_info.output_token_sampled_logprobs / output_token_weight_versions do not have one "
                      "entry per token")
        routing = None
        if sampling.return_routing:
            routing = self._routing(meta, len(prompt) + len(ids), bad)
        if "spec_draft_token_num" in meta:  # a speculating server (ours with "speculative", or SGLang's)
            with self._lock:
                self._speculation["drafted"] += int(meta["spec_draft_token_num"])
                self._speculation["accepted"] += int(meta.get("spec_accept_token_num", 0))
                self._speculation["main_forwards"] += int(meta.get("spec_verify_ct", 0))
                self._speculation["tokens"] += len(ids)
        return Sample(list(ids), logprobs, [float(x) for x in sampled], [_version(v, url, [i]) for v in versions],
                      kind, routing)

    def _routing(self, meta: dict, total: int, bad) -> np.ndarray:
        encoded = meta.get("routed_experts")
        if not isinstance(encoded, str):
            raise bad("no meta_info.routed_experts (an SGLang server needs --enable-return-routed-experts)")
        try:
            flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype="<i4")
        except ValueError as e:
            raise bad(f"meta_info.routed_experts is not base64: {e}") from None
        layers, topk = self.routing_shape
        if flat.size % (layers * topk):
            raise bad(f"routed_experts holds {flat.size} ids, not whole rows of {layers} layers x {topk}")
        rows = flat.reshape(-1, layers, topk)
        if len(rows) not in (total, total - 1):  # ours: every token; SGLang: all but the last
            raise bad(f"routed_experts has {len(rows)} rows for {total} tokens")
        return rows.astype(np.int16)

    def _routing_shape(self) -> tuple[int, int]:
        info = self._request(self.urls[0], "/get_model_info", timeout=self.connect_timeout)
        if not isinstance(info, dict) or "num_moe_layers" not in info or "moe_router_topk" not in info:
            raise BadResponse(self.urls[0], "/get_model_info does not give num_moe_layers / moe_router_topk (an "
                                            "SGLang server): pass RemoteGenerate(..., routing_shape=(moe_layers, "
                                            "topk))")
        if not info["num_moe_layers"]:
            raise BadResponse(self.urls[0], "the served model has no MoE layers: routing replay needs an MoE model")
        return int(info["num_moe_layers"]), int(info["moe_router_topk"])

    def pop_speculation(self) -> dict[str, int]:
        """Drafts proposed and accepted, verify forwards and tokens the servers reported (meta_info.spec_*) since
        the last call; zeros when no server speculates."""
        with self._lock:
            out, self._speculation = self._speculation, {k: 0 for k in self._speculation}
        return out

    # ---- weights ----------------------------------------------------------------------------------------------
    def versions(self) -> dict[str, int]:
        """Each server's current weights version (GET /get_model_info)."""
        return {url: self.version_of(url) for url in self.urls}

    def reload(self, path: str, version: int, poll_interval: float = 0.2):
        """Every server loads the weights under `path` (POST /update_weights_from_disk, concurrently), then this
        waits until each reports `version`. Raises ReloadFailed naming every server that did not."""
        body = {"model_path": path, "weight_version": str(int(version))}
        failures: list[str] = []

        def one(url: str):
            try:
                out = self._request(url, "/update_weights_from_disk", body, timeout=self.reload_timeout)
            except RemoteServerError as e:
                failures.append(str(e))
                return
            if not isinstance(out, dict) or out.get("success") is not True:
                failures.append(f"{url}: /update_weights_from_disk did not succeed: "
                                f"{out.get('message') if isinstance(out, dict) else out!r}")
                return
            deadline = time.monotonic() + self.reload_timeout
            while True:
                try:
                    now = self.version_of(url)
                except RemoteServerError as e:
                    failures.append(str(e))
                    return
                if now == version:
                    return
                if time.monotonic() > deadline:
                    failures.append(f"{url}: still reports version {now}, not {version}, after "
                                    f"{self.reload_timeout:.0f} s")
                    return
                time.sleep(poll_interval)

        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            list(pool.map(one, self.urls))
        if failures:
            raise ReloadFailed(failures[0].split(": ", 1)[0], f"weights {path} (version {version}) not loaded by "
                               f"{len(failures)} of {len(self.urls)} server(s): " + "; ".join(failures))

    def version_of(self, url: str) -> int:
        info = self._request(url, "/get_model_info", timeout=self.connect_timeout)
        if not isinstance(info, dict) or "weight_version" not in info:
            raise BadResponse(url, "/get_model_info has no weight_version")
        return _version(info["weight_version"], url)


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read())
    except (ValueError, OSError):
        return str(e.reason)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return json.dumps(body)[:300]
