"""Generate end to end over HTTP on loopback: real server, real CPU engine, tiny MoE."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import numpy as np
import orjson
import pytest
import torch

import inference.client.side_channels as side_channels
from inference.client import GenerateRequest, RemoteGenerateClient
from inference.errors import GenerateHTTPError
from inference.models.tiny_moe import TinyMoEConfig, build_hf_model
from inference.wire import route_dtype_for

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"
GREEDY = {"max_tokens": 6, "temperature": 0.0}


def with_client(live_server, body):
    async def main():
        async with RemoteGenerateClient(live_server.url, api_key=live_server.api_key) as client:
            return await body(client)

    return asyncio.run(main())


def test_route_rows_dtype_and_prompt_start_through_http(live_server) -> None:
    config = TinyMoEConfig()

    async def body(client: RemoteGenerateClient):
        return [
            await client.generate(
                prompt_token_ids=PROMPT,
                sampling_params=GREEDY,
                return_routed_experts=True,
                routed_experts_prompt_start=start,
            )
            for start in (None, 0, 5, len(PROMPT))
        ]

    full, zero, five, tail = with_client(live_server, body)
    g = len(full.response_ids)
    assert 1 <= g <= GREEDY["max_tokens"]
    for start, result in [(0, full), (0, zero), (5, five), (len(PROMPT), tail)]:
        routes = result.routed_experts
        assert routes is not None and result.response_ids == full.response_ids
        # P - s + G - 1 rows: the last sampled token was never fed.
        assert routes.shape == (
            len(PROMPT) - start + g - 1,
            config.num_layers,
            config.num_experts_per_tok,
        )
        assert routes.dtype == route_dtype_for(int(routes.max())) == np.uint8
        assert int(routes.max()) < config.num_experts
        assert all(
            len(set(row)) == config.num_experts_per_tok
            for row in routes.reshape(-1, config.num_experts_per_tok).tolist()
        )
        # The start is honoured: the rows are exactly the tail of the full prefix's rows.
        np.testing.assert_array_equal(routes, full.routed_experts[start:])
        assert result.sample_support_ids is None and result.sample_support_logprobs is None


def test_routes_and_sample_support_decode_together(live_server) -> None:
    k = 4
    params = {"max_tokens": 8, "temperature": 1.0, "top_k": k, "seed": 7}

    async def body(client: RemoteGenerateClient):
        return await client.generate(
            prompt_token_ids=PROMPT,
            sampling_params=params,
            return_routed_experts=True,
            routed_experts_prompt_start=3,
            return_sample_support=k,
        )

    result = with_client(live_server, body)
    g = len(result.response_ids)
    assert result.routed_experts.shape[0] == len(PROMPT) - 3 + g - 1
    ids, logprobs = result.sample_support_ids, result.sample_support_logprobs
    assert ids.shape == logprobs.shape == (g, k)
    assert ids.dtype == np.int32 and logprobs.dtype == np.float32
    # Top-k sampling with k = support size: every sampled token is in its step's support,
    # and its support logprob is the reported sampled logprob.
    for t, token in enumerate(result.response_ids):
        assert token in ids[t].tolist()
        j = ids[t].tolist().index(token)
        assert logprobs[t, j] == pytest.approx(result.logprobs[t], abs=1e-3)
    assert result.num_clamped_logprobs == 0


def test_fully_packed_body_carries_the_same_tokens_logprobs_and_routes(live_server) -> None:
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 11}

    async def body(client: RemoteGenerateClient):
        plain = await client.generate(
            prompt_token_ids=PROMPT, sampling_params=sampling, return_routed_experts=True
        )
        packed = await client.generate(
            prompt_token_ids=PROMPT,
            sampling_params=sampling,
            return_routed_experts=True,
            return_packed_body=True,
        )
        return plain, packed

    plain, packed = with_client(live_server, body)
    assert packed.response_ids == plain.response_ids and packed.response_ids
    assert packed.finish_reason == plain.finish_reason
    # float32 on the wire: equal to the JSON float after rounding to float32.
    np.testing.assert_array_equal(
        np.float32(packed.logprobs), np.asarray(plain.logprobs, dtype=np.float32)
    )
    np.testing.assert_array_equal(packed.routed_experts, plain.routed_experts)

    async def raw_reply(session: aiohttp.ClientSession):
        headers = {"Authorization": f"Bearer {live_server.api_key}"} if live_server.api_key else {}
        request = {"token_ids": PROMPT, "sampling_params": sampling, "return_packed_body": True}
        async with session.post(
            live_server.url + "/skyrl/v1/generate", json=request, headers=headers
        ) as reply:
            return reply.status, orjson.loads(await reply.read())

    async def main():
        async with aiohttp.ClientSession() as session:
            return await raw_reply(session)

    status, reply = asyncio.run(main())
    choice = reply["choices"][0]
    assert status == 200 and choice["token_ids"] is None and choice["logprobs"] is None
    assert list(choice["packed_token_ids"])[:3] == ["data", "shape", "dtype"]
    assert choice["packed_token_ids"]["dtype"] == "int32"
    assert choice["packed_logprobs"]["dtype"] == "float32"


def test_sample_support_true_uses_the_servers_default_k(live_server) -> None:
    async def body(client: RemoteGenerateClient):
        return await client.generate(
            prompt_token_ids=PROMPT, sampling_params=GREEDY, return_sample_support=True
        )

    result = with_client(live_server, body)
    assert result.routed_experts is None
    assert result.sample_support_ids.shape == (
        len(result.response_ids),
        live_server.config.default_sample_support_k,
    )


def test_plain_generation_never_calls_the_splice(live_server, monkeypatch) -> None:
    calls: list[int] = []

    def forbidden(raw, **_):
        calls.append(len(raw))
        raise AssertionError("load_packed_body must not run for plain generation")

    monkeypatch.setattr(side_channels, "load_packed_body", forbidden)

    async def body(client: RemoteGenerateClient):
        plain = await client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY)
        with pytest.raises(AssertionError, match="must not run"):
            await client.generate(
                prompt_token_ids=PROMPT, sampling_params=GREEDY, return_routed_experts=True
            )
        return plain

    plain = with_client(live_server, body)
    assert len(calls) == 1  # only the side-channel request reached the (patched) splice
    assert plain.routed_experts is None and len(plain.logprobs) == len(plain.response_ids)
    assert all(math.isfinite(x) and x <= 0 for x in plain.logprobs)
    assert plain.finish_reason in ("stop", "length")


def test_plain_endpoint_has_no_side_channel_keys(live_server) -> None:
    async def main():
        headers = {"Authorization": f"Bearer {live_server.api_key}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            request = {"token_ids": PROMPT, "sampling_params": GREEDY}
            async with session.post(f"{live_server.url}/inference/v1/generate", json=request) as r:
                return r.status, orjson.loads(await r.read())

    status, reply = asyncio.run(main())
    assert status == 200
    (choice,) = reply["choices"]
    assert set(choice) == {"index", "token_ids", "finish_reason", "logprobs"}
    assert reply["model"] == "tiny-moe" and reply["num_clamped_logprobs"] == 0


def test_64_concurrent_requests_through_the_batch_helper(live_server) -> None:
    requests = [
        GenerateRequest(
            prompt_token_ids=PROMPT[: 4 + i % 8],
            sampling_params={"max_tokens": 4, "temperature": 1.0, "seed": i},
            return_routed_experts=i % 2 == 0,
        )
        for i in range(64)
    ]

    async def body(client: RemoteGenerateClient):
        results = await client.generate_batch(requests, max_concurrency=64)
        return results, await client.health()

    results, health = with_client(live_server, body)
    assert len(results) == 64
    for request, result in zip(requests, results, strict=True):
        assert 1 <= len(result.response_ids) <= 4
        if request.return_routed_experts:
            expected = len(request.prompt_token_ids) + len(result.response_ids) - 1
            assert result.routed_experts.shape[0] == expected
        else:
            assert result.routed_experts is None
    assert health["counters"]["in_flight"] == 0 and health["counters"]["failed"] == 0


def test_seeded_generation_is_reproducible_over_http(live_server) -> None:
    params = {"max_tokens": 6, "temperature": 1.0, "seed": 1234}

    async def body(client: RemoteGenerateClient):
        return [
            await client.generate(prompt_token_ids=PROMPT, sampling_params=params) for _ in range(2)
        ]

    first, second = with_client(live_server, body)
    assert first.response_ids == second.response_ids


def test_weight_update_changes_the_served_model_then_restores(live_server) -> None:
    original = build_hf_model(TinyMoEConfig(), seed=live_server.spec.seed, dtype=torch.bfloat16)
    lm_head = original.state_dict()["lm_head.weight"]

    async def body(client: RemoteGenerateClient):
        loaded = await client.update_weights({"lm_head.weight": torch.zeros_like(lm_head)})
        flat = await client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY)
        with pytest.raises(GenerateHTTPError) as info:
            await client.update_weights({"lm_head.weightz": lm_head})
        restored = await client.update_weights({"lm_head.weight": lm_head})
        again = await client.generate(prompt_token_ids=PROMPT, sampling_params=GREEDY)
        return loaded, flat, info.value, restored, again

    loaded, flat, bad, restored, again = with_client(live_server, body)
    assert loaded == restored == 1
    # A zero head gives uniform logits: every logprob is -log(vocab).
    assert flat.logprobs == pytest.approx([-math.log(264)] * len(flat.logprobs), abs=1e-3)
    assert bad.status == 400 and bad.error_type == "RequestValidationError"
    assert "lm_head.weightz" in bad.message
    assert not all(x == pytest.approx(-math.log(264), abs=1e-3) for x in again.logprobs)
