"""Decoding the packed side channels of one choice into a ``GenerateResult``.

Row counts are checked here because the client is the one that knows the prompt:
a server that ignores ``routed_experts_prompt_start`` and returns the whole prefix
would otherwise misalign every later turn's routes silently (docs/design.md §4).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from inference.client.protocol import GenerateResult
from inference.client.replies import loads_or_retry
from inference.errors import GenerateProtocolError, WireError
from inference.wire import (
    DEFAULT_FIELDS,
    NpyField,
    PackedField,
    decode_packed_field,
    decode_packed_routed_experts,
    decode_packed_sample_support,
    load_packed_body,
)

_CHOICE = "$.choices[0]"


def as_protocol_error(exc: WireError) -> GenerateProtocolError:
    """The wire's error re-classed as a reply protocol error, path/expected/got kept."""
    if isinstance(exc, GenerateProtocolError):
        return exc
    return GenerateProtocolError(exc.path, exc.expected, exc.got)


def load_reply(
    raw: bytes, *, fields: Iterable[PackedField | NpyField | str] = DEFAULT_FIELDS
) -> Any:
    """A 200 generate reply with ``fields`` spliced out as views (``load_packed_body``).
    A truncated body also fails the splice: only a body that is valid JSON has a
    malformed packed contract (deterministic, ``GenerateProtocolError``); anything else
    is a broken hop, retried (``GenerateTransportError``)."""
    try:
        return load_packed_body(raw, fields=fields)
    except WireError as exc:
        loads_or_retry(raw, 200)
        raise as_protocol_error(exc) from exc


def _envelope(choice: dict[str, Any], field: PackedField) -> Any:
    payload = choice.get(field.key)
    if not isinstance(payload, dict):
        raise GenerateProtocolError(
            f"{_CHOICE}.{field.key}", "an envelope object (it was requested)", payload
        )
    return payload


def _check_sizes(sizes: np.ndarray, ids: np.ndarray, num_generated: int) -> None:
    path = f"{_CHOICE}.rollout_sample_support_size"
    if sizes.shape[0] != num_generated:
        raise GenerateProtocolError(
            f"{path}.shape[0]", f"{num_generated} sizes (one per generated token)", sizes.shape[0]
        )
    # The ids are the kept set's first k, so a row lists min(size, k) of them; any
    # other count means the ids and the sizes describe different sets.
    listed = (ids >= 0).sum(axis=1)
    bad = np.flatnonzero(listed != np.minimum(sizes, ids.shape[1]))
    if bad.size:
        row = int(bad[0])
        raise GenerateProtocolError(
            f"{path}[{row}]",
            f"a size matching the {int(listed[row])} listed ids (k = {ids.shape[1]})",
            int(sizes[row]),
        )


def decode_side_channels(
    choice: dict[str, Any],
    result: GenerateResult,
    *,
    want_routes: bool,
    want_support: bool,
    expected_route_rows: int | None,
) -> None:
    """Fill ``result``'s requested side channels from ``choice`` (in place)."""
    num_generated = len(result.response_ids)
    try:
        if want_routes:
            routes = decode_packed_routed_experts(
                _envelope(choice, PackedField.ROUTED_EXPERTS), path=f"{_CHOICE}.routed_experts"
            )
            if expected_route_rows is not None and routes.shape[0] != expected_route_rows:
                raise GenerateProtocolError(
                    f"{_CHOICE}.routed_experts.shape[0]",
                    f"{expected_route_rows} rows (prompt - prompt_start + generated - 1)",
                    routes.shape[0],
                )
            result.routed_experts = routes
        if want_support:
            ids, logprobs = decode_packed_sample_support(
                _envelope(choice, PackedField.ROLLOUT_SAMPLE_SUPPORT),
                _envelope(choice, PackedField.ROLLOUT_SAMPLE_SUPPORT_LOGPROBS),
                path=_CHOICE,
            )
            if ids.shape[0] != num_generated:
                raise GenerateProtocolError(
                    f"{_CHOICE}.rollout_sample_support.shape[0]",
                    f"{num_generated} rows (one per generated token)",
                    ids.shape[0],
                )
            result.sample_support_ids = ids
            result.sample_support_logprobs = logprobs
            size = choice.get(PackedField.ROLLOUT_SAMPLE_SUPPORT_SIZE.key)
            if size is not None:  # a server from before the field sends none
                sizes = decode_packed_field(
                    PackedField.ROLLOUT_SAMPLE_SUPPORT_SIZE,
                    size,
                    path=f"{_CHOICE}.rollout_sample_support_size",
                )
                _check_sizes(sizes, ids, num_generated)
                result.sample_support_size = sizes
    except WireError as exc:
        raise as_protocol_error(exc) from exc
    except TypeError as exc:  # the wire's "not a mapping / not an array" class
        raise GenerateProtocolError(_CHOICE, "well-formed envelopes", str(exc)) from exc


def decode_packed_choice(choice: dict[str, Any], *, num_clamped_logprobs: int) -> GenerateResult:
    """Token ids and logprobs of a fully packed choice (``return_packed_body``)."""
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise GenerateProtocolError(f"{_CHOICE}.finish_reason", "a string", finish_reason)
    try:
        ids = decode_packed_field(
            PackedField.PACKED_TOKEN_IDS,
            _envelope(choice, PackedField.PACKED_TOKEN_IDS),
            path=f"{_CHOICE}.packed_token_ids",
        )
        logprobs = decode_packed_field(
            PackedField.PACKED_LOGPROBS,
            _envelope(choice, PackedField.PACKED_LOGPROBS),
            path=f"{_CHOICE}.packed_logprobs",
        )
    except WireError as exc:
        raise as_protocol_error(exc) from exc
    except TypeError as exc:
        raise GenerateProtocolError(_CHOICE, "well-formed envelopes", str(exc)) from exc
    if logprobs.shape != ids.shape:
        raise GenerateProtocolError(
            f"{_CHOICE}.packed_logprobs.shape",
            f"{list(ids.shape)} (one per token)",
            list(logprobs.shape),
        )
    return GenerateResult(
        response_ids=ids.tolist(),
        finish_reason=finish_reason,
        logprobs=logprobs.tolist(),
        num_clamped_logprobs=num_clamped_logprobs,
    )
