"""The client reads a reply's top-level ``policy_version``: an int >= 0, None when the
reply has none (a server from before versions), a protocol error naming
``$.policy_version`` otherwise; lean and packed replies alike."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from inference.client import RemoteGenerateClient
from inference.client.client import _parse_generate_reply
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import GenerateProtocolError, InferenceError
from inference.server import ServerConfig, start_server
from inference.wire import dumps_generate_response

MISSING = object()


def reply(version: Any, *, packed: bool) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if packed:
        choice.update(
            token_ids=None,
            logprobs=None,
            packed_token_ids=np.array([1, 2], dtype=np.int32),
            packed_logprobs=np.array([-0.5, -1.0], dtype=np.float32),
        )
    else:
        choice.update(token_ids=[1, 2], logprobs={"content": [{"logprob": -0.5}, {"logprob": -1}]})
    extra: dict[str, Any] = {"model": "m", "num_clamped_logprobs": 0}
    if version is not MISSING:
        extra["policy_version"] = version
    return dumps_generate_response([choice], extra=extra)


def parse(raw: bytes, *, packed: bool) -> Any:
    return _parse_generate_reply(
        raw,
        packed=packed,
        want_routes=False,
        want_support=False,
        packed_body=packed,
        prompt_route_rows=None,
    )


@pytest.mark.parametrize("packed", [False, True], ids=["lean", "packed"])
def test_policy_version_is_parsed_or_none_when_absent(packed: bool) -> None:
    assert parse(reply(0, packed=packed), packed=packed).policy_version == 0
    assert parse(reply(12, packed=packed), packed=packed).policy_version == 12
    result = parse(reply(MISSING, packed=packed), packed=packed)
    assert result.policy_version is None and result.response_ids == [1, 2]


@pytest.mark.parametrize("packed", [False, True], ids=["lean", "packed"])
@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None, [1]])
def test_a_malformed_policy_version_is_a_protocol_error_naming_it(packed: bool, bad: Any) -> None:
    with pytest.raises(GenerateProtocolError) as info:
        parse(reply(bad, packed=packed), packed=packed)
    assert info.value.path == "$.policy_version"
    assert str(info.value).startswith("$.policy_version: expected an int >= 0, got ")
    assert isinstance(info.value, ValueError) and isinstance(info.value, InferenceError)


def test_the_client_reads_the_servers_version_and_pushes_one() -> None:
    async def main():
        engine = HFMoEEngine.from_config(seed=0, dtype="float32")
        server = await start_server(engine, ServerConfig())
        try:
            async with RemoteGenerateClient(server.url) as client:
                params = {"max_tokens": 3, "temperature": 0}
                before = await client.generate(prompt_token_ids=[5, 6], sampling_params=params)
                norm = {"model.norm.weight": torch.full((64,), 0.5)}
                staged = await client.update_weights(norm, policy_version=2, commit=False)
                between = await client.generate(prompt_token_ids=[5, 6], sampling_params=params)
                loaded = await client.update_weights(norm, policy_version=2)
                after = await client.generate(
                    prompt_token_ids=[5, 6], sampling_params=params, return_routed_experts=True
                )
                with pytest.raises(ValueError, match="policy_version: expected None or an int"):
                    await client.update_weights(norm, policy_version=-1)
                return before, staged, between, loaded, after, await client.health()
        finally:
            await server.stop()

    before, staged, between, loaded, after, health = asyncio.run(main())
    assert before.policy_version == 0 and between.policy_version == 0
    assert (staged, loaded) == (0, 1)
    assert after.policy_version == 2 and after.routed_experts is not None
    assert health["policy_version"] == 2
