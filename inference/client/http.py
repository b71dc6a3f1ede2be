"""What every HTTP client of an inference server shares: the session, one request with
the retry taxonomy and a reply cap (docs/design.md §3), the generate call's preamble
(sampling params, the prompt, the logprobs mode, the body and its reply cap) and
batches of generate calls.

``RemoteGenerateClient`` (our server) and ``VLLMClient`` (a stock vLLM server) differ in
their request and reply formats (``_prepare``), not in how a request is built, sent,
retried or read.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, TypeVar

import aiohttp
import numpy as np
import orjson
import yarl

from inference.client.limits import (
    SERVER_DEFAULT_MAX_TOKENS,
    SMALL_REPLY_BYTES,
    SUPPORT_K_BOUND,
    TOKEN_JSON_BYTES,
    RouteShape,
    generate_reply_cap,
    read_capped,
)
from inference.client.protocol import GenerateRequest, GenerateResult
from inference.client.replies import status_error
from inference.client.retry import RetryPolicy, call_with_retry
from inference.client.sampling import positive_int, sampling_dict
from inference.errors import GenerateTransportError, RequestValidationError

T = TypeVar("T")
C = TypeVar("C", bound="HTTPClientBase")


@dataclass
class GenerateCall:
    """One generate request on its way out, as the engine's client shapes it."""

    request: GenerateRequest
    """What the caller asked for."""
    params: dict[str, Any]
    """The sampling params sent (a fresh dict, ``routed_experts_prompt_start`` merged)."""
    prompt_route_rows: int | None
    """P - s - 1: route rows a reply owes besides one per new token (None: the prompt
    start is not an int, which the server refuses)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Top-level body keys beyond ``token_ids``, ``sampling_params`` and ``model``."""


class HTTPOptions(TypedDict, total=False):
    """``HTTPClientBase``'s options, for an engine's client that adds its own."""

    retry: RetryPolicy | Mapping[str, Any] | None
    api_key: str | None
    model: str | None
    max_connections: int
    seed: int | None
    max_reply_bytes: int | None
    route_shape: RouteShape | None


