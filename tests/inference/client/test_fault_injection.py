"""The client's retry taxonomy against a fault-injecting aiohttp server on loopback.

Each scenario scripts what the server does on attempt 1, 2, ...; the server counts
the attempts it saw, so every test asserts how many were made.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import orjson
import pytest
from aiohttp import web

from inference.client import GenerateRequest, RemoteGenerateClient, RetryPolicy
from inference.errors import (
    DeadlineExceeded,
    GenerateHTTPError,
    GenerateProtocolError,
    GenerateTransportError,
)
from inference.wire import pack_routed_experts

Behaviour = Callable[[web.Request], Awaitable[web.StreamResponse]]

GOOD = {
    "choices": [
        {
            "token_ids": [5, 6],
            "finish_reason": "length",
            "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
        }
    ]
}
# Fast retries: these tests are about the taxonomy and counts, not real backoff.
FAST = RetryPolicy(
    max_attempts=4,
    initial_backoff_s=0.01,
    max_backoff_s=0.02,
    attempt_timeout_s=2.0,
    deadline_s=10.0,
)
PARAMS = {"max_tokens": 2}


async def ok(_: web.Request) -> web.Response:
    return web.json_response(GOOD)


async def drop_connection(request: web.Request) -> web.StreamResponse:
    assert request.transport is not None
    request.transport.abort()  # no status line at all: "server disconnected"
    return web.Response()


async def html_502(_: web.Request) -> web.Response:
    return web.Response(
        status=502, text="<html><body>Bad Gateway</body></html>", content_type="text/html"
    )


async def truncated_json(_: web.Request) -> web.Response:
    # A hop cut the body but fixed up Content-Length: the bytes are not JSON.
    return web.Response(body=orjson.dumps(GOOD)[:30], content_type="application/json")


async def short_body(request: web.Request) -> web.StreamResponse:
    # Content-Length promises more than arrives before the connection closes.
    response = web.StreamResponse(
        headers={"Content-Length": "1000", "Content-Type": "application/json"}
    )
    await response.prepare(request)
    await response.write(orjson.dumps(GOOD)[:30])
    assert request.transport is not None
    request.transport.close()
    return response


async def slow(_: web.Request) -> web.Response:
    await asyncio.sleep(3.0)
    return web.json_response(GOOD)


def busy(retry_after: str | None) -> Behaviour:
    async def handler(_: web.Request) -> web.Response:
        headers = {"Retry-After": retry_after} if retry_after is not None else {}
        body = {"error": {"message": "queue full", "type": "Overloaded"}}
        return web.json_response(body, status=503, headers=headers)

    return handler


def json_error(status: int) -> Behaviour:
    async def handler(_: web.Request) -> web.Response:
        body = {
            "error": {
                "message": "$.token_ids[3]: expected an int",
                "type": "RequestValidationError",
            }
        }
        return web.json_response(body, status=status)

    return handler


async def text_404(_: web.Request) -> web.Response:
    return web.Response(status=404, text="no such route here")


def reply(body: object) -> Behaviour:
    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    return handler


# The shape of the routes these tests send: [rows, 4 layers, top-2 of 8 experts].
HEALTH = {"status": "ok", "engine": {"num_layers": 4, "top_k": 2, "num_experts": 8}}


@contextlib.asynccontextmanager
async def fault_server(
    script: list[Behaviour], *, health: Behaviour = reply(HEALTH)
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """Attempt i gets script[i] (the last entry repeats); yields (url, request bodies).

    Generate and weight-update requests run the script; ``GET /health`` runs ``health``
    (the client reads the route shape there) and is not counted as an attempt.
    """
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        return await script[min(len(seen), len(script)) - 1](request)

    app = web.Application()
    app.router.add_post("/skyrl/v1/generate", handler)
    app.router.add_post("/skyrl/v1/update_weights", handler)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", seen
    finally:
        await runner.cleanup()


def scenario(script: list[Behaviour], *, policy: RetryPolicy = FAST, **generate_kwargs):
    """Runs one generate against ``script``; returns (result or exception, attempts)."""

    async def main():
        async with fault_server(script) as (url, seen):
            async with RemoteGenerateClient(url, retry=policy, seed=0) as client:
                try:
                    result = await client.generate(
                        prompt_token_ids=[1, 2, 3], sampling_params=PARAMS, **generate_kwargs
                    )
                except Exception as exc:
                    result = exc
            return result, len(seen)

    return asyncio.run(main())


@pytest.mark.parametrize(
    "fault", [drop_connection, html_502, truncated_json, short_body], ids=lambda f: f.__name__
)
def test_transient_faults_are_retried_then_succeed(fault: Behaviour) -> None:
    result, attempts = scenario([fault, fault, ok])
    assert attempts == 3
    assert result.response_ids == [5, 6] and result.logprobs == [-1.0, -2.0]


@pytest.mark.parametrize("fault", [drop_connection, html_502], ids=lambda f: f.__name__)
def test_persistent_transient_fault_gives_up_after_max_attempts(fault: Behaviour) -> None:
    result, attempts = scenario([fault])
    assert type(result) is GenerateTransportError
    assert attempts == FAST.max_attempts
    assert f"gave up after {FAST.max_attempts} attempt(s)" in str(result)


def test_truncated_packed_body_is_retried_not_a_protocol_error() -> None:
    # The splice also fails on a cut body; only a body that is valid JSON may be
    # called a protocol error, so this one is retried like any broken hop.
    choice = dict(GOOD["choices"][0])
    choice["routed_experts"] = pack_routed_experts(np.ones((3 + 2 - 1, 4, 2), dtype=np.uint8))
    raw = orjson.dumps({"choices": [choice]})

    async def cut(_: web.Request) -> web.Response:
        return web.Response(body=raw[: raw.index(b'"data"') + 20], content_type="application/json")

    result, attempts = scenario([cut, reply({"choices": [choice]})], return_routed_experts=True)
    assert attempts == 2
    assert result.routed_experts.shape == (4, 4, 2) and int(result.routed_experts.sum()) == 32


def test_slow_reply_is_cut_by_the_attempt_timeout_and_retried() -> None:
    policy = RetryPolicy(
        max_attempts=3,
        initial_backoff_s=0.01,
        max_backoff_s=0.01,
        attempt_timeout_s=0.3,
        deadline_s=10.0,
    )
    result, attempts = scenario([slow, ok], policy=policy)
    assert attempts == 2 and result.response_ids == [5, 6]


def test_deadline_is_respected_while_retrying_slow_replies() -> None:
    # 100 attempts allowed, but a 1 s deadline over 0.3 s attempts leaves room for at
    # most four; the client must stop there with DeadlineExceeded.
    policy = RetryPolicy(
        max_attempts=100,
        initial_backoff_s=0.01,
        max_backoff_s=0.01,
        attempt_timeout_s=0.3,
        deadline_s=1.0,
    )
    result, attempts = scenario([slow], policy=policy)
    assert isinstance(result, DeadlineExceeded)
    assert 1 <= attempts <= 4
    assert "deadline of 1.0 s" in str(result)


def test_503_retry_after_is_honoured_then_succeeds() -> None:
    result, attempts = scenario([busy("0"), busy("0.05"), ok])
    assert attempts == 3 and result.finish_reason == "length"


def test_retry_after_zero_still_waits_the_minimum_backoff() -> None:
    # An overloaded server answering "Retry-After: 0" must not be hammered in a loop.
    times: list[float] = []

    async def timed_busy(request: web.Request) -> web.StreamResponse:
        times.append(time.monotonic())
        return await busy("0")(request)

    result, attempts = scenario([timed_busy, timed_busy, timed_busy, ok])
    assert attempts == 4 and result.response_ids == [5, 6]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(gaps) == 2 and min(gaps) >= FAST.min_backoff_s


def test_503_that_persists_raises_the_servers_message() -> None:
    result, attempts = scenario([busy("0")])
    assert isinstance(result, GenerateHTTPError)
    assert (
        result.status == 503
        and result.message == "queue full"
        and result.error_type == "Overloaded"
    )
    assert attempts == FAST.max_attempts


def test_retry_after_beyond_the_deadline_fails_at_once() -> None:
    result, attempts = scenario([busy("3600"), ok])
    assert isinstance(result, DeadlineExceeded) and attempts == 1
    assert "503" in str(result)


@pytest.mark.parametrize("status", [400, 413, 500, 502])
def test_json_error_status_raises_with_the_servers_message(status: int) -> None:
    result, attempts = scenario([json_error(status), ok])
    assert isinstance(result, GenerateHTTPError) and attempts == 1
    assert result.status == status
    assert result.message == "$.token_ids[3]: expected an int"
    assert result.error_type == "RequestValidationError"


def test_undecodable_4xx_raises_with_its_text() -> None:
    result, attempts = scenario([text_404, ok])
    assert isinstance(result, GenerateHTTPError) and attempts == 1
    assert result.status == 404 and "no such route here" in result.message


def test_malformed_envelope_is_a_protocol_error_never_retried() -> None:
    choice = dict(GOOD["choices"][0])
    envelope = pack_routed_experts(np.zeros((2 + 2 - 1, 4, 2), dtype=np.uint8))
    envelope["dtype"] = "int16"  # non-canonical: ids <= 255 must travel as uint8
    envelope["data"] = envelope["data"] * 2
    choice["routed_experts"] = envelope
    result, attempts = scenario([reply({"choices": [choice]}), ok], return_routed_experts=True)
    assert isinstance(result, GenerateProtocolError) and attempts == 1
    assert result.path == "$.choices[0].routed_experts.dtype"
    assert "uint8" in result.expected and result.got == "int16"


def test_route_rows_that_ignore_the_prompt_start_are_a_protocol_error() -> None:
    # The server returned the whole prefix (P + G - 1 = 4 rows) though start = 2 asked
    # for P - s + G - 1 = 2: silently accepting it would misalign every later turn.
    choice = dict(GOOD["choices"][0])
    choice["routed_experts"] = pack_routed_experts(np.zeros((4, 4, 2), dtype=np.uint8))
    result, attempts = scenario(
        [reply({"choices": [choice]})], return_routed_experts=True, routed_experts_prompt_start=2
    )
    assert isinstance(result, GenerateProtocolError) and attempts == 1
    assert result.path == "$.choices[0].routed_experts.shape[0]" and result.got == 4


def test_missing_requested_envelope_is_a_protocol_error() -> None:
    result, attempts = scenario([ok], return_routed_experts=True)
    assert isinstance(result, GenerateProtocolError) and attempts == 1
    assert result.path == "$.choices[0].routed_experts"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"choices": []}, "$.choices"),
        ([1, 2], "$"),
        ({"choices": [{"token_ids": [1, "x"], "finish_reason": "stop"}]}, "$.choices[0].token_ids"),
        ({"choices": [{"token_ids": [1], "finish_reason": None}]}, "$.choices[0].finish_reason"),
        (
            {"choices": [{"token_ids": [1], "finish_reason": "stop", "logprobs": {"content": []}}]},
            "$.choices[0].logprobs.content",
        ),
    ],
)
def test_malformed_plain_reply_is_a_protocol_error(body: object, field: str) -> None:
    result, attempts = scenario([reply(body), ok])
    assert isinstance(result, GenerateProtocolError) and attempts == 1
    assert result.path == field


def test_connection_refused_is_retried_then_raised() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01)

    async def main() -> Exception:
        async with RemoteGenerateClient(f"http://127.0.0.1:{port}", retry=policy) as client:
            with pytest.raises(GenerateTransportError) as info:
                await client.generate(prompt_token_ids=[1], sampling_params=PARAMS)
            return info.value

    error = asyncio.run(main())
    assert "gave up after 3 attempt(s)" in str(error) and "ClientConnectorError" in str(error)


def test_request_body_carries_flags_and_prompt_start_inside_sampling_params() -> None:
    async def main() -> list[bytes]:
        async with fault_server([ok]) as (url, seen):
            async with RemoteGenerateClient(url, retry=FAST, model="tiny-moe") as client:
                # The canned reply has no side channels, so this ends in a protocol error;
                # what matters here is the request the server saw.
                with pytest.raises(GenerateProtocolError):
                    await client.generate(
                        prompt_token_ids=np.array([1, 2, 3]),
                        sampling_params={"max_tokens": 2, "temperature": 0.0},
                        return_routed_experts=True,
                        routed_experts_prompt_start=1,
                        return_sample_support=3,
                        session_id="s-1",
                    )
            return seen

    (sent,) = asyncio.run(main())
    assert orjson.loads(sent) == {
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 2, "temperature": 0.0, "routed_experts_prompt_start": 1},
        "model": "tiny-moe",
        "return_routed_experts": True,
        "return_sample_support": 3,
        "session_id": "s-1",
    }


def test_batch_helper_stops_at_the_first_failure() -> None:
    async def main() -> tuple[Exception, int]:
        async with fault_server([ok, json_error(400), ok]) as (url, seen):
            async with RemoteGenerateClient(url, retry=FAST) as client:
                requests = [GenerateRequest([1, 2], PARAMS) for _ in range(3)]
                with pytest.raises(GenerateHTTPError) as info:
                    await client.generate_batch(requests, max_concurrency=1)
            return info.value, len(seen)

    error, attempts = asyncio.run(main())
    assert error.status == 400 and attempts == 2  # the third was cancelled, never sent


def test_client_argument_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="base_url: expected"):
        RemoteGenerateClient("localhost:8000")
    with pytest.raises(ValueError, match="max_connections: expected"):
        RemoteGenerateClient("http://127.0.0.1:1", max_connections=0)

    async def main() -> None:
        async with RemoteGenerateClient("http://127.0.0.1:1") as client:
            with pytest.raises(ValueError, match="routed_experts_prompt_start: expected"):
                await client.generate(
                    prompt_token_ids=[1],
                    sampling_params={"routed_experts_prompt_start": 0},
                    return_routed_experts=True,
                    routed_experts_prompt_start=0,
                )
            with pytest.raises(ValueError, match="max_concurrency: expected"):
                await client.generate_batch([], max_concurrency=0)
        assert client._session is None  # closed by the context manager

    asyncio.run(main())
