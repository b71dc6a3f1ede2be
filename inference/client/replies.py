"""Classifying one HTTP reply: retry it, raise it, or parse it (docs/design.md §3).

- 429 / 503: ``RetryLater`` carrying ``Retry-After``; the status error if retries end;
- any other error status with a JSON body: ``GenerateHTTPError`` with the server's
  ``error.message`` / ``error.type``; an undecodable 4xx raises with its text;
- an undecodable body with any other status (an HTML 502 from a gateway, a truncated
  200): ``GenerateTransportError``, retried — a broken hop, not a broken server.
"""

from __future__ import annotations

import email.utils
import math
import time
from typing import Any

import orjson

from inference.client.retry import RetryLater
from inference.errors import GenerateHTTPError, GenerateProtocolError, GenerateTransportError

_RETRY_LATER_STATUSES = (429, 503)
# An error body is quoted into the exception; a 100 MB HTML page should not be.
_MAX_ERROR_TEXT = 500


def loads_or_retry(raw: bytes, status: int) -> Any:
    """``orjson.loads``; a body that is not JSON at all came from a broken hop: retry."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GenerateTransportError(
            f"HTTP {status}: undecodable body ({len(raw)} bytes): {exc}; starts {raw[:80]!r}"
        ) from exc


def json_object(raw: bytes) -> dict[str, Any]:
    """A 200 reply that must be one JSON object (``/health``, a weight call's answer)."""
    reply = loads_or_retry(raw, 200)
    if not isinstance(reply, dict):
        raise GenerateProtocolError("$", "a JSON object", type(reply).__name__)
    return reply


def status_error(status: int, raw: bytes, retry_after: str | None) -> Exception:
    try:
        reply = orjson.loads(raw)
    except orjson.JSONDecodeError:
        reply = None
        decoded = False
    else:
        decoded = True
    if decoded:
        error = reply.get("error") if isinstance(reply, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            error_type = error.get("type")
            final = GenerateHTTPError(
                status,
                error["message"],
                error_type=error_type if isinstance(error_type, str) else None,
            )
        else:
            final = GenerateHTTPError(status, error_text(raw))
    else:
        final = GenerateHTTPError(status, error_text(raw))
    if status in _RETRY_LATER_STATUSES:
        return RetryLater(final, parse_retry_after(retry_after))
    if decoded or status < 500:
        return final
    return GenerateTransportError(f"HTTP {status} with an undecodable body: {error_text(raw)}")


def error_text(raw: bytes) -> str:
    text = raw[:_MAX_ERROR_TEXT].decode("utf-8", errors="replace")
    return text + ("..." if len(raw) > _MAX_ERROR_TEXT else "")


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date)."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)
