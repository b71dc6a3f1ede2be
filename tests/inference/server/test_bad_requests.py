"""Every bad request class gets its 4xx JSON error naming the field, and the server
keeps serving: each case is followed by a good request on the same server."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

PROMPT = [1, 2, 3, 4]
GOOD = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 0.0}}
GEN = "/skyrl/v1/generate"
PLAIN = "/inference/v1/generate"


def body_with(**changes: Any) -> dict[str, Any]:
    body = {"token_ids": PROMPT, "sampling_params": dict(GOOD["sampling_params"])}
    for key, value in changes.items():
        if key.startswith("sp_"):
            body["sampling_params"][key[3:]] = value
        else:
            body[key] = value
    return body


# (id, path, JSON body or raw bytes, expected status, text the message must contain)
CASES: list[tuple[str, str, Any, int, str]] = [
    ("not-json", GEN, b'{"token_ids": [1,', 400, "body: expected a JSON document"),
    ("not-object", GEN, [1, 2], 400, "$: expected a JSON object"),
    ("missing-token-ids", GEN, {"sampling_params": {}}, 400, "$.token_ids: expected a list"),
    ("empty-prompt", GEN, body_with(token_ids=[]), 400, "$.token_ids: expected at least 1"),
    (
        "id-out-of-vocab",
        GEN,
        body_with(token_ids=[1, 264]),
        400,
        "$.token_ids[1]: expected an int in [0, 264)",
    ),
    ("id-negative", GEN, body_with(token_ids=[-1]), 400, "$.token_ids[0]"),
    ("id-float", GEN, body_with(token_ids=[1.5]), 400, "$.token_ids[0]"),
    ("id-bool", GEN, body_with(token_ids=[True]), 400, "$.token_ids[0]"),
    (
        "prompt-too-long",
        GEN,
        body_with(token_ids=[1] * 2048),
        400,
        "$.token_ids: expected at most 2047",
    ),
    ("unknown-key", GEN, body_with(max_token=5), 400, "$.max_token: expected one of the keys"),
    (
        "sampling-not-object",
        GEN,
        {"token_ids": PROMPT, "sampling_params": [1]},
        400,
        "$.sampling_params: expected a JSON object",
    ),
    ("unknown-sampling-key", GEN, body_with(sp_max_token=5), 400, "$.sampling_params.max_token"),
    (
        "max-tokens-zero",
        GEN,
        body_with(sp_max_tokens=0),
        400,
        "$.sampling_params.max_tokens: expected an int in [1, 32]",
    ),
    (
        "max-tokens-over-limit",
        GEN,
        body_with(sp_max_tokens=33),
        400,
        "$.sampling_params.max_tokens",
    ),
    ("max-tokens-string", GEN, body_with(sp_max_tokens="8"), 400, "$.sampling_params.max_tokens"),
    (
        "temperature-negative",
        GEN,
        body_with(sp_temperature=-0.5),
        400,
        "$.sampling_params.temperature",
    ),
    (
        "temperature-string",
        GEN,
        body_with(sp_temperature="hot"),
        400,
        "$.sampling_params.temperature: expected 0 (greedy) or a number in [1e-06, 100]",
    ),
    (
        "top-p-zero",
        GEN,
        body_with(sp_top_p=0.0),
        400,
        "$.sampling_params.top_p: expected a number in (0, 1]",
    ),
    ("top-p-above-one", GEN, body_with(sp_top_p=1.5), 400, "$.sampling_params.top_p"),
    (
        "top-k-zero",
        GEN,
        body_with(sp_top_k=0),
        400,
        "$.sampling_params.top_k: expected -1 (no cut) or an int >= 1, got 0",
    ),
    ("seed-negative", GEN, body_with(sp_seed=-3), 400, "$.sampling_params.seed"),
    (
        "stop-id-out-of-vocab",
        GEN,
        body_with(sp_stop_token_ids=[999]),
        400,
        "$.sampling_params.stop_token_ids[0]",
    ),
    (
        "prompt-start-past-prompt-without-routes",
        GEN,
        body_with(sp_routed_experts_prompt_start=9),
        400,
        "$.sampling_params.routed_experts_prompt_start: expected an int in [0, 4]",
    ),
    (
        "prompt-start-past-prompt",
        GEN,
        body_with(return_routed_experts=True, sp_routed_experts_prompt_start=5),
        400,
        "$.sampling_params.routed_experts_prompt_start: expected an int in [0, 4]",
    ),
    (
        "routes-flag-not-bool",
        GEN,
        body_with(return_routed_experts="yes"),
        400,
        "$.return_routed_experts: expected true or false",
    ),
    (
        "support-k-too-big",
        GEN,
        body_with(return_sample_support=1000),
        400,
        "$.return_sample_support",
    ),
    (
        "support-k-negative",
        GEN,
        body_with(return_sample_support=-1),
        400,
        "$.return_sample_support",
    ),
    ("wrong-model", GEN, body_with(model="gpt-9"), 400, "$.model: expected null or 'tiny-moe'"),
    ("session-id-int", GEN, body_with(session_id=5), 400, "$.session_id"),
    (
        "side-channel-on-plain",
        PLAIN,
        body_with(return_routed_experts=True),
        400,
        "$.return_routed_experts: expected false or absent (side channels are served on",
    ),
    (
        "too-large",
        GEN,
        b'{"token_ids": [' + b"1," * 40000 + b"1]}",
        413,
        "body: expected at most 65536 bytes",
    ),
    ("unknown-route", "/skyrl/v1/generatez", GOOD, 404, "Not Found"),
    (
        "weights-not-safetensors",
        "/skyrl/v1/update_weights",
        b"\x00garbage",
        400,
        "body.header_length: expected an int in [2, ",
    ),
]


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, *, headers: dict[str, str]
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    weights = url.endswith("/update_weights")
    content_type = "application/octet-stream" if weights else "application/json"
    headers = {"Content-Type": content_type, **headers}
    async with session.post(url, data=data, headers=headers) as response:
        raw = await response.read()
        assert response.content_type == "application/json"
        return response.status, orjson.loads(raw)


def auth(live_server) -> dict[str, str]:
    return {"Authorization": f"Bearer {live_server.api_key}"}


def exchange(live_server, path: str, body: Any, headers: dict[str, str], method: str = "POST"):
    """The bad request's (status, error), then the status of a good request after it."""

    async def main():
        async with aiohttp.ClientSession() as session:
            if method == "POST":
                status, reply = await post(session, live_server.url + path, body, headers=headers)
            else:
                async with session.request(method, live_server.url + path, headers=headers) as r:
                    status, reply = r.status, orjson.loads(await r.read())
            good, _ = await post(session, live_server.url + GEN, GOOD, headers=auth(live_server))
            return status, reply, good

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "body", "status", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_request_gets_4xx_naming_the_field_and_server_keeps_serving(
    live_server, path: str, body: Any, status: int, text: str
) -> None:
    got_status, reply, good = exchange(live_server, path, body, auth(live_server))
    assert got_status == status
    assert set(reply) == {"error"}
    error = reply["error"]
    assert isinstance(error["type"], str) and error["type"]
    assert text in error["message"], error["message"]
    if status == 400 and error["type"] == "RequestValidationError":
        assert error["message"].startswith(error["field"] + ": expected")
    assert good == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (PLAIN, body_with(return_routed_experts=False, return_sample_support=0)),
        (GEN, body_with(sp_routed_experts_prompt_start=2)),  # a start without routes: unused
    ],
    ids=["side-channels-off-on-plain", "prompt-start-without-routes"],
)
def test_side_channel_settings_that_ask_for_nothing_are_accepted(
    live_server, path: str, body: Any
) -> None:
    status, reply, good = exchange(live_server, path, body, auth(live_server))
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["token_ids"] and choice.get("routed_experts") is None
    assert good == 200


