"""What every HTTP client of an inference server shares: the session, one request with
the retry taxonomy and a reply cap (docs/design.md §3), and batches of generate calls.

``RemoteGenerateClient`` (our server) and ``VLLMClient`` (a stock vLLM server) differ in
their request and reply formats, not in how a request is sent, retried or read.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import aiohttp
import yarl

from inference.client.limits import RouteShape, read_capped
from inference.client.replies import status_error
from inference.client.results import GenerateRequest, GenerateResult
from inference.client.retry import RetryPolicy, call_with_retry
from inference.client.sampling import positive_int
from inference.errors import GenerateTransportError

T = TypeVar("T")
C = TypeVar("C", bound="HTTPClientBase")


class HTTPClientBase:
    """Session lifecycle and one retried, capped request. Use as ``async with`` or call
    ``close()``; subclasses add ``generate`` and the server's other calls.

    ``api_key`` is sent as a bearer token; ``max_connections`` caps open connections;
    ``seed`` seeds the backoff jitter; ``retry`` is a :class:`RetryPolicy` or a mapping
    of its fields (e.g. a config section).
    """

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
                    return await self.generate(
                        prompt_token_ids=request.prompt_token_ids,
                        sampling_params=request.sampling_params,
                        return_routed_experts=request.return_routed_experts,
                        routed_experts_prompt_start=request.routed_experts_prompt_start,
                        return_sample_support=request.return_sample_support,
                        session_id=request.session_id,
                        return_packed_body=request.return_packed_body,
                    )
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
