"""What both HTTP protocols (OpenAI's in server.py, SGLang's in native.py) share, below both so that neither
imports the other: the request error with its status, validation of a request's fields, the job queued for the
batching thread."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Callable, Optional

from megatron_ext.inference.engine import SamplingParams

MAX_N = 64  # samples per request


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400, fields: Optional[dict] = None):
        super().__init__(message)
        self.status, self.fields = status, fields or {}


def int_field(body: dict, key: str, default, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo)
            or (hi is not None and value > hi)):
        bounds = " and ".join(b for b in (f">= {lo}" if lo is not None else "", f"<= {hi}" if hi is not None else "")
                              if b)
        raise RequestError(f"'{key}' must be an integer{' ' + bounds if bounds else ''}, got {value!r}")
    return value


def float_field(body: dict, key: str, default):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"'{key}' must be a finite number, got {value!r}")
    return float(value)


def bool_field(body: dict, key: str):
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {value!r}")
    return value


def check_unicode(value, where: str):
    """JSON allows lone surrogates (\\ud800) that no tokenizer can encode: refuse them, naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"'{where}' is not valid Unicode (a lone surrogate at character {e.start})") from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, where)
            check_unicode(v, f"{where}.{k}")


@dataclasses.dataclass
class Job:
    """One HTTP request's generation: n samples of one prompt."""
    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    speculative: bool
    stream: bool
    logprobs: bool
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    # called on the batching thread as each token is drawn: (sample index, token id, raw logprob)
    on_token: Optional[Callable[[int, int, float], None]] = None
