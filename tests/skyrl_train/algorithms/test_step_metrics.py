"""Per-step aggregation of metric dicts and the JSONL line."""

from __future__ import annotations

import pytest
import torch

from skyrl_train.algorithms import StepMetrics, reduction_of


def test_reduction_follows_the_last_key_component() -> None:
    assert reduction_of("mismatch/max_abs_logp_diff") == "max"
    assert reduction_of("min_reward") == "min"
    assert reduction_of("policy/num_tokens") == "sum"
    assert reduction_of("num_x/clip_fraction") == "mean"


def test_weighted_means_maxima_and_sums() -> None:
    m = StepMetrics()
    m.update({"loss": 1.0, "x/max_gap": 0.5, "x/num_tokens": 3, "x/min_r": 2.0}, weight=3)
    m.update(
        {"loss": torch.tensor(5.0), "x/max_gap": 0.25, "x/num_tokens": 1, "x/min_r": -1.0}, weight=1
    )
    assert m.result() == {
        "loss": pytest.approx((3 * 1.0 + 5.0) / 4),
        "x/max_gap": 0.5,
        "x/min_r": -1.0,
        "x/num_tokens": 4.0,
    }
    assert list(m.result()) == sorted(m.result())


def test_zero_weights_fall_back_to_plain_mean() -> None:
    m = StepMetrics()
    m.update({"agreement": 1.0}, weight=0)
    m.update({"agreement": 0.5}, weight=0)
    assert m.result() == {"agreement": 0.75}
    assert StepMetrics().result() == {}


def test_non_finite_values_and_weights_are_refused() -> None:
    m = StepMetrics()
    with pytest.raises(ValueError, match=r"^metrics\['loss'\]:"):
        m.update({"loss": float("nan")})
    with pytest.raises(ValueError, match="^weight:"):
        m.update({"loss": 1.0}, weight=-1)
