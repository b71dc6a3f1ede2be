"""``VLLMClient``'s reading of a vLLM reply, against a fake server on loopback: routes
(decoded with the prompt start, ignored when not asked for, malformed payloads refused
as protocol errors and never retried), weight-version spans as policy versions, and
malformed replies refused naming their JSON path."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from inference.client import VersionSpan
from inference.errors import GenerateProtocolError
from inference.wire.npy import encode_npy
from tests.inference.vllm_engine._vllm_client_helpers import (
    COMMIT,
    GEN,
    GOOD_ROUTES,
    PUSH,
    SHAPE,
    override,
    routes_choice,
    run,
    serving,
)
from tests.inference.vllm_engine.fake_vllm import (
    FakeVLLM,
    choice_json,
    reply_json,
)

# ---- routes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "kept"), [("uint8", "uint8"), ("uint16", "uint8"), ("int32", "uint8")]
)
def test_routes_decoded_with_prompt_start(sent: str, kept: str) -> None:
    async def main() -> tuple[FakeVLLM, Any]:
        async with serving(routes=(3, 2, sent), client={"route_shape": SHAPE}) as (fake, vllm):
            result = await vllm.generate(
                prompt_token_ids=[1, 2, 3, 4, 5, 6],
                sampling_params={"max_tokens": 4, "temperature": 0.0},
                return_routed_experts=True,
                routed_experts_prompt_start=2,
            )
            return fake, result

    fake, result = run(main())
    assert fake.hits[0].body["sampling_params"]["routed_experts_prompt_start"] == 2
    rows = 6 - 2 + 4 - 1  # P - s + G - 1: the last sampled token was never fed
    expected = (np.arange(rows * 3 * 2) % 7).reshape(rows, 3, 2)
    np.testing.assert_array_equal(result.routed_experts, expected)
    assert result.routed_experts.dtype == np.dtype(kept)  # canonical: max id 6


def test_routes_sent_unasked_are_not_decoded() -> None:
    # A capturing server sends routes with every reply; a broken one is no error then.
    choice = choice_json(
        token_ids=[7], finish_reason="stop", logprobs=[(7, -1.0, 1)], routed_experts="!!"
    )

    async def main() -> Any:
        async with serving(reply_override=override(choice)) as (_, vllm):
            return await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 1})

    result = run(main())
    assert result.response_ids == [7] and result.routed_experts is None


def _truncated() -> str:
    return encode_npy(GOOD_ROUTES)[:-8]  # still valid base64: 6 bytes short


@pytest.mark.parametrize(
    ("routes", "path", "text"),
    [
        (encode_npy(GOOD_ROUTES.astype(np.float32)), "routed_experts.dtype", "one of"),
        (encode_npy(GOOD_ROUTES.astype(np.int64)), "routed_experts.dtype", "one of"),
        (_truncated(), "routed_experts.data", "bytes for shape"),
        (encode_npy(GOOD_ROUTES)[:-3], "routed_experts", "strict padded base64"),
        (encode_npy(np.zeros((4, 4, 2), np.uint8)), "routed_experts.shape[1]", "3 (expected shape"),
        (encode_npy(np.zeros((4, 3, 1), np.uint8)), "routed_experts.shape[2]", "2 (expected shape"),
        (encode_npy(np.zeros((4, 3), np.uint8)), "routed_experts.shape", "3 dims"),
        # a server that ignores routed_experts_prompt_start (1) and returns the whole prefix
        (encode_npy(GOOD_ROUTES), "routed_experts.shape[0]", "3 (expected shape"),
        (encode_npy(np.asfortranarray(GOOD_ROUTES)), "routed_experts.fortran_order", "C order"),
        (None, "routed_experts", "--enable-return-routed-experts"),
        (17, "routed_experts", "a base64 .npy string"),
    ],
)
def test_malformed_route_payloads_are_protocol_errors_never_retried(
    routes: Any, path: str, text: str
) -> None:
    async def main() -> tuple[FakeVLLM, BaseException]:
        async with serving(
            reply_override=override(routes_choice(routes)), client={"route_shape": SHAPE}
        ) as (
            fake,
            vllm,
        ):
            with pytest.raises(GenerateProtocolError) as info:
                await vllm.generate(
                    prompt_token_ids=[1, 2, 3],
                    sampling_params={"max_tokens": 2},
                    return_routed_experts=True,
                    routed_experts_prompt_start=1 if path.endswith("shape[0]") else None,
                )
            return fake, info.value

    fake, error = run(main())
    assert fake.count(GEN) == 1  # a protocol error: the same bytes again would not help
    assert error.path == f"$.choices[0].{path}"  # type: ignore[attr-defined]
    assert text in str(error)


# ---- weight versions ------------------------------------------------------------------


def test_spans_become_policy_versions() -> None:
    choice = choice_json(
        token_ids=[1, 2, 3, 4, 5, 6],
        finish_reason="length",
        logprobs=[(t, -1.0, 1) for t in range(1, 7)],
        weight_versions=[("default", 0, 1), ("0", 1, 2), ("3", 2, 2), ("3", 2, 4), ("4", 4, 6)],
    )

    async def main() -> Any:
        async with serving(reply_override=override(choice)) as (_, vllm):
            return await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 6})

    result = run(main())
    # "default" and "0" are both version 0; an empty span is dropped; equal neighbours merge.
    assert result.policy_version_spans == [
        VersionSpan(0, 0, 2),
        VersionSpan(3, 2, 4),
        VersionSpan(4, 4, 6),
    ]
    assert result.policy_version == 0 and result.policy_versions == (0, 3, 4)


def test_a_reply_spanning_a_live_push_carries_both_versions() -> None:
    async def main() -> tuple[FakeVLLM, Any]:
        async with serving(hold_after=3) as (fake, vllm):
            task = asyncio.ensure_future(
                vllm.generate(
                    prompt_token_ids=[1], sampling_params={"max_tokens": 6, "temperature": 0.0}
                )
            )
            await fake.held.wait()  # three tokens generated under "default"
            await vllm.update_weights({"w": torch.ones(2)}, policy_version=1)
            fake.release.set()
            return fake, await task

    fake, result = run(main())
    assert fake.calls() == [GEN, *PUSH, "/update_weights", *COMMIT]
    assert result.policy_version_spans == [VersionSpan(0, 0, 3), VersionSpan(1, 3, 6)]
    assert result.policy_version == 0 and result.policy_versions == (0, 1)


@pytest.mark.parametrize(
    ("choice", "path", "text"),
    [
        (
            choice_json(
                token_ids=[1, 2],
                finish_reason="stop",
                logprobs=[(1, -1.0, 1), (2, -1.0, 1)],
                weight_versions=[("1", 0, 1), ("2", 2, 2)],
            ),
            "weight_versions[1].start",
            "expected 1 (spans tile",
        ),
        (
            choice_json(
                token_ids=[1, 2],
                finish_reason="stop",
                logprobs=[(1, -1.0, 1), (2, -1.0, 1)],
                weight_versions=[("1", 0, 1)],
            ),
            "weight_versions",
            "spans ending at 2",
        ),
        (
            choice_json(
                token_ids=[1],
                finish_reason="stop",
                logprobs=[(1, -1.0, 1)],
                weight_versions=[("v7", 0, 1)],
            ),
            "weight_versions[0].version",
            "str(policy_version)",
        ),
        (
            choice_json(
                token_ids=[1],
                finish_reason="stop",
                logprobs=[(1, -1.0, 1)],
                weight_versions=[("-1", 0, 1)],
            ),
            "weight_versions[0].version",
            "str(policy_version)",
        ),
        (
            choice_json(
                token_ids=[1],
                finish_reason="stop",
                logprobs=[(1, -1.0, 1)],
                weight_versions=[("1", 0, 5)],
            ),
            "weight_versions[0].end",
            "an int in [0, 1]",
        ),
        (
            choice_json(
                token_ids=[1, 2], finish_reason="stop", logprobs=[(1, -1.0, 1), (3, -1.0, 1)]
            ),
            "logprobs.content[1].token_id",
            "2 (token_ids[1])",
        ),
        (
            choice_json(token_ids=[1], finish_reason="stop", logprobs=None),
            "logprobs",
            "the request asked for it",
        ),
        (
            choice_json(token_ids=[1, 2], finish_reason="stop", logprobs=[(1, -1.0, 1)]),
            "logprobs.content",
            "2 entries",
        ),
        (
            choice_json(token_ids=[1, -2], finish_reason="stop", logprobs=None),
            "token_ids",
            "non-negative ints",
        ),
        (
            choice_json(token_ids=[1], finish_reason=None, logprobs=None),
            "finish_reason",
            "a string",
        ),  # type: ignore[arg-type]
    ],
)
def test_malformed_replies_are_protocol_errors_never_retried(
    choice: dict, path: str, text: str
) -> None:
    async def main() -> tuple[FakeVLLM, BaseException]:
        async with serving(reply_override=override(choice)) as (fake, vllm):
            with pytest.raises(GenerateProtocolError) as info:
                await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 2})
            return fake, info.value

    fake, error = run(main())
    assert fake.count(GEN) == 1
    assert error.path == f"$.choices[0].{path}"  # type: ignore[attr-defined]
    assert text in str(error)


def test_clamped_logprobs_are_counted() -> None:
    choice = choice_json(
        token_ids=[1, 2, 3],
        finish_reason="stop",
        logprobs=[(1, -0.5, 1), (2, -9999.0, None), (3, None, None)],  # type: ignore[list-item]
    )

    async def main() -> Any:
        async with serving(reply_override=override(choice)) as (_, vllm):
            return await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 3})

    result = run(main())
    assert result.logprobs == [-0.5, -9999.0, -9999.0] and result.num_clamped_logprobs == 2
    assert result.policy_version is None and result.policy_versions is None  # no spans sent


def test_two_choices_are_a_protocol_error() -> None:
    import json

    one = choice_json(token_ids=[1], finish_reason="stop", logprobs=[(1, -1.0, 1)])

    def two(body: Any) -> bytes:
        reply = json.loads(reply_json(one))
        reply["choices"].append(dict(one, index=1))
        return json.dumps(reply, separators=(",", ":")).encode()

    async def main() -> FakeVLLM:
        async with serving(reply_override=two) as (fake, vllm):
            with pytest.raises(
                GenerateProtocolError, match=r"\$\.choices: expected a list of exactly 1"
            ):
                await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 1})
            return fake

    assert run(main()).count(GEN) == 1
