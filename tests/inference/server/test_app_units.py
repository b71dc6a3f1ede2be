"""One layer at a time: the reply renderer and the app's overload/failure paths, with
a small fake engine (the real engine's behaviour is covered end to end elsewhere)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence

import numpy as np
import orjson
import pytest

from inference.client import RemoteGenerateClient, RetryPolicy
from inference.engine.base import EngineInfo, EngineOutput, EngineRequest, InferenceEngine
from inference.errors import GenerateHTTPError
from inference.server import ServerConfig, start_server
from inference.server.render import render_generate_reply
from inference.wire import load_packed_body


class FakeEngine:
    """Echo engine: answers [7, 8, 9] with scripted logprobs; can hold or fail requests."""

    def __init__(self, logprobs: list[float] | None = None) -> None:
        self.logprobs = logprobs if logprobs is not None else [-0.5, -1.0, -1.5]
        self.release = asyncio.Event()
        self.release.set()
        self.fail = False
        self.closed = False
        self.policy_version = 0

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            "fake", num_layers=2, num_experts=4, top_k=2, vocab_size=32, dtype="float32"
        )

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineOutput]:
        await self.release.wait()
        if self.fail:
            raise RuntimeError("kernel exploded")
        return [
            EngineOutput([7, 8, 9], "length", list(self.logprobs), self.policy_version)
            for _ in requests
        ]

    def load_weights(self, named_tensors: Iterable, *, policy_version: int | None = None) -> int:
        count = len(list(named_tensors))
        if policy_version is not None:
            self.policy_version = policy_version
        return count

    async def close(self) -> None:
        self.closed = True


def test_fake_engine_satisfies_the_protocol() -> None:
    assert isinstance(FakeEngine(), InferenceEngine)


def test_render_clamps_missing_and_non_finite_logprobs_and_counts_them() -> None:
    output = EngineOutput(
        [1, 2, 3, 4], "stop", [float("nan"), -1.0, float("-inf")], 0
    )  # one missing
    body, clamped = render_generate_reply(
        output, EngineRequest([5]), model="m", side_channels=False
    )
    reply = orjson.loads(body)
    assert clamped == 3 and reply["num_clamped_logprobs"] == 3
    values = [c["logprob"] for c in reply["choices"][0]["logprobs"]["content"]]
    assert values == [-9999.0, -1.0, -9999.0, -9999.0]
    assert "routed_experts" not in reply["choices"][0]


def test_render_side_channels_are_envelopes_or_null() -> None:
    routes = np.array([[[0, 1]], [[2, 3]]], dtype=np.int64)  # engine may hand any int dtype
    output = EngineOutput([1, 2], "length", [-1.0, -2.0], 0, routed_experts=routes)
    request = EngineRequest([5, 6], return_routed_experts=True)
    body, _ = render_generate_reply(output, request, model="m", side_channels=True)
    (choice,) = load_packed_body(body)["choices"]
    assert choice["routed_experts"]["dtype"] == "uint8"  # canonical on the wire
    assert choice["rollout_sample_support"] is None
    assert choice["rollout_sample_support_logprobs"] is None


def test_render_refuses_an_engine_that_dropped_requested_routes() -> None:
    output = EngineOutput([1], "length", [-1.0], 0)
    with pytest.raises(RuntimeError, match="expected routed_experts"):
        render_generate_reply(
            output, EngineRequest([5], return_routed_experts=True), model="m", side_channels=True
        )


def test_clamped_logprobs_reach_the_client_and_health() -> None:
    async def main():
        server = await start_server(FakeEngine([math.nan, -1.0, math.inf]), ServerConfig())
        try:
            async with RemoteGenerateClient(server.url) as client:
                result = await client.generate(prompt_token_ids=[1], sampling_params={})
                return result, await client.health()
        finally:
            await server.stop()

    result, health = asyncio.run(main())
    assert result.logprobs == [-9999.0, -1.0, -9999.0] and result.num_clamped_logprobs == 2
    assert health["counters"]["clamped_logprobs"] == 2


def test_overload_answers_503_retry_after_and_the_client_retries_through_it() -> None:
    engine = FakeEngine()
    engine.release.clear()
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, deadline_s=20.0)

    async def main():
        server = await start_server(engine, ServerConfig(max_pending_requests=1, retry_after_s=1))
        try:
            async with RemoteGenerateClient(server.url, retry=policy) as client:
                first = asyncio.ensure_future(
                    client.generate(prompt_token_ids=[1], sampling_params={})
                )
                while (await client.health())["counters"]["in_flight"] < 1:
                    await asyncio.sleep(0.01)
                second = asyncio.ensure_future(
                    client.generate(prompt_token_ids=[2], sampling_params={})
                )
                while (await client.health())["counters"]["failed"] < 1:
                    await asyncio.sleep(0.01)  # the second was refused at least once
                engine.release.set()
                return await first, await second, await client.health()
        finally:
            await server.stop()

    first, second, health = asyncio.run(main())
    assert first.response_ids == second.response_ids == [7, 8, 9]
    assert health["counters"]["failed"] >= 1 and health["counters"]["in_flight"] == 0
    assert engine.closed  # server shutdown closes the engine


def test_engine_failure_is_a_500_json_error_not_retried_and_server_survives() -> None:
    engine = FakeEngine()

    async def main():
        server = await start_server(engine, ServerConfig())
        try:
            async with RemoteGenerateClient(server.url) as client:
                engine.fail = True
                with pytest.raises(GenerateHTTPError) as info:
                    await client.generate(prompt_token_ids=[1], sampling_params={})
                engine.fail = False
                ok = await client.generate(prompt_token_ids=[1], sampling_params={})
                return info.value, ok, await client.health()
        finally:
            await server.stop()

    error, ok, health = asyncio.run(main())
    assert error.status == 500 and error.error_type == "InternalServerError"
    assert "kernel exploded" in error.message
    assert ok.finish_reason == "length" and health["counters"]["failed"] == 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_request_bytes": 0}, "max_request_bytes"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"port": 70000}, "port"),
        ({"default_sample_support_k": 65}, "default_sample_support_k"),
        ({"api_key": ""}, "api_key"),
    ],
)
def test_bad_server_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"ServerConfig.{field}: expected"):
        ServerConfig(**kwargs)
