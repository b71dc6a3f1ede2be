"""The checks that turn our server's reply body into a ``GenerateResult``
(``inference.client.protocol``).

A reply that is valid JSON but breaks the response contract raises
``GenerateProtocolError`` naming the JSON path: retrying would get the same bytes.
"""

from __future__ import annotations

from typing import Any

from inference.client.protocol import GenerateResult
from inference.errors import GenerateProtocolError


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
