"""A vLLM ``/inference/v1/generate`` reply as a :class:`GenerateResult`.

vLLM 0.32's non-streaming reply (``GenerateTokensResponse``): ``choices[0]`` carries
``token_ids``, ``finish_reason``, ``logprobs.content[i] = {token_id, logprob, rank,
top_logprobs}`` (the sampled token's logprob; vLLM itself writes -inf and NaN as
-9999.0), ``routed_experts`` (a base64 ``.npy`` string or null) and ``weight_versions``
(contiguous ``{version, start, end}`` spans over the output tokens, or null).

Weight versions are labels the trainer set with ``/finish_weight_update``:
``str(policy_version)``. Before any push vLLM's engine reports ``"default"``: the
checkpoint the server started from, which is policy version 0 as on the builtin
engine. Any other label is a protocol error (a server someone else versions).

Every contract break is a ``GenerateProtocolError`` naming the JSON path: the reply
was valid JSON, so retrying would get the same bytes.
"""

from __future__ import annotations

import re
from typing import Any, Final

import numpy as np

from inference.client.protocol import GenerateResult, VersionSpan
from inference.errors import GenerateProtocolError, WireError
from inference.wire import LOGPROB_FLOOR, NpyField, decode_npy_field

INITIAL_WEIGHT_VERSION: Final = "default"
"""vLLM's weight version label before any ``/finish_weight_update`` names one."""
_VERSION_LABEL: Final = re.compile(r"0|[1-9][0-9]{0,18}")  # str(int) for 0 <= v < 10**19
_CHOICE: Final = "$.choices[0]"


def policy_version_of(label: Any, *, path: str) -> int:
    """The policy version a vLLM weight-version label stands for."""
    if label == INITIAL_WEIGHT_VERSION:
        return 0
    if type(label) is str and _VERSION_LABEL.fullmatch(label):
        return int(label)
    raise GenerateProtocolError(
        path, f'str(policy_version) as the trainer sets it, or "{INITIAL_WEIGHT_VERSION}"', label
    )


def version_spans(value: Any, num_tokens: int, *, path: str) -> list[VersionSpan] | None:
    """``weight_versions`` as policy-version spans: checked to tile ``[0, num_tokens)``
    in order; empty spans dropped; neighbours with the same version merged ("default"
    and "0" are both version 0). None when the reply has none."""
    if value is None:
        return None
    if type(value) is not list:
        raise GenerateProtocolError(path, "a list of {version, start, end} spans, or null", value)
    spans: list[VersionSpan] = []
    at = 0
    for i, span in enumerate(value):
        where = f"{path}[{i}]"
        if type(span) is not dict:
            raise GenerateProtocolError(where, "a {version, start, end} object", span)
        start, end = span.get("start"), span.get("end")
        if type(start) is not int or start != at:
            raise GenerateProtocolError(
                f"{where}.start", f"{at} (spans tile the output tokens in order)", start
            )
        if type(end) is not int or not start <= end <= num_tokens:
            raise GenerateProtocolError(f"{where}.end", f"an int in [{start}, {num_tokens}]", end)
        version = policy_version_of(span.get("version"), path=f"{where}.version")
        at = end
        if start == end:
            continue  # vLLM can open a span whose tokens a stop check then drops
        if spans and spans[-1].policy_version == version:
            spans[-1] = VersionSpan(version, spans[-1].start, end)
        else:
            spans.append(VersionSpan(version, start, end))
    if at != num_tokens:
        raise GenerateProtocolError(
            f"{path}", f"spans ending at {num_tokens} (the output tokens)", f"end {at}"
        )
    return spans


