"""The HTTP request and the engine refuse a temperature with the same words."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from inference.engine.base import EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import RequestValidationError

GEN = "/skyrl/v1/generate"


@pytest.fixture(scope="module")
def engine():
    engine = HFMoEEngine.from_config(seed=0, dtype="float32", num_threads=None)
    yield engine
    asyncio.run(engine.close())


def http_reply(live_server, temperature: object) -> tuple[int, dict]:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "temperature": temperature}}

    async def main():
        headers = {"Authorization": f"Bearer {live_server.api_key}"}
        async with aiohttp.ClientSession() as session:
            async with session.post(live_server.url + GEN, json=body, headers=headers) as r:
                return r.status, orjson.loads(await r.read())

    return asyncio.run(main())


@pytest.mark.parametrize("temperature", [1e-39, 1e-30, 1e4, 1e308, -0.5, -1, 100.5])
def test_http_and_engine_say_the_same(live_server, engine, temperature: float) -> None:
    status, reply = http_reply(live_server, temperature)
    assert status == 400 and reply["error"]["field"] == "$.sampling_params.temperature"
    with pytest.raises(RequestValidationError) as info:
        engine.generate_sync([EngineRequest([1, 2], SamplingParams(temperature=temperature))])
    http_words = reply["error"]["message"].removeprefix("$.sampling_params.temperature: ")
    engine_words = str(info.value).removeprefix("requests[0].sampling.temperature: ")
    assert http_words == engine_words
    assert http_words.startswith("expected 0 (greedy) or a number in [1e-06, 100], got ")


@pytest.mark.parametrize("temperature", [0, 1e-6, 100, 100.0])
def test_the_limits_are_served(live_server, temperature: float) -> None:
    status, reply = http_reply(live_server, temperature)
    assert status == 200, reply
