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
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from inference.client.http import HTTPClientBase
from inference.client.limits import (
    SERVER_DEFAULT_MAX_TOKENS,
    SMALL_REPLY_BYTES,
    SUPPORT_K_BOUND,
    RouteShape,
    generate_reply_cap,
)
from inference.client.replies import loads_or_retry
from inference.client.results import (
    GenerateResult,
    parse_choice,
    reply_policy_version,
    single_choice,
)
from inference.client.retry import RetryPolicy
from inference.client.sampling import positive_int, sampling_dict
from inference.client.side_channels import (
    as_protocol_error,
    decode_packed_choice,
    decode_side_channels,
)
from inference.errors import GenerateProtocolError, WireError
from inference.wire import load_packed_body

GENERATE_PATH = "/skyrl/v1/generate"
UPDATE_WEIGHTS_PATH = "/skyrl/v1/update_weights"
HEALTH_PATH = "/health"


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

    supports_packed_body = True
    """Token ids and logprobs can come back as envelopes (``return_packed_body``)."""

    def __init__(
        self,
        base_url: str,
        *,
        retry: RetryPolicy | Mapping[str, Any] | None = None,
        api_key: str | None = None,
        model: str | None = None,
        max_connections: int = 64,
        seed: int | None = None,
        max_reply_bytes: int | None = None,
        route_shape: RouteShape | None = None,
    ) -> None:
        super().__init__(
            base_url,
            retry=retry,
            api_key=api_key,
            model=model,
            max_connections=max_connections,
            seed=seed,
            max_reply_bytes=max_reply_bytes,
            route_shape=route_shape,
        )
        self._route_shape_lock = asyncio.Lock()

    async def generate(
        self,
        *,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any] | Any,
        return_routed_experts: bool = False,
        routed_experts_prompt_start: int | None = None,
        return_sample_support: bool | int = False,
        session_id: str | None = None,
        return_packed_body: bool = False,
    ) -> GenerateResult:
        """Generate one completion of ``prompt_token_ids``.

        ``sampling_params`` is a mapping of wire keys or an engine ``SamplingParams``.
        ``routed_experts_prompt_start`` travels inside the sampling params.
        ``return_sample_support``: True for the server's default k, or an int k.
        ``return_packed_body``: token ids and logprobs come back as envelopes too
        (huge responses then parse without per-token JSON objects).
        """
        params = sampling_dict(sampling_params)
        if routed_experts_prompt_start is not None:
            if "routed_experts_prompt_start" in params:
                raise ValueError(
                    "routed_experts_prompt_start: expected it either as an argument or in "
                    "sampling_params, got both"
                )
            params["routed_experts_prompt_start"] = routed_experts_prompt_start
        ids = (
            prompt_token_ids.tolist()
            if isinstance(prompt_token_ids, np.ndarray)
            else list(prompt_token_ids)
        )
        payload: dict[str, Any] = {"token_ids": ids, "sampling_params": params}
        if self._model is not None:
            payload["model"] = self._model
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if return_sample_support is not False and return_sample_support != 0:
            payload["return_sample_support"] = return_sample_support
        if session_id is not None:
            payload["session_id"] = session_id
        if return_packed_body:
            payload["return_packed_body"] = True
        packed = bool(return_routed_experts or return_packed_body) or (
            "return_sample_support" in payload
        )
        body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)

        start = params.get("routed_experts_prompt_start") or 0
        route_rows = len(ids) - start - 1 if isinstance(start, int) else None

        def parse(raw: bytes) -> GenerateResult:
            return _parse_generate_reply(
                raw,
                packed=packed,
                want_routes=bool(return_routed_experts),
                want_support="return_sample_support" in payload,
                packed_body=return_packed_body,
                prompt_route_rows=route_rows,
            )

        cap = self.max_reply_bytes
        if cap is None:
            # A max_tokens or k the server refuses gets a small 400: any bound will do.
            support = payload.get("return_sample_support")
            cap = generate_reply_cap(
                max_tokens=positive_int(params.get("max_tokens")) or SERVER_DEFAULT_MAX_TOKENS,
                prompt_route_rows=route_rows or 0,
                route_shape=await self._route_shape() if return_routed_experts else None,
                support_k=SUPPORT_K_BOUND if support is True else positive_int(support) or 0,
            )
        return await self._post(
            GENERATE_PATH, body, parse, content_type="application/json", max_reply_bytes=cap
        )

    async def _route_shape(self) -> RouteShape:
        """``route_shape``, read once from ``/health`` when the caller did not pass it."""
        async with self._route_shape_lock:
            if self.route_shape is None:
                self.route_shape = RouteShape.from_health(await self.health())
        return self.route_shape

    async def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        *,
        policy_version: int | None = None,
        commit: bool = True,
    ) -> int:
        """Send named tensors (engine layout) as one safetensors body; returns the count
        the engine loaded (0 for a staged upload). Idempotent, so it is retried like
        generate.

        ``policy_version`` is sent as ``X-Policy-Version``: the version the weights
        become once committed. ``commit=False`` (``X-Weight-Commit: false``) stages the
        upload on the server until a committing one loads everything staged in one step
        (``inference.server.weights_upload``).
        """
        from safetensors.torch import save

        # Imported here, as safetensors.torch is: the generate path stays torch-free.
        from inference.engine.base import check_policy_version

        check_policy_version(policy_version, field="policy_version", optional=True)
        headers: dict[str, str] = {}
        if policy_version is not None:
            headers["X-Policy-Version"] = str(policy_version)
        if policy_version is not None or not commit:
            headers["X-Weight-Commit"] = "true" if commit else "false"
        body = save({name: t.detach().contiguous() for name, t in named_tensors.items()})

        def parse(raw: bytes) -> int:
            reply = loads_or_retry(raw, 200)
            count = reply.get("num_loaded") if isinstance(reply, dict) else None
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

        def parse(raw: bytes) -> dict[str, Any]:
            reply = loads_or_retry(raw, 200)
            if not isinstance(reply, dict):
                raise GenerateProtocolError("$", "a JSON object", reply)
            return reply

        return await self._request(
            "GET", HEALTH_PATH, None, parse, content_type=None, max_reply_bytes=SMALL_REPLY_BYTES
        )


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
    try:
        body = load_packed_body(raw)
    except WireError as exc:
        # A truncated body also fails the splice; only a body that is valid JSON has a
        # malformed packed contract (deterministic), anything else is a broken hop.
        loads_or_retry(raw, 200)
        raise as_protocol_error(exc) from exc
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
