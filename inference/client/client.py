"""``RemoteGenerateClient``: raw generate requests to an inference server over HTTP.

Error taxonomy (docs/design.md §3), decided per attempt:

- connection refused/reset, server disconnect, per-attempt timeout, a truncated or
  otherwise undecodable body with a non-4xx status (an HTML 502 from a gateway): retried
  (``GenerateTransportError``) with backoff, then ``DeadlineExceeded`` or give up;
- 429 and 503: retried, honouring ``Retry-After``; ``GenerateHTTPError`` if retries end;
- any other error status with a JSON body: ``GenerateHTTPError`` carrying the server's
  ``error.message`` and ``error.type``; an undecodable 4xx raises with its text;
- a valid JSON body whose contract is malformed: ``GenerateProtocolError``, never retried;
- a body longer than the request's size cap (``limits``): ``ReplyTooLarge``, a
  ``GenerateProtocolError`` raised while reading, never retried.

Plain generation parses with ``orjson.loads``; the packed splice (``load_packed_body``)
runs only when the request asked for a packed side channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Final

from inference.client.http import GenerateCall, HTTPClientBase
from inference.client.limits import SMALL_REPLY_BYTES, RouteShape
from inference.client.protocol import GenerateRequest, GenerateResult
from inference.client.replies import json_object, loads_or_retry
from inference.client.results import parse_choice, reply_policy_version, single_choice
from inference.client.side_channels import decode_packed_choice, decode_side_channels, load_reply
from inference.errors import GenerateProtocolError
from inference.wire import LOGPROBS_MODES

GENERATE_PATH: Final = "/skyrl/v1/generate"
UPDATE_WEIGHTS_PATH: Final = "/skyrl/v1/update_weights"
HEALTH_PATH: Final = "/health"


class RemoteGenerateClient(HTTPClientBase):
    """Async client of one inference server. Use as ``async with`` or call ``close()``.

    ``api_key`` is sent as a bearer token; ``model`` (optional) is sent with every
    request; ``max_connections`` caps open connections; ``seed`` seeds the jitter.

    Reply sizes are capped (see ``inference.client.limits``): each generate reply may
    be at most the bound derived from its request (prompt length, ``max_tokens``,
    requested side channels), ``/health`` and weight-update replies 64 KiB. Routes
    need the engine's ``route_shape`` (layers, top_k, experts): pass it, or the client
    reads it once from ``/health`` on the first request for routes.
    ``max_reply_bytes``, when given, replaces the derived generate cap (and the
    ``/health`` lookup), e.g. for a server whose default support k exceeds 64.
    """

    supported_logprobs_modes = LOGPROBS_MODES
    """The builtin engine computes either mode per request (``inference/engine/sampling.py``)."""
    supports_packed_body = True
    """Token ids and logprobs can come back as envelopes (``return_packed_body``)."""
    generate_path = GENERATE_PATH
    _route_shape_lock: asyncio.Lock | None = None

    def _prepare(self, call: GenerateCall) -> Callable[[bytes], GenerateResult]:
        request, fields = call.request, call.fields
        support = request.return_sample_support
        want_support = support is not False and support != 0
        if request.return_routed_experts:
            fields["return_routed_experts"] = True
        if want_support:
            fields["return_sample_support"] = support
        if request.session_id is not None:
            fields["session_id"] = request.session_id
        if request.return_packed_body:
            fields["return_packed_body"] = True
        packed = bool(request.return_routed_experts or request.return_packed_body or want_support)

        def parse(raw: bytes) -> GenerateResult:
            return _parse_generate_reply(
                raw,
                packed=packed,
                want_routes=bool(request.return_routed_experts),
                want_support=want_support,
                packed_body=request.return_packed_body,
                prompt_route_rows=call.prompt_route_rows,
            )

        return parse

    async def _reply_route_shape(self, request: GenerateRequest) -> RouteShape | None:
        return await self._route_shape() if request.return_routed_experts else None

    async def _route_shape(self) -> RouteShape:
        """``route_shape``, read once from ``/health`` when the caller did not pass it."""
        if self._route_shape_lock is None:  # made here, inside the loop that uses it
            self._route_shape_lock = asyncio.Lock()
        async with self._route_shape_lock:
            if self.route_shape is None:
                self.route_shape = RouteShape.from_health(await self.health())
        return self.route_shape

    async def _update_weights(
        self, named_tensors: Mapping[str, Any], *, policy_version: int | None, commit: bool
    ) -> int:
        """One safetensors body; the count the engine loaded (0 for a staged upload).
        Idempotent, so it is retried like generate.

        ``policy_version`` is sent as ``X-Policy-Version``: the version the weights
        become once committed. ``commit=False`` (``X-Weight-Commit: false``) stages the
        upload on the server until a committing one loads everything staged in one step
        (``inference.server.weights_upload``).
        """
        # Imported here: the generate path stays torch-free.
        from safetensors.torch import save

        headers: dict[str, str] = {}
        if policy_version is not None:
            headers["X-Policy-Version"] = str(policy_version)
        if policy_version is not None or not commit:
            headers["X-Weight-Commit"] = "true" if commit else "false"
        body = save({name: t.detach().contiguous() for name, t in named_tensors.items()})

        def parse(raw: bytes) -> int:
            count = json_object(raw).get("num_loaded")
            if isinstance(count, bool) or not isinstance(count, int):
                raise GenerateProtocolError("$.num_loaded", "an int", count)
            return count

        return await self._post(
            UPDATE_WEIGHTS_PATH,
            body,
            parse,
            content_type="application/octet-stream",
            max_reply_bytes=SMALL_REPLY_BYTES,
            headers=headers,
        )

    async def health(self) -> dict[str, Any]:
        """The server's ``/health`` document (one attempt per retry policy step)."""
        return await self._get(HEALTH_PATH, json_object)


def _parse_generate_reply(
    raw: bytes,
    *,
    packed: bool,
    want_routes: bool,
    want_support: bool,
    packed_body: bool = False,
    prompt_route_rows: int | None,
) -> GenerateResult:
    """``prompt_route_rows`` = P - s - 1: route rows expected besides one per new token."""
    if not packed:
        reply = loads_or_retry(raw, 200)
        choice, clamped = single_choice(reply)
        result = parse_choice(choice, num_clamped_logprobs=clamped)
        result.policy_version = reply_policy_version(reply)
        return result
    body = load_reply(raw)
    choice, clamped = single_choice(body)
    if packed_body:
        result = decode_packed_choice(choice, num_clamped_logprobs=clamped)
    else:
        result = parse_choice(choice, num_clamped_logprobs=clamped)
    result.policy_version = reply_policy_version(body)
    decode_side_channels(
        choice,
        result,
        want_routes=want_routes,
        want_support=want_support,
        expected_route_rows=(
            None if prompt_route_rows is None else prompt_route_rows + len(result.response_ids)
        ),
    )
    return result
