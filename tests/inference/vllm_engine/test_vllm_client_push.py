"""``VLLMClient``'s weight-push state machine with the file sender, against a fake
vLLM server on loopback: the exact request sequence of a versioned and an unversioned
push, what is retried and what is not, a request that acted but lost its reply undone,
cleanup after a failure, and ``close`` mid-push."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from inference.errors import (
    GenerateHTTPError,
    GenerateTransportError,
    RequestValidationError,
)
from inference.vllm.transport import bucket_dir
from skyrl_train.trainer.weight_sync import WeightSyncer
from tests.inference.vllm_engine._vllm_client_helpers import (
    COMMIT,
    GEN,
    PAUSE,
    PUSH,
    run,
    serving,
)
from tests.inference.vllm_engine.fake_vllm import (
    AfterHandling,
    FakeVLLM,
    drop_connection,
    html_502,
    reply_with,
)


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
