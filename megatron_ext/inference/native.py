"""SGLang's native protocol over the same ModelService: ``POST /generate``, ``POST /update_weights_from_disk``,
``GET /get_model_info`` (and ``/model_info``), ``GET /health_generate``, so a client written for an SGLang
deployment (megatron_ext/rl/remote.py, slime-style rollout code) runs against our server unchanged.

Token ids in and out. ``/generate`` takes ``input_ids`` (one prompt, or a list of prompts) and ``sampling_params``
(one dict, or one per prompt) and answers one output, or a list (prompt-major: prompt i's sample j at i * n + j,
SGLang's order), each ``{"text", "output_ids", "meta_info"}``. ``meta_info`` holds SGLang's fields (``id``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason`` {type: stop|length, matched|length},
``weight_version`` as a string, ``output_token_logprobs`` as [logprob, token_id, null] triples with
``return_logprob``, ``routed_experts`` as base64 of little-endian int32 [rows, moe layers, topk] with
``return_routed_experts``, and for a speculative request ``spec_verify_ct``, ``spec_draft_token_num``,
``spec_accept_token_num``) plus three of ours: ``output_token_weight_versions`` (the version of every token),
``output_token_sampled_logprobs`` (log q under the distribution actually sampled from) and ``routed_experts_shape``.
Where ours differs from SGLang (docs/design-notes.md has the table): the logprobs are always the raw distribution
(SGLang: temperature-scaled unless SGLANG_RETURN_ORIGINAL_LOGPROB=1); ``routed_experts`` has a row for every token
including the last generated one (SGLang stops one row short); ``n`` with a seed draws sample j with seed + j
(SGLang would repeat one seed); sampling options the engine does not implement (penalties, min_p, grammars) are
refused with a 400 naming them rather than ignored.
"""

from __future__ import annotations

import base64
import dataclasses
import uuid
from typing import Optional

import numpy as np

from megatron_ext.inference.engine import SamplingParams
from megatron_ext.inference.protocol import MAX_N, Job, RequestError, bool_field, check_unicode, int_field

# sampling_params keys accepted without effect on the tokens (text rendering options; the engine has no stream)
_NO_EFFECT = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}
# keys that would change the distribution, accepted only at their neutral value
_NEUTRAL = {"min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_p": 0.0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
            "logit_bias": None, "custom_params": None}
_SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "n", "sampling_seed",
             "seed", "ignore_eos"} | _NO_EFFECT | set(_NEUTRAL)
_TOP_LEVEL = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
              "return_text_in_logprobs", "return_routed_experts", "routed_experts_start_len", "stream", "rid",
              "log_metrics", "speculative"}
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def _error(message: str, status: int = 400):
    return RequestError(message, status)


def _ids(value, where: str) -> list[int]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise _error(f"'{where}' must be a non-empty list of token ids")
    return value


def _sampling(service, sp, where: str, routing: bool) -> tuple[SamplingParams, int]:
    """One prompt's SGLang sampling_params as the engine's SamplingParams, and its n."""
    if not isinstance(sp, dict):
        raise _error(f"'{where}' must be an object, got {type(sp).__name__}")
    unknown = sorted(set(sp) - _SAMPLING)
    if unknown:
        raise _error(f"'{where}' has fields this server does not implement: {unknown} (supported: "
                     f"{sorted(_SAMPLING)})")
    changed = sorted(k for k, neutral in _NEUTRAL.items() if sp.get(k, neutral) not in (neutral, None))
    if changed:
        raise _error(f"'{where}': {changed} are not implemented by this server's sampler; leave them at their "
                     f"neutral values ({ {k: _NEUTRAL[k] for k in changed} })")
    seed = sp.get("sampling_seed", sp.get("seed"))
    top_k = int_field(sp, "top_k", -1, lo=-1)
    body = {"max_tokens": int_field(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, lo=1),
            "temperature": sp.get("temperature", 1.0), "top_p": sp.get("top_p", 1.0),
            "top_k": 0 if top_k == -1 else top_k, "seed": seed, "stop": sp.get("stop"),
            "stop_token_ids": sp.get("stop_token_ids"), "return_routing": routing}
    if sp.get("ignore_eos", False) is True:  # SGLang: no stop ids at all, only max_new_tokens ends a sample
        body["stop_token_ids"] = None
    params = service._sampling(body)
    n = int_field(sp, "n", 1, lo=1, hi=MAX_N)
    return params, n


@dataclasses.dataclass
class NativeRequest:
    jobs: list[Job]  # one per prompt (a prompt repeated with consecutive seeds folds into one job)
    single: bool  # one prompt, one sample: answer an object, not a list
    routed_start: int


