"""Connection limits with raw sockets on loopback: slow headers and slow bodies are cut
off after ``request_read_timeout_s``, idle connections after ``keepalive_timeout_s``,
connections past ``max_connections`` are refused, and error replies keep their HTTP
contract (405 with Allow, 415 for a missing or wrong Content-Type)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import orjson
import pytest
import yarl

from inference.engine.hf_engine import HFMoEEngine
from inference.server import RunningServer, ServerConfig, start_server

T = TypeVar("T")
BODY = orjson.dumps({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}})
TIMEOUT_S = 0.5


@asynccontextmanager
async def serving(**config: Any) -> AsyncIterator[RunningServer]:
    engine = HFMoEEngine.from_config(seed=0, dtype="float32", num_threads=None)
    server = await start_server(engine, ServerConfig(**config))
    try:
        yield server
    finally:
        await server.stop()


def run(body: Callable[[RunningServer], Awaitable[T]], **config: Any) -> T:
    async def main() -> T:
        async with serving(**config) as server:
            return await body(server)

    return asyncio.run(main())


async def connect(server: RunningServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = yarl.URL(server.url)
    return await asyncio.open_connection(url.host, url.port)


async def seconds_until_closed(reader: asyncio.StreamReader, *, limit_s: float = 10.0) -> float:
    """Seconds until the server closes the connection (data before that is read off)."""
    start = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(1 << 16), timeout=limit_s):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status_line, *lines = head.strip().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, orjson.loads(body)


def request(
    path: str, *, body: bytes = BODY, content_type: str | None = "application/json"
) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    return (head + "\r\n").encode() + body


def test_half_sent_headers_are_cut_off_even_when_trickled() -> None:
    async def body(server: RunningServer) -> tuple[float, float]:
        reader, writer = await connect(server)
        writer.write(b"POST /skyrl/v1/generate HTTP/1.1\r\nHost: te")
        quiet = await seconds_until_closed(reader)
        reader, writer = await connect(server)
        start = time.monotonic()

        async def trickle() -> None:
            for byte in b"POST /skyrl/v1/generate HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 100:
                writer.write(bytes([byte]))
                await asyncio.sleep(0.05)

        task = asyncio.ensure_future(trickle())
        await seconds_until_closed(reader)
        task.cancel()
        return quiet, time.monotonic() - start

    quiet, trickled = run(body, request_read_timeout_s=TIMEOUT_S, keepalive_timeout_s=30)
    assert TIMEOUT_S * 0.8 <= quiet < TIMEOUT_S + 2
    assert TIMEOUT_S * 0.8 <= trickled < TIMEOUT_S + 2  # new bytes do not restart the clock


def test_partial_body_is_answered_408_and_the_connection_closed() -> None:
    async def body(server: RunningServer) -> tuple[int, dict[str, str], Any, float]:
        reader, writer = await connect(server)
        start = time.monotonic()
        writer.write(request("/skyrl/v1/generate")[:-10])  # all but the body's last bytes
        status, headers, reply = await read_reply(reader)
        elapsed = time.monotonic() - start
        await seconds_until_closed(reader)
        return status, headers, reply, elapsed

    status, headers, reply, elapsed = run(body, request_read_timeout_s=TIMEOUT_S)
    assert status == 408 and headers["connection"] == "close"
    assert reply == {
        "error": {
            "message": "body: expected the whole body within request_read_timeout_s (0.5 s) of "
            "its first byte, got 'an incomplete body'",
            "type": "RequestValidationError",
            "field": "body",
        }
    }
    assert TIMEOUT_S * 0.8 <= elapsed < TIMEOUT_S + 2


def test_a_slow_request_within_the_timeout_is_served() -> None:
    async def body(server: RunningServer) -> int:
        reader, writer = await connect(server)
        raw = request("/skyrl/v1/generate")
        for part in (raw[:20], raw[20:-5], raw[-5:]):
            writer.write(part)
            await asyncio.sleep(0.1)
        status, _, _ = await read_reply(reader)
        writer.close()
        return status

    assert run(body, request_read_timeout_s=2.0) == 200


def test_idle_connections_close_after_the_keepalive_timeout() -> None:
    async def body(server: RunningServer) -> tuple[float, float]:
        reader, _ = await connect(server)
        never_used = await seconds_until_closed(reader)
        reader, writer = await connect(server)
        writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        status, _, _ = await read_reply(reader)
        assert status == 200
        return never_used, await seconds_until_closed(reader)

    never_used, after_reply = run(body, keepalive_timeout_s=TIMEOUT_S, request_read_timeout_s=30)
    assert TIMEOUT_S * 0.8 <= never_used < TIMEOUT_S + 2
    assert TIMEOUT_S * 0.8 <= after_reply < TIMEOUT_S + 2


def test_connections_past_the_cap_are_refused_and_cost_nothing() -> None:
    cap = 4

    async def body(server: RunningServer) -> tuple[bytes, list[float], int, int]:
        held = [await connect(server) for _ in range(cap)]
        await asyncio.sleep(0.1)
        reader, _ = await connect(server)
        refusal = await asyncio.wait_for(reader.read(), timeout=5)
        extra = [await connect(server) for _ in range(200)]
        closed = [await seconds_until_closed(r, limit_s=5) for r, _ in extra]
        open_while_flooded = server.guard.open_connections
        held[0][1].close()
        while server.guard.open_connections >= cap:
            await asyncio.sleep(0.01)
        reader, writer = await connect(server)
        writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
        status, _, _ = await read_reply(reader)
        for _, w in held[1:] + [(reader, writer)]:
            w.close()
        return refusal, closed, open_while_flooded, status

    refusal, closed, open_while_flooded, status = run(
        body, max_connections=cap, keepalive_timeout_s=30
    )
    assert refusal.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Retry-After: 1\r\n" in refusal
    assert refusal.endswith(
        b'{"error":{"message":"server overloaded: too many open connections","type":"Overloaded"}}'
    )
    assert max(closed) < 1.0  # refused at once, nothing read or held
    assert open_while_flooded == cap
    assert status == 200  # a freed slot is served again


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/skyrl/v1/generate", "POST"), ("DELETE", "/skyrl/v1/update_weights", "POST")],
)
def test_405_carries_allow(method: str, path: str, allow: str) -> None:
    async def body(server: RunningServer) -> tuple[int, dict[str, str], Any]:
        reader, writer = await connect(server)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
        reply = await read_reply(reader)
        writer.close()
        return reply

    status, headers, reply = run(body)
    assert status == 405 and headers["allow"] == allow
    assert headers["content-type"] == "application/json"
    assert reply["error"]["type"] == "HTTPMethodNotAllowed"


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON; charset=UTF-8", 200),
        (None, 415),
        ("text/plain", 415),
        ("application/octet-stream", 415),
        ("application/json; charset=latin-1", 415),
        ("application/jsonp", 415),
    ],
)
@pytest.mark.parametrize("path", ["/skyrl/v1/generate", "/inference/v1/generate"])
def test_generate_needs_the_json_content_type(
    path: str, content_type: str | None, status: int
) -> None:
    async def body(server: RunningServer) -> tuple[int, dict[str, str], Any]:
        reader, writer = await connect(server)
        writer.write(request(path, content_type=content_type))
        reply = await read_reply(reader)
        writer.close()
        return reply

    got, _, reply = run(body)
    assert got == status
    if status == 415:
        assert reply == {
            "error": {
                "message": "Content-Type: expected application/json (a charset, if any, utf-8), "
                f"got {content_type!r}",
                "type": "RequestValidationError",
                "field": "Content-Type",
            }
        }