def _logprobs(value: Any, token_ids: list[int], path: str) -> tuple[list[float], int]:
    """Sampled-token logprobs and how many were clamped to LOGPROB_FLOOR (vLLM's own
    clamp of -inf/NaN, or a null)."""
    if type(value) is not dict or type(value.get("content")) is not list:
        raise GenerateProtocolError(
            path, '{"content": [{token_id, logprob}, ...]} (the request asked for it)', value
        )
    content = value["content"]
    if len(content) != len(token_ids):
        raise GenerateProtocolError(
            f"{path}.content", f"{len(token_ids)} entries (one per token)", len(content)
        )
    out: list[float] = []
    clamped = 0
    for i, entry in enumerate(content):
        if type(entry) is not dict:
            raise GenerateProtocolError(
                f"{path}.content[{i}]", "a {token_id, logprob} object", entry
            )
        if entry.get("token_id") != token_ids[i]:
            raise GenerateProtocolError(
                f"{path}.content[{i}].token_id",
                f"{token_ids[i]} (token_ids[{i}])",
                entry.get("token_id"),
            )
        logprob = entry.get("logprob")
        if logprob is None:
            out.append(LOGPROB_FLOOR)
            clamped += 1
            continue
        if type(logprob) is not float and type(logprob) is not int:
            raise GenerateProtocolError(f"{path}.content[{i}].logprob", "a number or null", logprob)
        if logprob <= LOGPROB_FLOOR:
            out.append(LOGPROB_FLOOR)
            clamped += 1
        else:
            out.append(float(logprob))
    return out, clamped


def parse_vllm_reply(
    body: Any,
    *,
    want_routes: bool,
    prompt_route_rows: int | None = None,
    route_dims: tuple[int, int] | None = None,
) -> GenerateResult:
    """The one choice of a parsed reply (``load_packed_body`` with ``NpyField``, or
    ``orjson.loads``) as a result; routes are decoded only when ``want_routes``.

    Routes must be ``[prompt_route_rows + G, layers, top_k]`` for G generated tokens,
    ``prompt_route_rows`` = P - s - 1 (the last sampled token was never fed) and
    ``route_dims`` = (layers, top_k); either may be None when not known."""
    if type(body) is not dict:
        raise GenerateProtocolError("$", "a JSON object", type(body).__name__)
    choices = body.get("choices")
    if type(choices) is not list or len(choices) != 1:
        got = f"{len(choices)} choices" if type(choices) is list else choices
        raise GenerateProtocolError("$.choices", "a list of exactly 1 choice", got)
    choice = choices[0]
    if type(choice) is not dict:
        raise GenerateProtocolError(_CHOICE, "a JSON object", type(choice).__name__)
    token_ids = choice.get("token_ids")
    if type(token_ids) is not list or not all(type(t) is int and t >= 0 for t in token_ids):
        raise GenerateProtocolError(
            f"{_CHOICE}.token_ids", "a list of non-negative ints", token_ids
        )
    finish_reason = choice.get("finish_reason")
    if type(finish_reason) is not str:
        raise GenerateProtocolError(f"{_CHOICE}.finish_reason", "a string", finish_reason)
    logprobs, clamped = _logprobs(choice.get("logprobs"), token_ids, f"{_CHOICE}.logprobs")
    spans = version_spans(
        choice.get("weight_versions"), len(token_ids), path=f"{_CHOICE}.weight_versions"
    )
    result = GenerateResult(
        response_ids=token_ids,
        finish_reason=finish_reason,
        logprobs=logprobs,
        num_clamped_logprobs=clamped,
        policy_version=min(s.policy_version for s in spans) if spans else None,
        policy_version_spans=spans,
    )
    if want_routes:
        rows = None if prompt_route_rows is None else prompt_route_rows + len(token_ids)
        layers, top_k = route_dims if route_dims is not None else (None, None)
        result.routed_experts = _routes(choice.get("routed_experts"), (rows, layers, top_k))
    return result


def _routes(value: Any, shape: tuple[int | None, int | None, int | None]) -> np.ndarray:
    path = f"{_CHOICE}.routed_experts"
    if value is None:
        raise GenerateProtocolError(
            path,
            "a base64 .npy string (routes were requested: is the server started with "
            "--enable-return-routed-experts?)",
            None,
        )
    try:
        return decode_npy_field(NpyField.ROUTED_EXPERTS, value, path=path, shape=shape)
    except GenerateProtocolError:
        raise
    except WireError as exc:
        raise GenerateProtocolError(exc.path, exc.expected, exc.got) from exc
