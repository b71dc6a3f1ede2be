"""``VLLMClient`` against a fake vLLM server on loopback (``fake_vllm``): request and
reply mapping, routes, weight versions, the retry taxonomy and the weight-push state
machine (file and NCCL senders). The server counts every request, so each test asserts
exactly what was sent and how often."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from inference.client import (
    GenerateClient,
    RemoteGenerateClient,
    RetryPolicy,
    RouteShape,
    VersionSpan,
)
from inference.engine.base import SamplingParams
from inference.errors import (
    GenerateHTTPError,
    GenerateProtocolError,
    GenerateTransportError,
    RequestValidationError,
)
from inference.vllm.client import VLLMClient
from inference.vllm.senders import NCCLBucketSender
from inference.vllm.spec import VLLM_LOGPROBS_MODE, VLLMServerSpec, vllm_command
from inference.vllm.transport import bucket_dir
from inference.wire.npy import encode_npy
from skyrl_train.trainer.weight_sync import WeightSyncer
from tests.inference.vllm_engine.fake_vllm import (
    AfterHandling,
    FakeVLLM,
    choice_json,
    drop_connection,
    error_json,
    fake_vllm,
    html_502,
    reply_json,
    reply_with,
)
from tests.vllm_reference import REPLIES, SKIP_REASON, route_array, vllm_reference

FAST = RetryPolicy(
    max_attempts=4,
    initial_backoff_s=0.01,
    max_backoff_s=0.02,
    attempt_timeout_s=5.0,
    deadline_s=20.0,
)
SHAPE = RouteShape(num_layers=3, top_k=2, num_experts=8)
PAUSE = "/pause?mode=keep&clear_cache=true"
PUSH = [PAUSE, "/start_weight_update"]
COMMIT = ["/finish_weight_update", "/resume"]
GEN = "/inference/v1/generate"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def serving(
    *, client: dict[str, Any] | None = None, **state: Any
) -> AsyncIterator[tuple[FakeVLLM, VLLMClient]]:
    async with fake_vllm(**state) as fake:
        options = {"retry": FAST, "seed": 0, "weight_timeout_s": 5.0, **(client or {})}
        async with VLLMClient(fake.url, **options) as vllm:
            yield fake, vllm


def override(choice: dict[str, Any]) -> Any:
    """A reply_override answering every generate with ``choice``."""
    return lambda body: reply_json(choice)


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


def _routes_choice(routes: Any) -> dict[str, Any]:
    return choice_json(
        token_ids=[7, 8],
        finish_reason="length",
        logprobs=[(7, -1.0, 1), (8, -1.0, 1)],
        routed_experts=routes,
        weight_versions=[("default", 0, 2)],
    )


_GOOD_ROUTES = np.zeros((3 - 0 + 2 - 1, 3, 2), np.uint8)  # P=3, s=0, G=2


def _truncated() -> str:
    return encode_npy(_GOOD_ROUTES)[:-8]  # still valid base64: 6 bytes short


@pytest.mark.parametrize(
    ("routes", "path", "text"),
    [
        (encode_npy(_GOOD_ROUTES.astype(np.float32)), "routed_experts.dtype", "one of"),
        (encode_npy(_GOOD_ROUTES.astype(np.int64)), "routed_experts.dtype", "one of"),
        (_truncated(), "routed_experts.data", "bytes for shape"),
        (encode_npy(_GOOD_ROUTES)[:-3], "routed_experts", "strict padded base64"),
        (encode_npy(np.zeros((4, 4, 2), np.uint8)), "routed_experts.shape[1]", "3 (expected shape"),
        (encode_npy(np.zeros((4, 3, 1), np.uint8)), "routed_experts.shape[2]", "2 (expected shape"),
        (encode_npy(np.zeros((4, 3), np.uint8)), "routed_experts.shape", "3 dims"),
        # a server that ignores routed_experts_prompt_start (1) and returns the whole prefix
        (encode_npy(_GOOD_ROUTES), "routed_experts.shape[0]", "3 (expected shape"),
        (encode_npy(np.asfortranarray(_GOOD_ROUTES)), "routed_experts.fortran_order", "C order"),
        (None, "routed_experts", "--enable-return-routed-experts"),
        (17, "routed_experts", "a base64 .npy string"),
    ],
)
def test_malformed_route_payloads_are_protocol_errors_never_retried(
    routes: Any, path: str, text: str
) -> None:
    async def main() -> tuple[FakeVLLM, BaseException]:
        async with serving(
            reply_override=override(_routes_choice(routes)), client={"route_shape": SHAPE}
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


# ---- retry taxonomy -------------------------------------------------------------------


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

        raw = reply_json(_routes_choice(encode_npy(_GOOD_ROUTES)))
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


# ---- weight push: file sender ---------------------------------------------------------


def _tensors() -> list[tuple[str, torch.Tensor]]:
    # 64 fp32 values (256 bytes) each: a 256-byte bucket cap gives one tensor per bucket.
    return [(f"model.layers.{i}.w", torch.full((64,), float(i))) for i in range(3)]


def test_versioned_three_bucket_push_exact_sequence() -> None:
    async def main() -> tuple[FakeVLLM, Any]:
        async with serving() as (fake, vllm):
            await WeightSyncer(bucket_bytes=256).push([vllm], _tensors(), policy_version=5)
            after = await vllm.generate(prompt_token_ids=[1], sampling_params={"max_tokens": 1})
            return fake, after

    fake, after = run(main())
    assert fake.calls() == [
        *PUSH,
        "/update_weights",
        "/update_weights",
        "/update_weights",
        *COMMIT,
        GEN,
    ]
    bodies = {h.path: h.body for h in fake.hits}
    assert bodies["/finish_weight_update"] == {"weight_version": "5"}
    assert [
        h.body for h in fake.hits if h.path in ("/pause", "/start_weight_update", "/resume")
    ] == [None] * 3
    assert fake.loaded == [["model.layers.0.w"], ["model.layers.1.w"], ["model.layers.2.w"]]
    assert len(set(fake.bucket_files)) == 3
    for path in fake.bucket_files:
        assert os.path.dirname(path) == bucket_dir()  # the only folder the worker reads
        assert not os.path.exists(path)  # removed once the server answered
    assert after.policy_version == 5 and not fake.paused and not fake.started


def test_unversioned_push_commits_every_bucket() -> None:
    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            await WeightSyncer(bucket_bytes=256).push([vllm], _tensors())
            return fake

    fake = run(main())
    assert fake.calls() == [*PUSH, "/update_weights", *COMMIT] * 3
    finishes = [h.body for h in fake.hits if h.path == "/finish_weight_update"]
    assert finishes == [{"weight_version": None}] * 3
    assert fake.version == "default"  # no version named: the label stays


def test_direct_buckets_and_return_counts() -> None:
    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            n1 = await vllm.update_weights(dict(_tensors()[:2]), policy_version=2, commit=False)
            n2 = await vllm.update_weights(dict(_tensors()[2:]), policy_version=2)
            assert (n1, n2) == (2, 1)
            return fake

    fake = run(main())
    assert fake.calls() == [*PUSH, "/update_weights", "/update_weights", *COMMIT]
    assert fake.bucket_modes == [0o600, 0o600]  # no other user can read the weights
    assert all(os.path.dirname(p) == bucket_dir() for p in fake.bucket_files)
    assert not any(os.path.exists(p) for p in fake.bucket_files) and fake.version == "2"


def test_failure_mid_push_resumes_then_raises_and_the_next_push_works() -> None:
    async def main() -> tuple[FakeVLLM, BaseException]:
        failing = reply_with(500, {"error": "worker died"})
        async with serving(faults={"/update_weights": [None, failing, None]}) as (fake, vllm):
            with pytest.raises(GenerateHTTPError) as info:
                await WeightSyncer(bucket_bytes=256).push([vllm], _tensors(), policy_version=1)
            assert not fake.paused and not fake.started  # the server is serving again
            await WeightSyncer(bucket_bytes=256).push([vllm], _tensors(), policy_version=1)
            return fake, info.value

    fake, error = run(main())
    first = [*PUSH, "/update_weights", "/update_weights", "/finish_weight_update", "/resume"]
    assert fake.calls()[: len(first)] == first  # the failed bucket was sent once, not retried
    assert [h.body for h in fake.hits if h.path == "/finish_weight_update"][0] == {
        "weight_version": None
    }
    assert fake.calls()[len(first) :] == [*PUSH, *["/update_weights"] * 3, *COMMIT]
    assert error.status == 500 and "worker died" in str(error)  # type: ignore[attr-defined]
    assert fake.version == "1" and all(not os.path.exists(p) for p in fake.bucket_files)


def test_transport_failure_of_an_update_is_not_retried() -> None:
    async def main() -> FakeVLLM:
        async with serving(faults={"/update_weights": [drop_connection, None]}) as (fake, vllm):
            with pytest.raises(GenerateTransportError):
                await vllm.update_weights({"w": torch.ones(2)}, policy_version=1)
            return fake

    fake = run(main())
    assert fake.calls() == [*PUSH, "/update_weights", "/finish_weight_update", "/resume"]


def test_pause_and_resume_are_retried_start_is_not() -> None:
    async def main() -> FakeVLLM:
        faults = {"/pause": [drop_connection, None], "/resume": [html_502, None]}
        async with serving(faults=faults) as (fake, vllm):
            await vllm.update_weights({"w": torch.ones(2)}, policy_version=1)
            return fake

    fake = run(main())
    assert fake.calls() == [
        PAUSE,
        *PUSH,
        "/update_weights",
        "/finish_weight_update",
        "/resume",
        "/resume",
    ]

    async def start_drops() -> FakeVLLM:
        async with serving(faults={"/start_weight_update": [drop_connection, None]}) as (
            fake,
            vllm,
        ):
            with pytest.raises(GenerateTransportError):
                await vllm.update_weights({"w": torch.ones(2)}, policy_version=1)
            return fake

    fake = run(start_drops())
    # Start was sent once and got no answer: it may have opened a session, so the
    # cleanup finishes one and resumes. Here none was open: the finish is refused, with
    # the plain 500 vLLM also gives a finish that failed, so close() tries it once more.
    assert fake.calls() == [*PUSH, "/finish_weight_update", "/resume", "/finish_weight_update"]
    assert not fake.started and not fake.paused


@pytest.mark.parametrize("lost", ["/pause", "/start_weight_update"])
def test_a_request_that_acted_but_lost_its_reply_is_undone_and_the_next_push_works(
    lost: str,
) -> None:
    """The server paused or opened a session, and the client never heard: vLLM refuses
    every later start while a session is open, so the cleanup must end it anyway."""

    async def main() -> tuple[FakeVLLM, BaseException]:
        async with serving(faults={lost: [AfterHandling(drop_connection)]}) as (fake, vllm):
            with pytest.raises(GenerateTransportError) as info:
                await WeightSyncer(bucket_bytes=256).push([vllm], _tensors(), policy_version=1)
            assert not fake.paused and not fake.started  # nothing left in effect
            fake.faults.clear()
            await WeightSyncer(bucket_bytes=256).push([vllm], _tensors(), policy_version=2)
            return fake, info.value

    fake, error = run(main())
    first = [PAUSE] * 4 + ["/resume"] if lost == "/pause" else [*PUSH, *COMMIT]
    assert fake.calls() == [*first, *PUSH, *["/update_weights"] * 3, *COMMIT]
    assert fake.version == "2"
    assert getattr(error, "__notes__", []) == []  # the cleanup itself went through


def test_a_cleanup_finish_without_an_answer_is_sent_again_before_the_next_start() -> None:
    async def main() -> tuple[FakeVLLM, BaseException]:
        faults = {
            "/start_weight_update": [AfterHandling(drop_connection), None],
            "/finish_weight_update": [drop_connection, None],
        }
        async with serving(faults=faults) as (fake, vllm):
            with pytest.raises(GenerateTransportError) as info:
                await vllm.update_weights({"w": torch.ones(2)}, policy_version=1)
            assert fake.started and not fake.paused  # the session is still open
            await vllm.update_weights({"w": torch.ones(2)}, policy_version=2)
            return fake, info.value

    fake, error = run(main())
    assert fake.calls() == [
        *PUSH,
        "/finish_weight_update",  # lost: the session stays open
        "/resume",
        "/finish_weight_update",  # the next push ends it first
        *PUSH,
        "/update_weights",
        *COMMIT,
    ]
    assert fake.version == "2" and not fake.started
    assert "an update session may still be open" in "\n".join(getattr(error, "__notes__", []))


def test_cleanup_failures_are_notes_and_close_resumes() -> None:
    async def main() -> tuple[FakeVLLM, BaseException]:
        faults = {
            "/update_weights": [reply_with(500, {"error": "boom"})],
            "/resume": [reply_with(500, {"error": "still down"}), None],
        }
        async with serving(faults=faults) as (fake, vllm):
            with pytest.raises(GenerateHTTPError) as info:
                await vllm.update_weights({"w": torch.ones(2)}, policy_version=1)
            assert fake.paused
        return fake, info.value  # close() ended the push: resumed

    fake, error = run(main())
    notes = "\n".join(getattr(error, "__notes__", []))
    assert "/resume failed, the server may still be paused" in notes and "still down" in notes
    assert fake.calls() == [*PUSH, "/update_weights", "/finish_weight_update", "/resume", "/resume"]
    assert not fake.paused


def test_close_mid_push_ends_it() -> None:
    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            await vllm.update_weights({"w": torch.ones(2)}, policy_version=3, commit=False)
            assert fake.paused and fake.started
        return fake

    fake = run(main())
    assert fake.calls() == [*PUSH, "/update_weights", "/finish_weight_update", "/resume"]
    assert fake.version == "default"  # an abandoned push never names its version


def test_bad_policy_version_is_refused_before_sending() -> None:
    async def main() -> FakeVLLM:
        async with serving() as (fake, vllm):
            with pytest.raises(
                RequestValidationError, match="policy_version: expected None or an int >= 0"
            ):
                await vllm.update_weights({"w": torch.ones(1)}, policy_version=-1)
            return fake

    assert run(main()).hits == []


def test_health() -> None:
    async def main() -> tuple[dict, dict]:
        async with serving() as (fake, vllm):
            first = await vllm.health()
            fake.faults["/weight_info"] = [reply_with(404, {"detail": "Not Found"})]
            return first, await vllm.health()

    first, without_dev_mode = run(main())
    assert first == {
        "status": "ok",
        "models": ["m"],
        "max_model_len": 4096,
        "weight_version": "default",
        "policy_version": 0,
    }
    assert without_dev_mode["weight_version"] is None and without_dev_mode["policy_version"] is None


# ---- weight push: NCCL sender, the broadcast faked ------------------------------------


class FakeBroadcast:
    """Rank 0 of a fake NCCL group: ``open`` and ``broadcast`` only return once the
    server side is inside the matching request, as a real collective would."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.joined = asyncio.Event()
        self.server_in_init = asyncio.Event()
        self.sent: asyncio.Queue[list[str]] = asyncio.Queue()
        self.server_in_update = asyncio.Event()
        self.closed = False
        self.init_infos: list[dict[str, Any]] = []  # what the server's workers were sent

    def worker_init_info(self) -> dict[str, Any]:
        return {
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
        }

    async def open(self) -> None:
        await asyncio.wait_for(self.server_in_init.wait(), 5)
        self.events.append(("open", None))
        self.joined.set()

    async def broadcast(self, tensors: Sequence[tuple[str, Any]]) -> None:
        await asyncio.wait_for(self.server_in_update.wait(), 5)
        self.server_in_update.clear()
        names = [name for name, _ in tensors]
        self.events.append(("broadcast", names))
        await self.sent.put(names)

    async def close(self) -> None:
        self.closed = True


