"""``VLLMClient``'s retry taxonomy against a fake vLLM server on loopback: transport
faults (a dropped connection, an HTML 502, a cut body, routes included) are retried;
a JSON error status and an oversized reply are raised once."""

from __future__ import annotations

from typing import Any

import pytest

from inference.errors import GenerateHTTPError
from inference.wire.npy import encode_npy
from tests.inference.vllm_engine._vllm_client_helpers import (
    GEN,
    GOOD_ROUTES,
    SHAPE,
    routes_choice,
    run,
    serving,
)
from tests.inference.vllm_engine.fake_vllm import (
    FakeVLLM,
    choice_json,
    drop_connection,
    error_json,
    html_502,
    reply_json,
)


async def _cut_body(request: Any) -> Any:
    from aiohttp import web

    raw = reply_json(choice_json(token_ids=[1], finish_reason="stop", logprobs=[(1, -1.0, 1)]))
    return web.Response(body=raw[: len(raw) // 2], content_type="application/json")


@pytest.mark.parametrize("fault", [drop_connection, html_502, _cut_body], ids=lambda f: f.__name__)
def test_transport_faults_are_retried(fault: Any) -> None:
    async def main() -> tuple[FakeVLLM, Any]:
        async with serving(faults={GEN: [fault, fault, None]}) as (fake, vllm):
            return fake, await vllm.generate(
                prompt_token_ids=[1], sampling_params={"max_tokens": 2}
            )

    fake, result = run(main())
    assert fake.count(GEN) == 3 and result.response_ids == [2, 3]


def test_cut_body_with_routes_is_retried_not_a_protocol_error() -> None:
    async def cut(request: Any) -> Any:
        from aiohttp import web

        raw = reply_json(routes_choice(encode_npy(GOOD_ROUTES)))
        return web.Response(
            body=raw[: raw.index(b'"routed_experts"') + 30], content_type="application/json"
        )

    async def main() -> FakeVLLM:
        async with serving(
            faults={GEN: [cut, None]}, routes=(3, 2, "uint8"), client={"route_shape": SHAPE}
        ) as (
            fake,
            vllm,
        ):
            result = await vllm.generate(
                prompt_token_ids=[1, 2, 3],
                sampling_params={"max_tokens": 2},
                return_routed_experts=True,
            )
            assert result.routed_experts is not None and result.routed_experts.shape == (4, 3, 2)
            return fake

    assert run(main()).count(GEN) == 2


def test_a_json_error_status_raises_the_servers_message_once() -> None:
    async def bad(request: Any) -> Any:
        return error_json("max_tokens must be at least 1, got 0.")

    async def main() -> FakeVLLM:
        async with serving(faults={GEN: [bad]}) as (fake, vllm):
            with pytest.raises(GenerateHTTPError) as info:
                await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 2})
            assert info.value.status == 400 and info.value.error_type == "BadRequestError"
            assert info.value.message == "max_tokens must be at least 1, got 0."
            return fake

    assert run(main()).count(GEN) == 1


def test_an_oversized_reply_is_refused_once() -> None:
    from inference.client.limits import ReplyTooLarge

    huge = reply_json(
        choice_json(token_ids=[1], finish_reason="stop", logprobs=[(1, -1.0, 1)])
    ) + b" " * (3 << 20)

    async def main() -> FakeVLLM:
        async with serving(reply_override=lambda body: huge) as (fake, vllm):
            with pytest.raises(ReplyTooLarge):
                await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 4})
            return fake

    assert run(main()).count(GEN) == 1
