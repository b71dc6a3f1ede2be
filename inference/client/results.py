"""What a generate call returns, and the checks that turn a reply body into it.

A reply that is valid JSON but breaks the response contract raises
``GenerateProtocolError`` naming the JSON path: retrying would get the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inference.errors import GenerateProtocolError


@dataclass
class GenerateRequest:
    """One generate call, as ``RemoteGenerateClient.generate`` takes it (for batches)."""

    prompt_token_ids: Sequence[int]
    sampling_params: Any = field(default_factory=dict)
    """A mapping of wire sampling params or an ``inference.engine.base.SamplingParams``."""
    return_routed_experts: bool = False
    routed_experts_prompt_start: int | None = None
    return_sample_support: bool | int = False
    session_id: str | None = None
    return_packed_body: bool = False


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of a reply were generated under ``policy_version``."""

    policy_version: int
    start: int
    end: int


@dataclass
class GenerateResult:
    """One prompt's completion.

    ``routed_experts`` is present only when requested: ``[P - s + G - 1, layers, topk]``
    integer expert ids (uint8/int16/int32: as sent by our server; a vLLM reply's
    uint16/int32 narrowed to the canonical dtype), row i the routing of prompt token
    s + i when it was fed. ``sample_support_ids`` / ``sample_support_logprobs``
    are present only when requested: ``[G, k]`` int32 candidate ids (trailing -1
    padding) and their float32 logprobs.
    """

    response_ids: list[int]
    finish_reason: str
    logprobs: list[float] | None
    """Sampled-token logprobs, one per response id; None when the server sent none.
    Values the server could not compute are -9999.0 (see ``num_clamped_logprobs``)."""
    routed_experts: np.ndarray | None = None
    sample_support_ids: np.ndarray | None = None
    sample_support_logprobs: np.ndarray | None = None
    sample_support_size: np.ndarray | None = None
    """``[G]`` int32 kept-set size per generated token (with the support; None from a
    server that does not send it): above k, the listed candidates are cut short."""
    num_clamped_logprobs: int = 0
    """How many of this reply's logprobs the server clamped to -9999.0."""
    policy_version: int | None = None
    """The server's policy version when it generated this reply; None when the reply
    has no ``policy_version`` (a server from before versions). A reply whose tokens
    span a weight push (vLLM keeps in-flight requests across one) reports its oldest
    version here and all of them in ``policy_version_spans``."""
    policy_version_spans: list[VersionSpan] | None = None
    """Per-token versions as contiguous spans over ``response_ids``, one span per
    version, in order; None when the server reports one version for the whole reply
    (the builtin server: one batch runs under one version)."""

    @property
    def policy_versions(self) -> tuple[int, ...] | None:
        """Every policy version this reply's tokens came from, oldest first (two or
        more when it spans a push); None when the server reported none."""
        if self.policy_version_spans:
            return tuple(sorted({span.policy_version for span in self.policy_version_spans}))
        return None if self.policy_version is None else (self.policy_version,)


def single_choice(body: Any) -> tuple[dict[str, Any], int]:
    """The one choice of a reply to a one-prompt request, and the clamp count."""
    if not isinstance(body, dict):
        raise GenerateProtocolError("$", "a JSON object", type(body).__name__)
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        got = f"{len(choices)} choices" if isinstance(choices, list) else choices
        raise GenerateProtocolError("$.choices", "a list of exactly 1 choice", got)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise GenerateProtocolError("$.choices[0]", "a JSON object", type(choice).__name__)
    clamped = body.get("num_clamped_logprobs", 0)
    if isinstance(clamped, bool) or not isinstance(clamped, int) or clamped < 0:
        raise GenerateProtocolError("$.num_clamped_logprobs", "an int >= 0", clamped)
    return choice, clamped


def reply_policy_version(body: dict[str, Any]) -> int | None:
    """``$.policy_version`` of a reply: an int >= 0, or None when absent."""
    if "policy_version" not in body:
        return None
    version = body["policy_version"]
    if type(version) is not int or version < 0:
        raise GenerateProtocolError("$.policy_version", "an int >= 0", version)
    return version


def parse_choice(choice: dict[str, Any], *, num_clamped_logprobs: int) -> GenerateResult:
    """Token ids, finish reason and logprobs of ``$.choices[0]`` (side channels unset)."""
    path = "$.choices[0]"
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
        raise GenerateProtocolError(f"{path}.token_ids", "a list of ints", token_ids)
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise GenerateProtocolError(f"{path}.finish_reason", "a string", finish_reason)
    return GenerateResult(
        response_ids=token_ids,
        finish_reason=finish_reason,
        logprobs=_parse_logprobs(choice.get("logprobs"), len(token_ids), f"{path}.logprobs"),
        num_clamped_logprobs=num_clamped_logprobs,
    )


def _parse_logprobs(value: Any, num_tokens: int, path: str) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("content"), list):
        raise GenerateProtocolError(path, 'null or {"content": [{"logprob": x}, ...]}', value)
    content = value["content"]
    if len(content) != num_tokens:
        raise GenerateProtocolError(
            f"{path}.content", f"{num_tokens} entries (one per token)", len(content)
        )
    out: list[float] = []
    for i, entry in enumerate(content):
        logprob = entry.get("logprob") if isinstance(entry, dict) else None
        if type(logprob) is not float and type(logprob) is not int:
            raise GenerateProtocolError(f"{path}.content[{i}].logprob", "a number", entry)
        out.append(float(logprob))
    return out