def _nccl_server(fake: FakeVLLM, rank0: FakeBroadcast) -> None:
    fake.update_mode = "nccl"

    async def init(info: dict[str, Any]) -> None:
        rank0.init_infos.append(info)
        rank0.server_in_init.set()
        await asyncio.wait_for(rank0.joined.wait(), 5)  # the rendezvous needs both sides

    async def update(info: dict[str, Any]) -> None:
        rank0.server_in_update.set()
        received = await asyncio.wait_for(rank0.sent.get(), 5)
        assert received == info["names"]

    fake.nccl_init = init
    fake.nccl_update = update


def test_nccl_push_control_flow() -> None:
    rank0 = FakeBroadcast()

    async def main() -> FakeVLLM:
        async with serving(client={"sender": NCCLBucketSender(rank0)}) as (fake, vllm):
            _nccl_server(fake, rank0)
            tensors = [("a", torch.ones(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
            await WeightSyncer(bucket_bytes=8).push([vllm], tensors, policy_version=1)
            await WeightSyncer(bucket_bytes=8).push([vllm], tensors, policy_version=2)
            return fake

    fake = run(main())
    push = [*PUSH, "/update_weights", "/update_weights", *COMMIT]
    assert fake.calls() == ["/init_weight_transfer_engine", *push, *push]  # init once
    assert rank0.init_infos == [rank0.worker_init_info()]
    updates = [h.body["update_info"] for h in fake.hits if h.path == "/update_weights"]
    assert updates[:2] == [
        {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]},
        {"names": ["b"], "dtype_names": ["float32"], "shapes": [[4]]},
    ]
    assert [e for e in rank0.events if e[0] == "broadcast"] == [
        ("broadcast", ["a"]),
        ("broadcast", ["b"]),
    ] * 2
    assert fake.version == "2" and rank0.closed


def test_nccl_update_refused_before_the_collective_cancels_the_broadcast() -> None:
    rank0 = FakeBroadcast()
    cancelled: list[bool] = []

    async def never(tensors: Any) -> None:
        try:
            await asyncio.sleep(30)  # a broadcast whose peers never come
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> FakeVLLM:
        faults = {"/update_weights": [reply_with(400, {"error": "bad update_info"})]}
        async with serving(client={"sender": NCCLBucketSender(rank0)}, faults=faults) as (
            fake,
            vllm,
        ):
            _nccl_server(fake, rank0)
            rank0.broadcast = never  # type: ignore[method-assign]
            with pytest.raises(GenerateHTTPError, match="bad update_info"):
                await asyncio.wait_for(
                    vllm.update_weights({"a": torch.ones(1)}, policy_version=1), 10
                )
            return fake

    fake = run(main())
    assert cancelled == [True]
    assert fake.calls() == ["/init_weight_transfer_engine", *PUSH, "/update_weights", *COMMIT]
