"""Reply size caps: derived per request, enforced while reading, never retried.

The streaming tests run a real aiohttp server on 127.0.0.1 that sends far more
garbage than the cap and count what it managed to write before the client hung up.
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
import zlib

import numpy as np
import orjson
import pytest
from aiohttp import web

from inference.client import RemoteGenerateClient, ReplyTooLarge, RouteShape
from inference.client.limits import (
    REPLY_SLACK_BYTES,
    SERVER_DEFAULT_MAX_TOKENS,
    SMALL_REPLY_BYTES,
    SUPPORT_K_BOUND,
    TOKEN_JSON_BYTES,
    generate_reply_cap,
)
from inference.errors import GenerateProtocolError
from inference.wire import dumps_generate_response, pack_routed_experts
from tests.inference.client.test_fault_injection import (
    FAST,
    GOOD,
    PARAMS,
    Behaviour,
    fault_server,
    reply,
    scenario,
)

MiB = 1 << 20
GARBAGE_BYTES = 256 * MiB  # the security review's reply was 300 MiB
# What can be in flight when the client stops reading: the loopback socket buffers
# (a few MiB each way under Linux autotuning) plus aiohttp's read buffer. Measured:
# 5.5 MiB sent (chunked) and 3.9 MiB (lying Content-Length) before the hang-up, where
# reading the whole body with response.read() took all 256 MiB.
IN_FLIGHT_BYTES = 32 * MiB


def garbage(sent: list[int], *, content_length: int | None) -> Behaviour:
    """Streams GARBAGE_BYTES of non-JSON, chunked or behind ``content_length``;
    ``sent[0]`` counts the bytes the socket accepted before the client hung up."""
    chunk = b"\xff" * (64 << 10)

    async def handler(request: web.Request) -> web.StreamResponse:
        headers = {"Content-Type": "application/json"}
        if content_length is not None:
            headers["Content-Length"] = str(content_length)
        response = web.StreamResponse(headers=headers)
        if content_length is None:
            response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            while sent[0] < GARBAGE_BYTES:
                await response.write(chunk)
                sent[0] += len(chunk)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client closed the connection: exactly what is tested
        return response

    return handler


@pytest.mark.parametrize(
    "content_length", [None, 300 * MiB], ids=["chunked", "lying-content-length"]
)
def test_huge_garbage_reply_is_cut_at_the_cap_without_buffering_it(
    content_length: int | None,
) -> None:
    sent = [0]
    cap = generate_reply_cap(max_tokens=PARAMS["max_tokens"])
    tracemalloc.start()
    try:
        start = time.monotonic()
        result, attempts = scenario([garbage(sent, content_length=content_length)])
        elapsed = time.monotonic() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, ReplyTooLarge) and attempts == 1  # never retried
    assert result.cap == cap and result.path == "$"
    assert f"at most {cap} bytes" in str(result) and str(result.received) in str(result)
    if content_length is None:
        assert not result.declared and cap < result.received <= cap + (64 << 10)
    else:
        assert result.declared and result.received == content_length
    assert sent[0] < IN_FLIGHT_BYTES + cap  # reading stopped: the sender was blocked
    # Client and server together: 1.6 MiB measured, where read() peaked at 512 MiB.
    assert peak < 16 * MiB
    assert elapsed < 10.0


def test_compressed_reply_is_capped_after_decompression() -> None:
    # Content-Length counts the 64 KiB on the wire; the cap counts what it inflates to.
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    bomb = compressor.compress(bytes(64 * MiB)) + compressor.flush()

    async def gzip_bomb(_: web.Request) -> web.Response:
        return web.Response(
            body=bomb, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )

    tracemalloc.start()
    try:
        result, attempts = scenario([gzip_bomb])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(result, ReplyTooLarge) and attempts == 1 and not result.declared
    assert peak < 16 * MiB  # measured 2.4 MiB for a 512 MiB bomb


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_cap_is_inclusive_to_the_byte(chunked: bool) -> None:
    raw = orjson.dumps(GOOD)

    async def exact(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if chunked:
            response.enable_chunked_encoding()
        else:
            response.content_length = len(raw)
        await response.prepare(request)
        await response.write(raw)
        await response.write_eof()
        return response

    async def main(cap: int) -> object:
        async with fault_server([exact]) as (url, _):
            async with RemoteGenerateClient(url, retry=FAST, max_reply_bytes=cap) as client:
                try:
                    return await client.generate(prompt_token_ids=[1], sampling_params=PARAMS)
                except ReplyTooLarge as exc:
                    return exc

    fits = asyncio.run(main(len(raw)))
    assert not isinstance(fits, Exception) and fits.response_ids == [5, 6]
    over = asyncio.run(main(len(raw) - 1))
    assert isinstance(over, ReplyTooLarge) and over.cap == len(raw) - 1
    assert over.received == len(raw) and over.declared is not chunked


@pytest.mark.parametrize("packed_body", [False, True], ids=["json-tokens", "packed-body"])
def test_derived_cap_holds_the_largest_honest_reply(packed_body: bool) -> None:
    # Worst case for each part: 4096 int32-max ids, longest float reprs, int16 routes
    # (300 experts) over a 1000-token prompt, k = 64 support and its set sizes, every
    # side channel on.
    prompt_len, max_tokens, k = 1000, 4096, 64
    shape = RouteShape(num_layers=48, top_k=8, num_experts=300)
    rng = np.random.default_rng(0)
    routes = rng.integers(0, 300, size=(prompt_len - 1 + max_tokens, 48, 8)).astype(np.int16)
    routes[0, 0, 0] = 299
    ids = [2**31 - 1] * max_tokens
    logprobs = [-2.2250738585072014e-308] * max_tokens
    choice: dict[str, object] = {
        "index": 0,
        "token_ids": None if packed_body else ids,
        "finish_reason": "length",
        "logprobs": None if packed_body else {"content": [{"logprob": v} for v in logprobs]},
    }
    if packed_body:
        choice["packed_token_ids"] = np.asarray(ids, dtype=np.int32)
        choice["packed_logprobs"] = np.asarray(logprobs, dtype=np.float32)
    choice["routed_experts"] = routes
    choice["rollout_sample_support"] = np.full((max_tokens, k), 2**31 - 1, dtype=np.int32)
    choice["rollout_sample_support_logprobs"] = np.full((max_tokens, k), -1e-30, np.float32)
    choice["rollout_sample_support_size"] = np.full(max_tokens, 2**31 - 1, dtype=np.int32)
    body = dumps_generate_response(
        [choice], extra={"model": "m" * 200, "num_clamped_logprobs": max_tokens}
    )
    cap = generate_reply_cap(
        max_tokens=max_tokens,
        prompt_route_rows=prompt_len - 1,
        route_shape=shape,
        support_k=k,
    )
    assert len(body) <= cap  # honest replies always fit ...
    # ... and only the slack and the per-token allowance (48 of 64 bytes used by JSON
    # tokens, 2 x 4 x 4/3 = 10.7 by packed ones) separate the cap from that reply.
    unused_per_token = TOKEN_JSON_BYTES - (10 if packed_body else 48)
    assert cap - len(body) <= REPLY_SLACK_BYTES + unused_per_token * max_tokens
    # Without side channels only the per-token JSON and the slack remain.
    assert generate_reply_cap(max_tokens=max_tokens) == (
        REPLY_SLACK_BYTES + max_tokens * TOKEN_JSON_BYTES
    )


def test_cap_defaults_track_the_servers_defaults() -> None:
    from inference.engine.base import SamplingParams
    from inference.server.app import ServerConfig

    assert SERVER_DEFAULT_MAX_TOKENS == SamplingParams().max_tokens
    assert SUPPORT_K_BOUND == ServerConfig().max_sample_support_k


def test_route_shape_is_read_once_from_health_and_bounds_the_reply() -> None:
    hits: list[int] = []
    health = {"status": "ok", "engine": {"num_layers": 4, "top_k": 2, "num_experts": 8}}

    async def counted_health(request: web.Request) -> web.StreamResponse:
        hits.append(1)
        return await reply(health)(request)

    choice = dict(GOOD["choices"][0])
    choice["routed_experts"] = pack_routed_experts(np.ones((3 + 2 - 1, 4, 2), dtype=np.uint8))
    # Routes far wider than /health said: 2.1 MiB of base64 against a 1 MiB + 172 B cap.
    oversized = dict(choice)
    oversized["routed_experts"] = pack_routed_experts(
        np.ones((3 + 2 - 1, 400, 1000), dtype=np.uint8)
    )
    script = [reply({"choices": [choice]})] * 3 + [reply({"choices": [oversized]})]

    async def main() -> tuple[list, Exception, RouteShape | None]:
        async with fault_server(script, health=counted_health) as (url, _):
            async with RemoteGenerateClient(url, retry=FAST) as client:
                results = await asyncio.gather(
                    *(
                        client.generate(
                            prompt_token_ids=[1, 2, 3],
                            sampling_params=PARAMS,
                            return_routed_experts=True,
                        )
                        for _ in range(3)
                    )
                )
                with pytest.raises(ReplyTooLarge) as info:
                    await client.generate(
                        prompt_token_ids=[1, 2, 3],
                        sampling_params=PARAMS,
                        return_routed_experts=True,
                    )
                return results, info.value, client.route_shape

    results, error, learned = asyncio.run(main())
    assert len(hits) == 1  # three concurrent requests, one /health
    assert learned == RouteShape(num_layers=4, top_k=2, num_experts=8)
    assert all(r.routed_experts.shape == (4, 4, 2) for r in results)
    assert error.cap == generate_reply_cap(
        max_tokens=2, prompt_route_rows=3 - 1, route_shape=learned
    )


def test_a_passed_route_shape_skips_health() -> None:
    hits: list[int] = []

    async def counted_health(request: web.Request) -> web.StreamResponse:
        hits.append(1)
        return web.Response(status=404)

    choice = dict(GOOD["choices"][0])
    choice["routed_experts"] = pack_routed_experts(np.ones((3 + 2 - 1, 4, 2), dtype=np.uint8))

    async def main() -> object:
        async with fault_server([reply({"choices": [choice]})], health=counted_health) as (url, _):
            shape = RouteShape(num_layers=4, top_k=2, num_experts=8)
            async with RemoteGenerateClient(url, retry=FAST, route_shape=shape) as client:
                return await client.generate(
                    prompt_token_ids=[1, 2, 3], sampling_params=PARAMS, return_routed_experts=True
                )

    result = asyncio.run(main())
    assert hits == [] and result.routed_experts.shape == (4, 4, 2)


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"status": "ok"}, "$.engine"),
        ({"engine": {"top_k": 2, "num_experts": 8}}, "$.engine.num_layers"),
        ({"engine": {"num_layers": 4, "top_k": 0, "num_experts": 8}}, "$.engine.top_k"),
        ({"engine": {"num_layers": 4, "top_k": 2, "num_experts": 2**40}}, "$.engine"),
    ],
)
def test_health_without_a_route_shape_is_a_protocol_error(document: dict, field: str) -> None:
    result, attempts = _generate_routes_against_health(document)
    assert isinstance(result, GenerateProtocolError) and result.path == field
    assert attempts == 0  # no generate was sent without a cap


def _generate_routes_against_health(document: dict) -> tuple[object, int]:
    async def main() -> tuple[object, int]:
        async with fault_server([reply(GOOD)], health=reply(document)) as (url, seen):
            async with RemoteGenerateClient(url, retry=FAST) as client:
                try:
                    result: object = await client.generate(
                        prompt_token_ids=[1, 2, 3],
                        sampling_params=PARAMS,
                        return_routed_experts=True,
                    )
                except Exception as exc:
                    result = exc
            return result, len(seen)

    return asyncio.run(main())


def test_health_and_weight_replies_have_a_small_fixed_cap() -> None:
    import torch

    big = {"status": "ok", "pad": "x" * SMALL_REPLY_BYTES}

    async def main() -> tuple[Exception, Exception, int]:
        async with fault_server(
            [reply({"num_loaded": 1, "pad": "x" * SMALL_REPLY_BYTES})], health=reply(big)
        ) as (url, seen):
            async with RemoteGenerateClient(url, retry=FAST, max_reply_bytes=1 << 30) as client:
                with pytest.raises(ReplyTooLarge) as health_error:
                    await client.health()
                with pytest.raises(ReplyTooLarge) as weights_error:
                    await client.update_weights({"w": torch.zeros(2)})
            return health_error.value, weights_error.value, len(seen)

    health_error, weights_error, attempts = asyncio.run(main())
    assert health_error.cap == weights_error.cap == SMALL_REPLY_BYTES
    assert attempts == 1  # the weight update was not retried


def test_reply_cap_options_are_checked() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_reply_bytes: expected None or an int >= 1"):
            RemoteGenerateClient("http://127.0.0.1:1", max_reply_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="route_shape: expected a RouteShape or None, got tuple"):
        RemoteGenerateClient("http://127.0.0.1:1", route_shape=(4, 2, 8))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="RouteShape.top_k: expected an int >= 1, got 0"):
        RouteShape(num_layers=4, top_k=0, num_experts=8)
    assert issubclass(ReplyTooLarge, GenerateProtocolError) and issubclass(
        ReplyTooLarge, ValueError
    )
