"""Reply size caps: how many bytes a reply may have, and reading that stops at the cap.

A client that read whatever arrived went from a few MiB to 1.38 GiB on one 300 MiB
garbage reply (the security review's measurement). Each request now carries a cap:

- generate: derived from the request, an upper bound on any honest reply to it::

      REPLY_SLACK_BYTES                                   # keys, model name, envelope heads
      + max_tokens * TOKEN_JSON_BYTES                     # token ids and logprob objects
      + b64((P - s - 1 + max_tokens) * row_bytes)         # routes, when requested
      + 2 * b64(max_tokens * k * 4) + b64(max_tokens * 4) # sample support and set sizes

  where P is the prompt length, s ``routed_experts_prompt_start``, ``b64(n)`` the base64
  length of n bytes (4/3 n), ``row_bytes`` ``num_layers * top_k * id width``
  (:class:`RouteShape`: passed to the client or read once from ``/health``) and ``k``
  the requested support width (``SUPPORT_K_BOUND`` for "the server's default"). The
  client's ``max_reply_bytes`` option replaces this bound with a fixed one;
- weight updates and ``/health``: ``SMALL_REPLY_BYTES`` (their replies are < 1 KiB).

The cap is enforced while reading: a ``Content-Length`` above it is refused before the
body is read, and a streamed body is cut as soon as it passes the cap, so a client
holds at most about cap + one chunk. Measured on a 256 MiB garbage reply against a
1 MiB cap: 1.6 MiB traced peak and 5.5 MiB sent before the hang-up, where ``read()``
peaked at 512 MiB. The error, :class:`ReplyTooLarge`, is a deterministic
``GenerateProtocolError`` and never retried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp

from inference.errors import GenerateProtocolError
from inference.wire import route_dtype_for

REPLY_SLACK_BYTES = 1 << 20
"""Fixed part of every generate cap. An honest reply's non-per-token bytes (keys, model
name, finish reason, envelope shape/dtype) are a few hundred; a MiB also covers error
bodies and keeps the cap of a 1-token request far from any honest reply."""
TOKEN_JSON_BYTES = 64
"""Per generated token. The largest plain entry, measured with orjson, is an int32 id
``2147483647,`` (11 bytes) plus ``{"logprob":-2.2250738585072014e-308},`` (37): 48 bytes;
a packed body sends 4 + 4 bytes as base64 (10.7). 64 leaves room for other float writers."""
SUPPORT_K_BOUND = 64
"""The support width assumed for ``return_sample_support=True`` (the server's default k):
the server's ``ServerConfig.max_sample_support_k`` default, which bounds that k."""
SMALL_REPLY_BYTES = 64 << 10
"""Cap of ``/health`` and weight-update replies (a real ``/health`` is ~300 bytes)."""
SERVER_DEFAULT_MAX_TOKENS = 64
"""``max_tokens`` the server uses when a request leaves it out (``SamplingParams``)."""
_CHUNK_BYTES = 1 << 16


class ReplyTooLarge(GenerateProtocolError):
    """A reply body was (or declared to be) larger than the request's cap.

    ``cap`` is the cap in bytes; ``received`` the bytes read before reading stopped, or
    the declared ``Content-Length`` when ``declared``.
    """

    def __init__(self, cap: int, received: int, *, declared: bool) -> None:
        self.cap = cap
        self.received = received
        self.declared = declared
        got = (
            f"Content-Length {received} (nothing read)"
            if declared
            else f"{received} bytes read when reading stopped"
        )
        super().__init__("$", f"a reply body of at most {cap} bytes (the reply cap)", got)


@dataclass(frozen=True)
class RouteShape:
    """The shape of one routes row: ``num_layers x top_k`` expert ids, each as wide as
    the canonical dtype for ids below ``num_experts`` (uint8 up to 256 experts).

    The server reports all three under ``engine`` in ``/health``.
    """

    num_layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouteShape.{name}: expected an int >= 1, got {value!r}")
        if self.num_experts > 1 << 31:
            raise ValueError(
                f"RouteShape.num_experts: expected an int <= 2**31 (int32 ids), "
                f"got {self.num_experts!r}"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes of one routes row before base64."""
        width = route_dtype_for(self.num_experts - 1).itemsize
        return self.num_layers * self.top_k * width

    @classmethod
    def from_health(cls, document: Any) -> RouteShape:
        """The shape in a ``/health`` document; a missing or bad field is a protocol error."""
        engine = document.get("engine") if isinstance(document, dict) else None
        if not isinstance(engine, dict):
            raise GenerateProtocolError(
                "$.engine", "an object with num_layers, top_k and num_experts", engine
            )
        values: dict[str, int] = {}
        for name in ("num_layers", "top_k", "num_experts"):
            value = engine.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerateProtocolError(f"$.engine.{name}", "an int >= 1", value)
            values[name] = value
        try:
            return cls(**values)
        except ValueError as exc:
            raise GenerateProtocolError(
                "$.engine", "a route shape with int32 ids", str(exc)
            ) from exc


def _base64_len(num_bytes: int) -> int:
    return 4 * ((num_bytes + 2) // 3)


def generate_reply_cap(
    *,
    max_tokens: int,
    prompt_route_rows: int = 0,
    route_shape: RouteShape | None = None,
    support_k: int = 0,
    token_json_bytes: int = TOKEN_JSON_BYTES,
) -> int:
    """The byte cap of one generate reply (formula in the module docstring).

    ``prompt_route_rows`` is P - s - 1 (route rows besides one per new token);
    ``route_shape`` is given only when routes were requested, ``support_k`` > 0 only
    when sample support was; ``token_json_bytes`` bounds one token's JSON in the
    server's reply format (another server's format may need more than ours).
    """
    cap = REPLY_SLACK_BYTES + max_tokens * token_json_bytes
    if route_shape is not None:
        rows = max(0, prompt_route_rows) + max_tokens
        cap += _base64_len(rows * route_shape.row_bytes)
    if support_k > 0:
        cap += 2 * _base64_len(max_tokens * support_k * 4)  # int32 ids + float32 logprobs
        cap += _base64_len(max_tokens * 4)  # int32 kept-set sizes
    return cap


async def read_capped(response: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body of ``response``, refusing (``ReplyTooLarge``) one longer than ``cap``.

    On refusal the connection is closed, not drained, so the sender stops at what the
    socket buffers hold.
    """
    declared = response.content_length
    if declared is not None and declared > cap:
        response.close()
        raise ReplyTooLarge(cap, declared, declared=True)
    chunks: list[bytes] = []
    received = 0
    async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
        received += len(chunk)
        if received > cap:
            response.close()
            raise ReplyTooLarge(cap, received, declared=False)
        chunks.append(chunk)
    return b"".join(chunks)