class HTTPClientBase:
    """Session lifecycle, one retried, capped request, and the generate and weight
    calls of ``GenerateClient``. Use as ``async with`` or call ``close()``; an engine's
    client shapes its server's generate body and parses the reply (``_prepare``), sends
    a weight bucket (``_update_weights``) and adds the server's other calls.

    ``api_key`` is sent as a bearer token; ``max_connections`` caps open connections;
    ``seed`` seeds the backoff jitter; ``retry`` is a :class:`RetryPolicy` or a mapping
    of its fields (e.g. a config section).
    """

    supported_logprobs_modes: tuple[str, ...] = ()
    """``GenerateClient.supported_logprobs_modes``: set by each engine's client."""
    supports_packed_body: bool = False
    generate_path: str = ""
    """The server's generate route."""
    token_json_bytes: int = TOKEN_JSON_BYTES
    """Bound on one generated token's JSON in the server's reply (``limits``)."""

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
        url = yarl.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url: expected an http(s)://host[:port] URL, got {base_url!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections: expected an int >= 1, got {max_connections!r}")
        self.base_url = str(url).rstrip("/")
        if retry is None:
            retry = RetryPolicy()
        elif isinstance(retry, Mapping):  # e.g. a config section: RetryPolicy checks it
            retry = RetryPolicy(**retry)
        elif not isinstance(retry, RetryPolicy):
            raise TypeError(
                f"retry: expected a RetryPolicy or a mapping, got {type(retry).__name__}"
            )
        self.retry = retry
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._rng = random.Random(seed)
        self._session: aiohttp.ClientSession | None = None
        if max_reply_bytes is not None and positive_int(max_reply_bytes) is None:
            raise ValueError(
                f"max_reply_bytes: expected None or an int >= 1, got {max_reply_bytes!r}"
            )
        if route_shape is not None and not isinstance(route_shape, RouteShape):
            raise TypeError(
                f"route_shape: expected a RouteShape or None, got {type(route_shape).__name__}"
            )
        self._model = model
        self.max_reply_bytes = max_reply_bytes
        """Replaces the generate reply cap derived from each request, when given."""
        self.route_shape = route_shape

    async def __aenter__(self: C) -> C:
        self._ensure_session()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session and its connections; the client may be reopened."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

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
        """One completion of ``prompt_token_ids``: ``GenerateClient.generate``
        (``inference.client.protocol``); the engine's client shapes the body and reads
        the reply (``_prepare``), this sends it under the reply cap."""
        return await self._generate(
            GenerateRequest(
                prompt_token_ids=prompt_token_ids,
                sampling_params=sampling_params,
                return_routed_experts=return_routed_experts,
                routed_experts_prompt_start=routed_experts_prompt_start,
                return_sample_support=return_sample_support,
                session_id=session_id,
                return_packed_body=return_packed_body,
            )
        )

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        params = sampling_dict(request.sampling_params)
        if request.routed_experts_prompt_start is not None:
            if "routed_experts_prompt_start" in params:
                raise ValueError(
                    "routed_experts_prompt_start: expected it either as an argument or in "
                    "sampling_params, got both"
                )
            params["routed_experts_prompt_start"] = request.routed_experts_prompt_start
        mode = params.get("logprobs_mode")
        if mode is not None and mode not in self.supported_logprobs_modes:
            raise RequestValidationError(
                "$.sampling_params.logprobs_mode",
                f"one of {list(self.supported_logprobs_modes)} (supported_logprobs_modes: "
                f"what this {type(self).__name__}'s engine reports) or None",
                mode,
            )
        prompt = request.prompt_token_ids
        ids = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
        start = params.get("routed_experts_prompt_start") or 0
        call = GenerateCall(
            request, params, len(ids) - start - 1 if isinstance(start, int) else None
        )
        parse = self._prepare(call)
        payload: dict[str, Any] = {"token_ids": ids, "sampling_params": call.params}
        if self._model is not None:
            payload["model"] = self._model
        payload.update(call.fields)
        body = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
        cap = self.max_reply_bytes
        if cap is None:
            # A max_tokens or k the server refuses gets a small 400: any bound will do.
            support = request.return_sample_support
            cap = generate_reply_cap(
                max_tokens=positive_int(call.params.get("max_tokens")) or SERVER_DEFAULT_MAX_TOKENS,
                prompt_route_rows=call.prompt_route_rows or 0,
                route_shape=await self._reply_route_shape(request),
                support_k=SUPPORT_K_BOUND if support is True else positive_int(support) or 0,
                token_json_bytes=self.token_json_bytes,
            )
        return await self._post(
            self.generate_path, body, parse, content_type="application/json", max_reply_bytes=cap
        )

    def _prepare(self, call: GenerateCall) -> Callable[[bytes], GenerateResult]:
        """The engine's part of a generate call: refuse what its server cannot do, edit
        ``call.params`` and ``call.fields`` into its body, and return the reply's parser."""
        raise NotImplementedError

    async def _reply_route_shape(self, request: GenerateRequest) -> RouteShape | None:
        """The route shape the reply cap counts routes in; None: the reply has none."""
        raise NotImplementedError

    async def generate_batch(
        self, requests: Sequence[GenerateRequest], *, max_concurrency: int = 16
    ) -> list[GenerateResult]:
        """Run ``requests`` with at most ``max_concurrency`` in flight; results in order.

        The first failure cancels the requests still pending and is raised.
        """
        if isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected an int >= 1, got {max_concurrency!r}")
        gate = asyncio.Semaphore(max_concurrency)
        failed = False

        async def one(request: GenerateRequest) -> GenerateResult | None:
            nonlocal failed
            async with gate:
                # A waiter woken by the failing request's release must not send: the
                # batch is already lost and gather cancels the rest a moment later.
                if failed:
                    return None
                try:
                    return await self._generate(request)
                except BaseException:
                    failed = True
                    raise

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            results = await asyncio.gather(*tasks)
            return [r for r in results if r is not None]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _post(
        self,
        path: str,
        body: bytes,
        parse: Callable[[bytes], T],
        *,
        content_type: str,
        max_reply_bytes: int,
        headers: Mapping[str, str] | None = None,
        query: Mapping[str, str] | str | None = None,
        retry: RetryPolicy | None = None,
    ) -> T:
        return await self._request(
            "POST",
            path,
            body,
            parse,
            content_type=content_type,
            max_reply_bytes=max_reply_bytes,
            headers=headers,
            query=query,
            retry=retry,
        )

    async def update_weights(
        self,
        named_tensors: Mapping[str, Any],
        *,
        policy_version: int | None = None,
        commit: bool = True,
    ) -> int:
        """``WeightUpdateClient.update_weights``: one bucket of engine-layout tensors;
        the engine's client sends it (``_update_weights``)."""
        # Imported here: the generate path stays torch-free.
        from inference.engine.base import check_policy_version

        check_policy_version(policy_version, field="policy_version", optional=True)
        return await self._update_weights(
            named_tensors, policy_version=policy_version, commit=commit
        )

    async def _update_weights(
        self, named_tensors: Mapping[str, Any], *, policy_version: int | None, commit: bool
    ) -> int:
        raise NotImplementedError

    async def _get(self, path: str, parse: Callable[[bytes], T]) -> T:
        """One retried ``GET`` of a small document (``/health`` and the like)."""
        return await self._request(
            "GET", path, None, parse, content_type=None, max_reply_bytes=SMALL_REPLY_BYTES
        )

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        parse: Callable[[bytes], T],
        *,
        content_type: str | None,
        max_reply_bytes: int,
        headers: Mapping[str, str] | None = None,
        query: Mapping[str, str] | str | None = None,
        retry: RetryPolicy | None = None,
    ) -> T:
        """One call under ``retry`` (default: the client's policy): transport errors and
        429/503 are retried, any other error status raises, ``parse`` decides the rest."""
        session = self._ensure_session()
        url = self.base_url + path
        sent = dict(headers or {})
        if content_type:
            sent["Content-Type"] = content_type
        what = f"{method} {url}"

        async def attempt(timeout_s: float) -> T:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            try:
                async with session.request(
                    method, url, data=body, headers=sent or None, params=query, timeout=timeout
                ) as response:
                    raw = await read_capped(response, max_reply_bytes)
                    status = response.status
                    retry_after = response.headers.get("Retry-After")
            except asyncio.TimeoutError as exc:
                raise GenerateTransportError(
                    f"{what}: no complete reply within the attempt timeout of {timeout_s:.3g} s"
                ) from exc
            except aiohttp.ClientError as exc:
                raise GenerateTransportError(f"{what}: {type(exc).__name__}: {exc}") from exc
            if status >= 400:
                raise status_error(status, raw, retry_after)
            return parse(raw)

        return await call_with_retry(attempt, retry or self.retry, what=what, rng=self._rng)
