"""``VLLMClient``'s generate against a fake vLLM server on loopback (``fake_vllm``):
the fake's replies are vLLM's own rendering, and each request and reply maps one to
one (options, sampling parameters, logprobs mode, batch order, what vLLM cannot give
refused before sending). The server counts every request, so each test asserts exactly
what was sent and how often."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inference.client import (
    GenerateClient,
    RemoteGenerateClient,
    VersionSpan,
)
from inference.engine.base import SamplingParams
from inference.errors import RequestValidationError
from inference.vllm.client import VLLMClient
from inference.vllm.spec import VLLM_LOGPROBS_MODE, VLLMServerSpec, vllm_command
from inference.wire.npy import encode_npy
from tests.inference.vllm_engine._vllm_client_helpers import (
    run,
    serving,
)
from tests.inference.vllm_engine.fake_vllm import (
    FakeVLLM,
    choice_json,
    reply_json,
)
from tests.vllm_reference import REPLIES, SKIP_REASON, route_array, vllm_reference

# ---- the fake's format is vLLM's ------------------------------------------------------


def test_fake_replies_match_vllms_own_rendering() -> None:
    ref = vllm_reference()
    if ref is None:
        pytest.skip(SKIP_REASON)
    for name, (ids, finish, logprobs, routes, spans) in REPLIES.items():
        choice = choice_json(
            token_ids=ids,
            finish_reason=finish,
            logprobs=logprobs,
            routed_experts=None if routes is None else encode_npy(route_array(routes)),
            weight_versions=spans,
        )
        assert reply_json(choice).decode() == ref["bodies"][name], name


def test_both_clients_satisfy_the_protocol() -> None:
    assert isinstance(VLLMClient("http://127.0.0.1:1"), GenerateClient)
    assert isinstance(RemoteGenerateClient("http://127.0.0.1:1"), GenerateClient)
    assert VLLMClient.supports_packed_body is False and RemoteGenerateClient.supports_packed_body
    # vLLM's mode is its server's --logprobs-mode, the one the launcher passes.
    assert VLLMClient.supported_logprobs_modes == (VLLM_LOGPROBS_MODE,)
    argv = vllm_command(VLLMServerSpec(checkpoint="/ckpt"), python="python", port=1)
    assert argv[argv.index("--logprobs-mode") + 1] == VLLM_LOGPROBS_MODE


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"weight_timeout_s": 0}, ValueError, "weight_timeout_s: expected a finite number > 0"),
        ({"weight_timeout_s": float("inf")}, ValueError, "weight_timeout_s: expected a finite"),
        ({"max_reply_bytes": 0}, ValueError, "max_reply_bytes: expected None or an int >= 1"),
        ({"route_shape": (3, 2, 8)}, TypeError, "route_shape: expected a RouteShape or None"),
        ({"retry": 3}, TypeError, "retry: expected a RetryPolicy or a mapping"),
    ],
)
def test_bad_options_are_refused(kwargs: dict, error: type, text: str) -> None:
    with pytest.raises(error, match=text):
        VLLMClient("http://127.0.0.1:1", **kwargs)
    with pytest.raises(ValueError, match="base_url: expected an http"):
        VLLMClient("127.0.0.1:8000")


# ---- generate: request and reply mapping ----------------------------------------------


def test_greedy_request_and_reply() -> None:
    async def main() -> tuple[FakeVLLM, Any]:
        async with serving(client={"model": "m"}) as (fake, vllm):
            result = await vllm.generate(
                prompt_token_ids=np.array([3, 4, 5]),
                sampling_params={"max_tokens": 4, "temperature": 0.0},
            )
            return fake, result

    fake, result = run(main())
    assert fake.hits[0].body == {
        "token_ids": [3, 4, 5],
        "sampling_params": {
            "max_tokens": 4,
            "temperature": 0.0,
            "logprobs": 0,
            "detokenize": False,
        },
        "model": "m",
    }
    assert result.response_ids == [13, 14, 15, 16] and result.finish_reason == "length"
    assert result.logprobs == [-0.25, -0.5, -0.75, -0.25] and result.num_clamped_logprobs == 0
    assert result.policy_version == 0  # "default": the checkpoint the server started from
    assert result.policy_version_spans == [VersionSpan(0, 0, 4)]
    assert result.policy_versions == (0,) and result.routed_experts is None


def test_sampled_params_map_one_to_one() -> None:
    params = SamplingParams(
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=11,
        stop_token_ids=(99,),
        ignore_eos=True,
    )

    async def main() -> tuple[FakeVLLM, Any]:
        async with serving() as (fake, vllm):
            result = await vllm.generate(
                prompt_token_ids=[1, 2], sampling_params=params, routed_experts_prompt_start=1
            )
            return fake, result

    fake, result = run(main())
    assert fake.hits[0].body["sampling_params"] == {
        "max_tokens": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "seed": 11,
        "stop_token_ids": [99],
        "ignore_eos": True,
        "routed_experts_prompt_start": 1,
        "logprobs": 0,
        "detokenize": False,
    }
    assert result.response_ids == [15, 16, 17]  # the fake adds the seed when sampling


def test_the_servers_own_logprobs_mode_is_accepted_and_not_forwarded() -> None:
    """vLLM sets the mode per server (--logprobs-mode), so the request carries none."""

    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            await vllm.generate(
                prompt_token_ids=[1],
                sampling_params={"max_tokens": 2, "logprobs_mode": "processed_logprobs"},
            )
            return fake

    assert "logprobs_mode" not in run(main()).hits[0].body["sampling_params"]


def test_generate_batch_keeps_order() -> None:
    from inference.client import GenerateRequest

    async def main() -> list[Any]:
        async with serving() as (_, vllm):
            requests = [
                GenerateRequest([i], {"max_tokens": 2, "temperature": 0.0}) for i in (5, 1, 9)
            ]
            return await vllm.generate_batch(requests, max_concurrency=2)

    assert [r.response_ids for r in run(main())] == [[6, 7], [2, 3], [10, 11]]


def test_max_tokens_is_always_sent() -> None:
    # vLLM fills the whole context when max_tokens is absent; ours defaults to 64.
    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            await vllm.generate(prompt_token_ids=[1], sampling_params={})
            return fake

    assert run(main()).hits[0].body["sampling_params"]["max_tokens"] == 64


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (
            {"return_sample_support": True},
            RequestValidationError,
            "return_sample_support: expected False",
        ),
        (
            {"return_sample_support": 4},
            RequestValidationError,
            "return_sample_support: expected False",
        ),
        (
            {"return_packed_body": True},
            RequestValidationError,
            "return_packed_body: expected False",
        ),
        ({"session_id": "s"}, RequestValidationError, "session_id: expected None"),
        (
            {"sampling_params": {"min_p": 0.1}},
            RequestValidationError,
            "$.sampling_params.min_p: expected one of",
        ),
        (
            {"sampling_params": {"logprobs_mode": "raw_logprobs"}},
            RequestValidationError,
            "$.sampling_params.logprobs_mode: expected one of ['processed_logprobs'] "
            "(supported_logprobs_modes: what this VLLMClient's engine reports) or None, "
            "got 'raw_logprobs'",
        ),
        (
            {"sampling_params": {"logprobs": 5}},
            RequestValidationError,
            "$.sampling_params.logprobs",
        ),
        (
            {"sampling_params": {"routed_experts_prompt_start": "2"}},
            RequestValidationError,
            "routed_experts_prompt_start: expected an int",
        ),
        (
            {
                "sampling_params": {"routed_experts_prompt_start": 1},
                "routed_experts_prompt_start": 1,
            },
            ValueError,
            "either as an argument or in sampling_params",
        ),
        ({"return_routed_experts": True}, ValueError, "route_shape: expected a RouteShape"),
        ({"sampling_params": [1]}, TypeError, "sampling_params: expected a mapping"),
    ],
)
def test_what_vllm_cannot_give_is_refused_before_sending(
    kwargs: dict, error: type, text: str
) -> None:
    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            with pytest.raises(error) as info:
                await vllm.generate(**{"prompt_token_ids": [1, 2], "sampling_params": {}, **kwargs})
            assert text in str(info.value)
            return fake

    assert run(main()).hits == []