@pytest.mark.parametrize(
    ("headers", "case"),
    [
        ({}, "missing"),
        ({"Authorization": "Bearer wrong"}, "wrong"),
        ({"Authorization": "test-token"}, "no-scheme"),
    ],
)
def test_bearer_token_is_required(live_server, headers: dict[str, str], case: str) -> None:
    status, reply, good = exchange(live_server, GEN, GOOD, headers)
    assert status == 401 and "Authorization: expected" in reply["error"]["message"]
    assert good == 200


def test_wrong_method_is_a_json_405(live_server) -> None:
    status, reply, good = exchange(live_server, GEN, None, auth(live_server), method="GET")
    assert status == 405 and reply["error"]["type"] == "HTTPMethodNotAllowed"
    assert good == 200


def test_health_needs_no_token_and_counts_rejections(live_server) -> None:
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.get(live_server.url + "/health") as r:
                first = orjson.loads(await r.read())
            await post(
                session, live_server.url + GEN, body_with(token_ids=[]), headers=auth(live_server)
            )
            async with session.get(live_server.url + "/health") as r:
                return r.status, first, orjson.loads(await r.read())

    status, first, second = asyncio.run(main())
    assert status == 200 and second["status"] == "ok"
    assert second["engine"]["num_experts"] == 8 and second["engine"]["vocab_size"] == 264
    assert second["counters"]["rejected"] == first["counters"]["rejected"] + 1
