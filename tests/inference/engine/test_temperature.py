"""One temperature rule for the HTTP request and the engine, with limits that keep the
float32 sampler finite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from inference.engine.base import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    TEMPERATURE_RULE,
    EngineRequest,
    SamplingParams,
    check_temperature,
)
from inference.errors import RequestValidationError

REFUSED = [1e-39, 1e-30, MIN_TEMPERATURE * 0.99, MAX_TEMPERATURE * 1.01, 1e4, 1e308]
REFUSED += [-1, -1e-6, math.nan, math.inf, -math.inf, True, "1.0", None]


@pytest.mark.parametrize("value", [0, 0.0, MIN_TEMPERATURE, 0.7, 1, MAX_TEMPERATURE, np.float32(2)])
def test_zero_and_the_range_are_accepted(value: object) -> None:
    assert check_temperature(value, field="t") == float(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_everything_else_is_refused_with_the_one_message(value: object) -> None:
    with pytest.raises(RequestValidationError) as info:
        check_temperature(value, field="$.t")
    assert str(info.value).startswith(f"$.t: expected {TEMPERATURE_RULE}, got ")
    assert TEMPERATURE_RULE == "0 (greedy) or a number in [1e-06, 100]"


def test_the_limits_keep_float32_sampling_finite() -> None:
    # The sampler divides float32 logits by the temperature; logits of |x| <= 50 are
    # generous for these models.
    logits = torch.linspace(-50.0, 50.0, 264)
    for temperature in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        scaled = logits / torch.tensor(temperature, dtype=torch.float32)
        assert torch.isfinite(torch.softmax(scaled, dim=-1)).all()
    overflow = logits / torch.tensor(1e-39, dtype=torch.float32)
    assert torch.isnan(torch.softmax(overflow, dim=-1)).any()  # why 1e-39 is refused


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, MAX_TEMPERATURE])
def test_the_engine_samples_at_the_limits(fp32_engine, temperature: float) -> None:
    sampling = SamplingParams(max_tokens=4, temperature=temperature, seed=3, ignore_eos=True)
    (out,) = fp32_engine.generate_sync([EngineRequest([5, 6, 7], sampling)])
    assert len(out.token_ids) == 4 and all(math.isfinite(x) for x in out.logprobs)


@pytest.mark.parametrize("value", [1e-39, 1e-30, 1e4, 1e308, -0.5, math.nan])
def test_the_engine_refuses_with_the_same_rule(fp32_engine, value: float) -> None:
    with pytest.raises(RequestValidationError) as info:
        fp32_engine.generate_sync([EngineRequest([1], SamplingParams(temperature=value))])
    assert info.value.path == "requests[0].sampling.temperature"
    assert info.value.expected == TEMPERATURE_RULE