def parse_generate(service, body: dict) -> NativeRequest:
    check_unicode(body, "body")
    unknown = sorted(set(body) - _TOP_LEVEL)
    if unknown:
        raise _error(f"/generate: fields this server does not implement: {unknown} (supported: {sorted(_TOP_LEVEL)})")
    if bool_field(body, "stream"):
        raise _error("'stream' is not supported on /generate; use /v1/completions with \"stream\": true")
    if body.get("logprob_start_len") not in (None, -1) or body.get("top_logprobs_num") not in (None, 0):
        raise _error("prompt logprobs ('logprob_start_len' >= 0) and 'top_logprobs_num' > 0 are not implemented; "
                     "only output_token_logprobs are returned")
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise _error("give exactly one of 'input_ids' (token ids) and 'text'")
    if text is not None:
        if service.tokenizer is None:
            raise _error("'text' needs a server started with a tokenizer; send 'input_ids'")
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise _error("'text' must be a string or a non-empty list of strings")
        prompts, single = [service.tokenizer.encode(t) for t in texts], isinstance(text, str)
    elif isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        prompts, single = [_ids(p, f"input_ids[{i}]") for i, p in enumerate(ids)], False
    else:
        prompts, single = [_ids(ids, "input_ids")], True
    sps = body.get("sampling_params")
    sps = {} if sps is None else sps
    if isinstance(sps, list):
        if len(sps) != len(prompts):
            raise _error(f"'sampling_params' has {len(sps)} entries for {len(prompts)} prompts")
    else:
        sps = [sps] * len(prompts)
    routing = bool_field(body, "return_routed_experts")
    logprob = bool_field(body, "return_logprob")
    speculative = bool_field(body, "speculative")
    if speculative and not service.engine.mtp_layers:
        raise _error("'speculative' needs a model with MTP layers (--mtp-num-layers >= 1)")
    jobs = []
    for i, (prompt, sp) in enumerate(zip(prompts, sps)):
        params, n = _sampling(service, sp, "sampling_params" if len(sps) == 1 else f"sampling_params[{i}]", routing)
        last = jobs[-1] if jobs else None
        if (last is not None and last.prompt_ids == prompt and n == 1
                and dataclasses.replace(last.params, seed=params.seed) == params
                and (params.seed is None) == (last.params.seed is None)
                and (params.seed is None or params.seed == last.params.seed + last.n)):
            last.n += 1  # the same prompt again with the next seed: one more sample sharing the prefill
            continue
        jobs.append(Job("native", prompt, params, n, speculative, False, logprob))
    for job in jobs:
        if job.n > service.max_batch_rows:
            raise _error(f"{job.n} samples of one prompt; this server takes at most {service.max_batch_rows}")
        try:
            service.engine.check_request([job.prompt_ids], [job.params])
        except ValueError as e:
            raise _error(str(e)) from None
    start = int_field(body, "routed_experts_start_len", 0, lo=0)
    if start > min(len(p) for p in prompts):
        raise _error(f"'routed_experts_start_len' {start} is past the end of a prompt")
    return NativeRequest(jobs, single and len(jobs) == 1 and jobs[0].n == 1, start)


def _output(service, job, completion, routed_start: int) -> dict:
    ids = list(completion.token_ids)
    versions = list(completion.versions)
    if completion.finish_reason == "stop":
        matched = ids[-1] if ids and ids[-1] in job.params.stop_token_ids else None
        finish = {"type": "stop", "matched": matched}
    else:
        finish = {"type": "length", "length": len(ids)}
    meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(job.prompt_ids), "completion_tokens": len(ids),
            "cached_tokens": 0, "finish_reason": finish,
            "weight_version": str(versions[-1] if versions else service.version),
            "output_token_weight_versions": versions}
    if job.logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(completion.logprobs, ids)]
        meta["output_token_sampled_logprobs"] = list(completion.sampled_logprobs)
    if completion.speculation is not None:  # SGLang's names for a speculative request's counts
        meta["spec_verify_ct"] = completion.speculation["verify_forwards"]
        meta["spec_draft_token_num"] = completion.speculation["drafted"]
        meta["spec_accept_token_num"] = completion.speculation["accepted"]
    if completion.routing is not None:
        rows = completion.routing[routed_start:].cpu().numpy().astype("<i4")
        meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
        meta["routed_experts_shape"] = list(rows.shape)
    return {"text": service._text(completion) or "", "output_ids": ids, "meta_info": meta}


def respond(service, request: NativeRequest, results: list[list]):
    """SGLang's answer: an object for one prompt and one sample, else a list, prompt-major."""
    outputs = [_output(service, job, c, request.routed_start) for job, completions in zip(request.jobs, results)
               for c in completions]
    return outputs[0] if request.single else outputs


def decode_routed_experts(encoded: str, layers_topk: tuple[int, int]) -> np.ndarray:
    """meta_info.routed_experts (base64 int32) as int16 [rows, moe layers, topk]."""
    flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype="<i4")
    width = layers_topk[0] * layers_topk[1]
    if width == 0 or flat.size % width:
        raise ValueError(f"routed_experts holds {flat.size} ids, not a whole number of [{layers_topk[0]} layers x "
                         f"{layers_topk[1]} topk] rows")
    return flat.reshape(-1, *layers_topk).astype(np.int16)


def model_info(service) -> dict:
    engine = service.engine
    cfg = engine.config
    return {"model_path": service.name, "tokenizer_path": None, "is_generation": True,
            "weight_version": str(service.version), "num_moe_layers": engine.num_moe_layers(),
            "moe_router_topk": int(cfg.moe_router_topk or 0) if engine.num_moe_layers() else 0,
            "vocab_size": engine.vocab_size, "max_context_length": engine.model.max_sequence_length,
            "mtp_num_layers": len(engine.mtp_layers)}


def weight_version(value) -> Optional[int]:
    """The integer version in an update request's 'weight_version' (SGLang sends strings)."""
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.isdigit())):
        raise _error(f"'weight_version' must be a non-negative integer (or its decimal string), got {value!r}: "
                     "this server tags every token with an integer policy version")
    return int(value)


_UPDATE_KEYS = {"model_path", "load_format", "weight_version", "abort_all_requests", "flush_cache", "is_async",
                "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step"}


def parse_update(body: dict) -> tuple[str, Optional[int]]:
    unknown = sorted(set(body) - _UPDATE_KEYS)
    if unknown:
        raise _error(f"/update_weights_from_disk: unknown fields {unknown}")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise _error("'model_path' must name a checkpoint directory (a Megatron checkpoint root for this server)")
    if body.get("load_format") not in (None, "auto"):
        raise _error(f"'load_format' {body['load_format']!r} is not supported: this server loads Megatron "
                     "checkpoints (omit it)")
    return path, weight_version(body.get("weight_version"))
