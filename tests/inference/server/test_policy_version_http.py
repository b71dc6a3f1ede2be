"""Policy versions over HTTP: every generate reply says which version generated it, a
push split into staged uploads switches weights and version in one step, and a stale
or malformed version header is refused with the weights left serving.

Each test starts its own fp32 server (exact weight comparisons; the session's shared
live server keeps version 0 for the other tests)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import torch
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict
from safetensors.torch import save

from inference.engine import hf_engine
from inference.engine.base import EngineOutput, EngineRequest, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import RequestValidationError
from inference.server import ServerConfig, start_server
from inference.server.render import render_generate_reply
from inference.server.weight_versions import parse_upload_headers
from inference.wire import load_packed_body

UPLOAD = "/skyrl/v1/update_weights"
GEN = "/skyrl/v1/generate"
PLAIN_GEN = "/inference/v1/generate"
OCTETS = {"Content-Type": "application/octet-stream"}
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
GREEDY = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "temperature": 0}}
NORM = "model.norm.weight"
HEAD = "lm_head.weight"


class Live:
    """A started server on its own engine, and a session to talk to it."""

    def __init__(self, engine: Any, url: str, session: aiohttp.ClientSession) -> None:
        self.engine = engine
        self.url = url
        self.session = session

    async def generate(self, path: str = GEN, **extra: Any) -> dict[str, Any]:
        async with self.session.post(self.url + path, json={**GREEDY, **extra}) as r:
            raw = await r.read()
            assert r.status == 200, raw
        return load_packed_body(raw) if extra else orjson.loads(raw)

    async def version_and_tokens(self) -> tuple[int, list[int]]:
        reply = await self.generate()
        return reply["policy_version"], reply["choices"][0]["token_ids"]

    async def upload(
        self, tensors: dict[str, torch.Tensor], headers: Any = None
    ) -> tuple[int, dict[str, Any]]:
        sent = CIMultiDict(OCTETS)
        sent.extend(CIMultiDict(headers or {}))
        async with self.session.post(self.url + UPLOAD, data=save(tensors), headers=sent) as r:
            return r.status, orjson.loads(await r.read())

    async def health(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/health") as r:
            return orjson.loads(await r.read())


@contextlib.asynccontextmanager
async def serving(engine: Any = None) -> AsyncIterator[Live]:
    engine = engine if engine is not None else HFMoEEngine.from_config(seed=0, dtype="float32")
    server = await start_server(engine, ServerConfig())
    try:
        async with aiohttp.ClientSession() as session:
            yield Live(engine, server.url, session)
    finally:
        await server.stop()


def donor_weights() -> dict[str, torch.Tensor]:
    """Another seed's weights: they change every greedy token of PROMPT's reply."""
    donor = HFMoEEngine.from_config(seed=1, dtype="float32")
    try:
        return donor.state_dict()
    finally:
        donor._executor.shutdown(wait=True)


def expected_tokens(weights: dict[str, torch.Tensor]) -> list[int]:
    engine = HFMoEEngine.from_config(seed=0, dtype="float32")
    try:
        engine.load_weights(weights.items())
        request = EngineRequest(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
        return engine.generate_sync([request])[0].token_ids
    finally:
        engine._executor.shutdown(wait=True)


def assert_weights(engine: Any, expected: dict[str, torch.Tensor]) -> None:
    actual = engine.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor.to(actual[name].dtype)), name


def halves(weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    names = sorted(weights)
    cut = len(names) // 2
    return {n: weights[n] for n in names[:cut]}, {n: weights[n] for n in names[cut:]}


def test_replies_carry_version_0_then_the_pushed_version_on_every_route() -> None:
    async def main():
        async with serving() as live:
            start = [
                await live.generate(),
                await live.generate(PLAIN_GEN),
                await live.generate(return_routed_experts=True, return_packed_body=True),
            ]
            health_before = await live.health()
            pushed = await live.upload({NORM: torch.full((64,), 0.5)}, {"X-Policy-Version": "3"})
            after = [
                await live.generate(),
                await live.generate(PLAIN_GEN),
                await live.generate(return_routed_experts=True, return_packed_body=True),
            ]
            return start, health_before, pushed, after, await live.health(), live.engine

    start, health_before, pushed, after, health_after, engine = asyncio.run(main())
    assert [r["policy_version"] for r in start] == [0, 0, 0]
    assert health_before["policy_version"] == 0
    assert pushed == (200, {"num_loaded": 1, "num_staged": 0, "policy_version": 3})
    assert [r["policy_version"] for r in after] == [3, 3, 3]
    assert health_after["policy_version"] == 3 and engine.policy_version == 3
    assert health_after["counters"]["weight_updates"] == 1


def test_a_plain_upload_loads_at_once_and_keeps_the_version() -> None:
    async def main():
        async with serving() as live:
            first = await live.upload({NORM: torch.full((64,), 0.5)}, {"X-Policy-Version": "2"})
            plain = await live.upload({NORM: torch.full((64,), 0.25)})
            return first, plain, await live.version_and_tokens(), live.engine

    first, plain, (version, _), engine = asyncio.run(main())
    assert first[0] == 200 and plain == (
        200,
        {"num_loaded": 1, "num_staged": 0, "policy_version": 2},
    )
    assert version == 2
    assert_weights(engine, {NORM: torch.full((64,), 0.25)})


def test_two_bucket_push_is_atomic() -> None:
    weights = donor_weights()
    first, second = halves(weights)
    new_tokens = expected_tokens(weights)

    async def main():
        async with serving() as live:
            original = live.engine.state_dict()
            before = await live.version_and_tokens()
            staged = await live.upload(first, {"X-Policy-Version": "1", "X-Weight-Commit": "false"})
            between = await live.version_and_tokens()
            weights_between = live.engine.state_dict()
            health_between = await live.health()
            committed = await live.upload(second, {"X-Policy-Version": "1"})
            after = await live.version_and_tokens()
            return (
                original,
                before,
                staged,
                between,
                weights_between,
                health_between,
                committed,
                after,
                live.engine,
            )

    (original, before, staged, between, weights_between, health_between, committed, after, eng) = (
        asyncio.run(main())
    )
    assert before[0] == 0 and before[1] != new_tokens
    assert staged == (200, {"num_loaded": 0, "num_staged": len(first), "policy_version": 0})
    # Staged, not loaded: the old version's weights answer, token for token.
    assert between == before
    assert all(torch.equal(weights_between[n], original[n]) for n in original)
    assert health_between["policy_version"] == 0
    assert health_between["counters"]["weight_updates"] == 0
    assert committed == (200, {"num_loaded": len(weights), "num_staged": 0, "policy_version": 1})
    assert after == (1, new_tokens)
    assert_weights(eng, weights)


def test_a_commit_waits_for_the_running_batch_and_every_reply_is_one_version_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weights = donor_weights()
    first, second = halves(weights)
    new_tokens = expected_tokens(weights)
    started, release = threading.Event(), threading.Event()
    real_run_batch = hf_engine.run_batch

    def gated_run_batch(*args: Any, **kwargs: Any) -> Any:
        # Runs under the engine's model lock: holds the batch until the commit is sent.
        started.set()
        release.wait(timeout=30)
        return real_run_batch(*args, **kwargs)

    async def main():
        async with serving() as live:
            old = await live.version_and_tokens()
            started.clear()
            monkeypatch.setattr(hf_engine, "run_batch", gated_run_batch)
            await live.upload(first, {"X-Policy-Version": "7", "X-Weight-Commit": "false"})
            running = [asyncio.ensure_future(live.version_and_tokens()) for _ in range(4)]
            await asyncio.to_thread(started.wait, 30)
            commit = asyncio.ensure_future(live.upload(second, {"X-Policy-Version": "7"}))
            await asyncio.sleep(0.3)  # the commit's body is in; its load waits for the lock
            queued = [asyncio.ensure_future(live.version_and_tokens()) for _ in range(4)]
            await asyncio.sleep(0.05)
            commit_done_early = commit.done()
            release.set()
            return (
                old,
                commit_done_early,
                await commit,
                await asyncio.gather(*running),
                await asyncio.gather(*queued),
                await live.version_and_tokens(),
            )

    try:
        old, commit_done_early, commit, running, queued, last = asyncio.run(main())
    finally:
        release.set()
    assert old[0] == 0 and not commit_done_early and commit[0] == 200
    assert running == [old] * 4  # the batch that held the model ran wholly under version 0
    for reply in queued:
        assert reply in (old, (7, new_tokens)), reply
    assert last == (7, new_tokens)


def test_a_lower_version_is_a_409_and_leaves_weights_and_version_alone() -> None:
    async def main():
        async with serving() as live:
            ok = await live.upload({NORM: torch.full((64,), 0.5)}, {"X-Policy-Version": "5"})
            low = await live.upload({NORM: torch.full((64,), 9.0)}, {"X-Policy-Version": "4"})
            low_staged = await live.upload(
                {HEAD: torch.zeros(264, 64)}, {"X-Policy-Version": "4", "X-Weight-Commit": "false"}
            )
            after = await live.version_and_tokens()
            weights = live.engine.state_dict()
            same = await live.upload({NORM: torch.full((64,), 0.5)}, {"X-Policy-Version": "5"})
            return ok, low, low_staged, after, weights, same, await live.health()

    ok, low, low_staged, after, weights, same, health = asyncio.run(main())
    assert ok[0] == 200
    for status, reply in (low, low_staged):
        assert status == 409
        assert reply["error"]["field"] == "X-Policy-Version"
        assert reply["error"]["message"] == (
            "X-Policy-Version: expected an int >= 5 (the policy version serving now), got 4"
        )
    assert after[0] == 5
    assert torch.equal(weights[NORM], torch.full((64,), 0.5))
    assert same == (200, {"num_loaded": 1, "num_staged": 0, "policy_version": 5})  # a retry
    assert health["policy_version"] == 5


@pytest.mark.parametrize(
    ("headers", "field", "expected"),
    [
        ({"X-Policy-Version": "-1"}, "X-Policy-Version", "an int >= 0"),
        ({"X-Policy-Version": "three"}, "X-Policy-Version", "an int >= 0"),
        ({"X-Policy-Version": "1.5"}, "X-Policy-Version", "an int >= 0"),
        ({"X-Policy-Version": "+2"}, "X-Policy-Version", "an int >= 0"),
        ({"X-Policy-Version": ""}, "X-Policy-Version", "an int >= 0"),
        ({"X-Policy-Version": "9" * 40}, "X-Policy-Version", "an int >= 0 and <= "),
        ({"X-Weight-Commit": "yes"}, "X-Weight-Commit", "true or false"),
        ({"X-Weight-Commit": "1"}, "X-Weight-Commit", "true or false"),
        (
            [("X-Policy-Version", "1"), ("X-Policy-Version", "2")],
            "X-Policy-Version",
            "the header at most once",
        ),
    ],
    ids=["negative", "word", "float", "plus", "empty", "huge", "yes", "one", "twice"],
)
def test_bad_header_values_are_a_400_naming_the_header(
    headers: Any, field: str, expected: str
) -> None:
    async def main():
        async with serving() as live:
            reply = await live.upload({NORM: torch.full((64,), 9.0)}, headers)
            return reply, live.engine.state_dict(), await live.health()

    (status, reply), weights, health = asyncio.run(main())
    assert status == 400, reply
    assert reply["error"]["field"] == field
    assert reply["error"]["message"].startswith(f"{field}: expected {expected}")
    assert not torch.equal(weights[NORM], torch.full((64,), 9.0))
    assert health["policy_version"] == 0


def test_header_values_parse_case_and_space_insensitively_and_refuse_unicode_digits() -> None:
    def intent(**headers: str) -> Any:
        return parse_upload_headers(make_mocked_request("POST", UPLOAD, headers=headers))

    parsed = intent(**{"X-Policy-Version": " 12 ", "X-Weight-Commit": "FALSE"})
    assert (parsed.policy_version, parsed.commit) == (12, False)
    plain = intent()
    assert (plain.policy_version, plain.commit, plain.versioned) == (None, True, False)
    with pytest.raises(RequestValidationError, match=r"^X-Policy-Version: expected an int >= 0"):
        intent(**{"X-Policy-Version": "\u00b2"})


def test_a_commit_without_a_version_while_tensors_are_staged_is_a_400() -> None:
    weights = donor_weights()

    async def main():
        async with serving() as live:
            staged = await live.upload({NORM: weights[NORM]}, {"X-Weight-Commit": "false"})
            plain = await live.upload({HEAD: weights[HEAD]})
            untouched = live.engine.state_dict()
            committed = await live.upload({HEAD: weights[HEAD]}, {"X-Policy-Version": "2"})
            return staged, plain, untouched, committed, live.engine

    staged, plain, untouched, committed, engine = asyncio.run(main())
    assert staged == (200, {"num_loaded": 0, "num_staged": 1, "policy_version": 0})
    assert plain[0] == 400 and plain[1]["error"]["field"] == "X-Policy-Version"
    assert "a commit of 1 staged tensors names their policy version" in plain[1]["error"]["message"]
    assert not torch.equal(untouched[HEAD], weights[HEAD])
    # The unnamed staging is adopted by the versioned commit: both load together.
    assert committed == (200, {"num_loaded": 2, "num_staged": 0, "policy_version": 2})
    assert_weights(engine, {NORM: weights[NORM], HEAD: weights[HEAD]})


def test_an_abandoned_push_is_dropped_by_the_next_version() -> None:
    weights = donor_weights()

    async def main():
        async with serving() as live:
            original = live.engine.state_dict()
            # Push 2 staged one bucket, then died; push 3 stages and commits others.
            await live.upload(
                {HEAD: weights[HEAD]}, {"X-Policy-Version": "2", "X-Weight-Commit": "false"}
            )
            staged = await live.upload(
                {NORM: weights[NORM]}, {"X-Policy-Version": "3", "X-Weight-Commit": "false"}
            )
            committed = await live.upload(
                {"model.embed_tokens.weight": weights["model.embed_tokens.weight"]},
                {"X-Policy-Version": "3"},
            )
            return original, staged, committed, live.engine

    original, staged, committed, engine = asyncio.run(main())
    assert staged[1]["num_staged"] == 1  # push 2's head was dropped
    assert committed == (200, {"num_loaded": 2, "num_staged": 0, "policy_version": 3})
    assert_weights(engine, {HEAD: original[HEAD], NORM: weights[NORM]})


def test_a_refused_commit_loads_nothing_and_ends_the_staging() -> None:
    poisoned = torch.zeros(264, 64)
    poisoned[1, 2] = float("nan")

    async def main():
        async with serving() as live:
            original = live.engine.state_dict()
            await live.upload(
                {HEAD: poisoned, NORM: torch.full((64,), 0.5)},
                {"X-Policy-Version": "1", "X-Weight-Commit": "false"},
            )
            refused = await live.upload({NORM: torch.full((64,), 2.0)}, {"X-Policy-Version": "1"})
            weights = live.engine.state_dict()
            health = await live.health()
            retry = await live.upload({NORM: torch.full((64,), 2.0)}, {"X-Policy-Version": "1"})
            return original, refused, weights, health, retry

    original, refused, weights, health, retry = asyncio.run(main())
    assert refused[0] == 400 and refused[1]["error"]["field"] == f"{HEAD}[1, 2]"
    assert all(torch.equal(weights[n], original[n]) for n in original)
    assert health["policy_version"] == 0
    assert retry == (200, {"num_loaded": 1, "num_staged": 0, "policy_version": 1})


def test_restaging_a_name_keeps_one_copy_and_the_latest_value() -> None:
    async def main():
        async with serving() as live:
            commit_false = {"X-Policy-Version": "1", "X-Weight-Commit": "false"}
            await live.upload(
                {HEAD: torch.ones(264, 64), NORM: torch.full((64,), 0.5)}, commit_false
            )
            again = await live.upload({HEAD: torch.full((264, 64), 2.0)}, commit_false)
            committed = await live.upload(
                {"model.layers.0.mlp.gate.weight": torch.zeros(8, 64)}, {"X-Policy-Version": "1"}
            )
            return again, committed, live.engine

    again, committed, engine = asyncio.run(main())
    assert again[1]["num_staged"] == 2
    assert committed[1]["num_loaded"] == 3
    assert_weights(engine, {HEAD: torch.full((264, 64), 2.0), NORM: torch.full((64,), 0.5)})


class UnversionedEngine:
    """An engine wrapper written before versions: no ``policy_version``."""

    def __init__(self) -> None:
        self.inner = HFMoEEngine.from_config(seed=0, dtype="float32")

    @property
    def info(self) -> Any:
        return self.inner.info

    async def generate(self, requests: Any) -> Any:
        return await self.inner.generate(requests)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.inner.parameter_shapes()

    def load_weights(self, named_tensors: Any) -> int:
        return self.inner.load_weights(named_tensors)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    async def close(self) -> None:
        await self.inner.close()


def test_an_engine_without_versions_takes_plain_uploads_and_refuses_versioned_ones() -> None:
    async def main():
        async with serving(UnversionedEngine()) as live:
            plain = await live.upload({NORM: torch.full((64,), 0.5)})
            versioned = await live.upload({NORM: torch.full((64,), 2.0)}, {"X-Policy-Version": "1"})
            return plain, versioned, await live.health()

    plain, versioned, health = asyncio.run(main())
    assert plain == (200, {"num_loaded": 1, "num_staged": 0, "policy_version": None})
    assert versioned[0] == 501 and "keeps no policy version" in versioned[1]["error"]["message"]
    assert health["policy_version"] is None


def test_render_writes_the_outputs_version_in_lean_and_packed_replies() -> None:
    output = EngineOutput([1, 2], "length", [-1.0, -2.0], 11)
    for packed in (False, True):
        body, _ = render_generate_reply(
            output, EngineRequest([5]), model="m", side_channels=True, packed_body=packed
        )
        assert load_packed_body(body)["policy_version"] == 11
