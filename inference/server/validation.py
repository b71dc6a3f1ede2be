"""Checks every field of a generate request before it reaches the engine.

Each failure is a ``RequestValidationError`` naming the JSON path, what was expected
and what came (``$.sampling_params.top_p: expected a number in (0, 1], got 1.5``);
the server answers it with a 4xx and keeps serving. Unknown keys are refused rather
than ignored: a misspelt ``max_token`` silently generating 64 tokens is worse. The
temperature, top_p and top_k rules are the engine's own (``check_temperature``,
``check_top_p``, ``check_top_k``), so both say the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.engine.base import (
    EngineRequest,
    SamplingParams,
    check_logprobs_mode,
    check_temperature,
    check_top_k,
    check_top_p,
)
from inference.errors import RequestValidationError

SIDE_CHANNEL_KEYS = ("return_routed_experts", "return_sample_support", "return_packed_body")
_TOP_LEVEL_KEYS = ("token_ids", "sampling_params", "model", "session_id", *SIDE_CHANNEL_KEYS)
_SAMPLING_KEYS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop_token_ids",
    "routed_experts_prompt_start",
    "logprobs_mode",
)
_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    """What this server accepts; built from the engine's info and the server config."""

    model_name: str
    vocab_size: int
    max_model_len: int
    """Prompt plus generated tokens may not exceed this (the model's positions)."""
    max_new_tokens: int
    max_sample_support_k: int
    default_sample_support_k: int


def check_content_type(header: str | None, expected: str) -> None:
    """A 415 ``RequestValidationError`` unless the ``Content-Type`` header value names
    ``expected``; a ``charset`` parameter is allowed when it says UTF-8 (all we parse)."""
    media_type, *params = (header or "").split(";")
    charsets = [
        value.strip().strip('"').lower()
        for key, _, value in (p.partition("=") for p in params)
        if key.strip().lower() == "charset"
    ]
    if media_type.strip().lower() != expected or any(c not in ("utf-8", "utf8") for c in charsets):
        raise RequestValidationError(
            "Content-Type", f"{expected} (a charset, if any, utf-8)", header, status=415
        )


def parse_generate_request(
    body: Any, limits: RequestLimits, *, allow_side_channels: bool
) -> EngineRequest:
    """The engine request for a decoded JSON ``body``, or ``RequestValidationError``."""
    if not isinstance(body, dict):
        raise RequestValidationError("$", "a JSON object", type(body).__name__)
    for key in body:
        if key not in _TOP_LEVEL_KEYS:
            raise RequestValidationError(
                f"$.{key}", f"one of the keys {list(_TOP_LEVEL_KEYS)}", key
            )
        if key in SIDE_CHANNEL_KEYS and not allow_side_channels and body[key] not in (False, 0):
            # Asking for a side channel here is refused; saying "off" explicitly is fine.
            raise RequestValidationError(
                f"$.{key}",
                "false or absent (side channels are served on /skyrl/v1/generate)",
                body[key],
            )
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestValidationError("$.model", f"null or {limits.model_name!r}", model)
    session_id = body.get("session_id")
    if session_id is not None and not isinstance(session_id, str):
        raise RequestValidationError("$.session_id", "null or a string", session_id)

    prompt = _token_list(body.get("token_ids"), "$.token_ids", limits.vocab_size, min_len=1)
    params = body.get("sampling_params", {})
    if not isinstance(params, dict):
        raise RequestValidationError("$.sampling_params", "a JSON object", params)
    for key in params:
        if key not in _SAMPLING_KEYS:
            raise RequestValidationError(
                f"$.sampling_params.{key}", f"one of the keys {list(_SAMPLING_KEYS)}", key
            )
    sampling = _sampling(params, limits, prompt_len=len(prompt))

    return_routes = body.get("return_routed_experts", False)
    if not isinstance(return_routes, bool):
        raise RequestValidationError("$.return_routed_experts", "true or false", return_routes)
    packed_body = body.get("return_packed_body", False)
    if not isinstance(packed_body, bool):
        raise RequestValidationError("$.return_packed_body", "true or false", packed_body)
    start = params.get("routed_experts_prompt_start")
    if start is not None:
        # Validated always, used only with routes: a client that always sends the
        # trace's prompt start works with routes on or off.
        start = _int(start, "$.sampling_params.routed_experts_prompt_start", 0, len(prompt))
    return EngineRequest(
        prompt_token_ids=prompt,
        sampling=sampling,
        return_routed_experts=return_routes,
        routed_experts_prompt_start=(start or 0) if return_routes else 0,
        sample_support_k=_sample_support_k(body.get("return_sample_support", False), limits),
    )


def _sampling(params: dict[str, Any], limits: RequestLimits, *, prompt_len: int) -> SamplingParams:
    path = "$.sampling_params"
    room = min(limits.max_new_tokens, limits.max_model_len - prompt_len)
    if room < 1:
        raise RequestValidationError(
            "$.token_ids",
            f"at most {limits.max_model_len - 1} tokens (max_model_len {limits.max_model_len})",
            f"{prompt_len} tokens",
        )
    defaults = SamplingParams()
    max_tokens = _int(
        params.get("max_tokens", min(defaults.max_tokens, room)), f"{path}.max_tokens", 1, room
    )
    temperature = check_temperature(
        params.get("temperature", defaults.temperature), field=f"{path}.temperature"
    )
    top_p = check_top_p(params.get("top_p", defaults.top_p), field=f"{path}.top_p")
    top_k = check_top_k(
        params.get("top_k", defaults.top_k), field=f"{path}.top_k", vocab_size=limits.vocab_size
    )
    seed = params.get("seed")
    if seed is not None:
        seed = _int(seed, f"{path}.seed", 0, _MAX_SEED)
    stop = _token_list(
        params.get("stop_token_ids", []), f"{path}.stop_token_ids", limits.vocab_size
    )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop_token_ids=tuple(stop),
        logprobs_mode=check_logprobs_mode(
            params.get("logprobs_mode", defaults.logprobs_mode), field=f"{path}.logprobs_mode"
        ),
    )


def _sample_support_k(value: Any, limits: RequestLimits) -> int:
    path = "$.return_sample_support"
    if value is False:
        return 0
    if value is True:
        return limits.default_sample_support_k
    expected = f"false, true or an int k in [0, {limits.max_sample_support_k}]"
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestValidationError(path, expected, value)
    if not 0 <= value <= limits.max_sample_support_k:
        raise RequestValidationError(path, expected, value)
    return value


def _token_list(value: Any, path: str, vocab_size: int, *, min_len: int = 0) -> list[int]:
    if not isinstance(value, list):
        raise RequestValidationError(path, "a list of token ids", value)
    if len(value) < min_len:
        raise RequestValidationError(path, f"at least {min_len} token id(s)", value)
    for i, token in enumerate(value):
        if type(token) is not int or not 0 <= token < vocab_size:
            raise RequestValidationError(f"{path}[{i}]", f"an int in [0, {vocab_size})", token)
    return value


def _int(value: Any, path: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise RequestValidationError(path, f"an int in [{low}, {high}]", value)
    return value
