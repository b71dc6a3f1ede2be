"""The engine's policy version: 0 at start, set by the load that names one, never
lowered, and stamped on every output of a batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference.engine.base import EngineRequest, InferenceEngine, SamplingParams
from inference.engine.hf_engine import HFMoEEngine
from inference.errors import RequestValidationError

NORM = "model.norm.weight"


def _req(seed: int) -> EngineRequest:
    return EngineRequest([5, 6, 7], SamplingParams(max_tokens=3, seed=seed))


@pytest.fixture
def engine():
    engine = HFMoEEngine.from_config(seed=0, dtype="float32")
    yield engine
    asyncio.run(engine.close())


def test_outputs_carry_the_version_of_the_last_versioned_load(engine) -> None:
    assert isinstance(engine, InferenceEngine)
    assert engine.policy_version == 0
    assert [o.policy_version for o in engine.generate_sync([_req(0), _req(1)])] == [0, 0]
    assert engine.load_weights([(NORM, torch.full((64,), 0.5))], policy_version=4) == 1
    assert engine.policy_version == 4
    assert engine.load_weights([(NORM, torch.ones(64))]) == 1  # no version: unchanged
    assert engine.policy_version == 4
    assert engine.load_weights([(NORM, torch.ones(64))], policy_version=4) == 1  # same again

    async def batched():
        return await engine.generate([_req(2), _req(3), _req(4)])

    assert [o.policy_version for o in asyncio.run(batched())] == [4, 4, 4]


def test_a_lower_version_is_refused_with_nothing_loaded(engine) -> None:
    engine.load_weights([(NORM, torch.full((64,), 0.5))], policy_version=3)
    with pytest.raises(RequestValidationError) as info:
        engine.load_weights([(NORM, torch.full((64,), 9.0))], policy_version=2)
    assert info.value.status == 409 and info.value.path == "policy_version"
    assert str(info.value) == "policy_version: expected an int >= 3 (the engine's version), got 2"
    assert engine.policy_version == 3
    assert torch.equal(engine.state_dict()[NORM], torch.full((64,), 0.5))


def test_a_refused_load_leaves_the_version(engine) -> None:
    with pytest.raises(RequestValidationError):
        engine.load_weights([(NORM, torch.full((64,), float("nan")))], policy_version=1)
    assert engine.policy_version == 0


@pytest.mark.parametrize("bad", [-1, True, 1.0, "2"])
def test_a_malformed_version_is_refused(engine, bad: object) -> None:
    with pytest.raises(RequestValidationError, match=r"^policy_version: expected an int >= 0"):
        engine.load_weights([(NORM, torch.ones(64))], policy_version=bad)  # type: ignore[arg-type]
    assert engine.policy_version == 0
