"""Connection limits aiohttp does not enforce itself: a connection cap and read deadlines.

aiohttp closes idle connections (``keepalive_timeout``), but it accepts connections
without bound and lets a request trickle its headers and body for as long as the
client likes: 3,000 half-sent requests were once held open for 90 s. So the server
listens through ``GuardedTCPSite``, which wraps aiohttp's protocol factory:

- past ``max_connections`` a connection is answered 503 and closed before aiohttp
  builds a parser and buffers for it, so a flood costs no memory;
- a request's first byte starts a clock (``RequestClock``); if its headers are not in
  after ``read_timeout_s`` the connection is dropped. Once they are in,
  ``begin_request`` hands the clock to the app, which bounds the body by the same
  deadline (``read_before``) and answers 408 when it passes;
- a request head the HTTP parser refuses (a control byte in a header, a header line
  over 8190 bytes) never reaches the app's middlewares: aiohttp would answer it with a
  plain-text 400 that echoes the offending line and log that line with a traceback,
  per request, token attempts included. ``refuse_malformed`` answers it instead, in
  the app's JSON error shape, and it is logged at DEBUG by exception class only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from inference.errors import RequestValidationError

T = TypeVar("T")

logger = logging.getLogger(__name__)

RefuseMalformed = Callable[[str], web.Response]
"""The reply to a request head the parser refused, given the parse error's class name."""


@dataclass(frozen=True)
class Deadline:
    at: float
    """Event loop time."""
    rule: str
    """Which limit, for the 408's message: "request_read_timeout_s (30 s) of ..."."""

    @classmethod
    def after(cls, start: float, seconds: float, *, name: str, since: str) -> Deadline:
        return cls(start + seconds, f"{name} ({seconds:g} s) of {since}")


def _canned_503(retry_after_s: int) -> bytes:
    error = {"message": "server overloaded: too many open connections", "type": "Overloaded"}
    body = orjson.dumps({"error": error})
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: {retry_after_s}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Refused(asyncio.Protocol):
    """A connection past the cap: one canned reply, then closed; nothing is read."""

    def __init__(self, reply: bytes) -> None:
        self._reply = reply

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._reply)
        transport.close()


class _JsonParseErrors(RequestHandler):
    """aiohttp's per-connection protocol, answering parse errors with ``refuse_malformed``."""

    __slots__ = ("_refuse_malformed",)

    def __init__(self, manager: web.Server, *, refuse_malformed: RefuseMalformed, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._refuse_malformed = refuse_malformed

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400 or not isinstance(exc, HttpProcessingError):  # a handler's 500
            return super().handle_error(request, status, exc, message)
        # exc's message quotes the refused line, which may hold a token: not logged.
        logger.debug("refused a malformed request from %s: %s", request.remote, type(exc).__name__)
        response = self._refuse_malformed(type(exc).__name__)
        response.force_close()  # the parser lost the message's framing
        return response


class RequestClock(asyncio.Protocol):
    """aiohttp's protocol for one connection, plus the header deadline of its requests."""

    def __init__(self, inner: Any, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._started: float | None = None
        self._in_app = False
        self.request_started: float | None = None
        """Loop time of the first byte of the request the app holds; None between."""

    def begin_request(self) -> None:
        """The headers are in and the app takes the request: stops the header clock."""
        self._cancel_timer()
        self._in_app = True
        self.request_started = self._started if self._started is not None else self._loop.time()
        self._started = None

    def end_request(self) -> None:
        self._in_app = False
        self.request_started = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        # Bytes while the app holds a request are its body (or pipelined requests,
        # which aiohttp's keep-alive timer bounds once the reply is out).
        if not self._in_app and self._timer is None:
            self._started = self._loop.time()
            self._timer = self._loop.call_later(self._guard.read_timeout_s, self._expire)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._guard.release()
        self._inner.connection_lost(exc)

    def _expire(self) -> None:
        self._timer = None
        if not self._in_app and self._transport is not None:
            # Abort, not close: close would wait to flush to a client that reads
            # nothing. No 408 either: aiohttp may be mid-reply on this connection.
            self._transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class ConnectionGuard:
    """The protocol factory: aiohttp's, behind the cap and the header clock."""

    def __init__(
        self,
        server: web.Server,
        *,
        max_connections: int,
        read_timeout_s: float,
        retry_after_s: int,
        refuse_malformed: RefuseMalformed,
    ) -> None:
        self._server = server
        self._refuse_malformed = refuse_malformed
        self.max_connections = max_connections
        self.read_timeout_s = read_timeout_s
        self._refusal = _canned_503(retry_after_s)
        self.open_connections = 0
        """Counted when the protocol is made (several accepts can precede their
        ``connection_made``), released when the connection is lost."""

    def __call__(self) -> asyncio.Protocol:
        if self.open_connections >= self.max_connections:
            return _Refused(self._refusal)
        self.open_connections += 1
        # What web.Server() builds, with the runner's protocol options (its _kwargs),
        # but answering parse errors itself.
        inner = _JsonParseErrors(
            self._server,
            loop=asyncio.get_running_loop(),
            refuse_malformed=self._refuse_malformed,
            **self._server._kwargs,
        )
        return RequestClock(inner, self)

    def release(self) -> None:
        self.open_connections -= 1


class GuardedTCPSite(web.BaseSite):
    """``web.TCPSite`` serving through a ``ConnectionGuard``."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        read_timeout_s: float,
        retry_after_s: int,
        refuse_malformed: RefuseMalformed,
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        server = runner.server
        assert server is not None  # BaseSite.__init__ refuses a runner not set up
        self.guard = ConnectionGuard(
            server,
            max_connections=max_connections,
            read_timeout_s=read_timeout_s,
            retry_after_s=retry_after_s,
            refuse_malformed=refuse_malformed,
        )

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard, self._host, self._port, backlog=self._backlog
        )


def clock_of(request: web.BaseRequest) -> RequestClock | None:
    """The clock of the request's connection; None when served another way (tests)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, RequestClock) else None


def read_deadline(request: web.BaseRequest, seconds: float) -> Deadline:
    """``seconds`` after the request's first byte (after now when served another way)."""
    clock = clock_of(request)
    started = clock.request_started if clock is not None else None
    if started is None:
        started = asyncio.get_running_loop().time()
    return Deadline.after(started, seconds, name="request_read_timeout_s", since="its first byte")


async def read_before(read: Awaitable[T], deadline: Deadline) -> T:
    """``await read``, or a 408 ``RequestValidationError`` once ``deadline`` passes."""
    remaining = deadline.at - asyncio.get_running_loop().time()
    try:
        return await asyncio.wait_for(read, timeout=max(remaining, 0.0))
    except asyncio.TimeoutError:
        raise RequestValidationError(
            "body", f"the whole body within {deadline.rule}", "an incomplete body", status=408
        ) from None
