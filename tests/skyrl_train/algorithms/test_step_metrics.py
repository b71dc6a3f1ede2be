"""``MetricSums``: each mean kept as its numerator and its own denominator and divided
once; sums, maxima and minima combine as their producer recorded them."""

from __future__ import annotations

import pickle

import pytest

from skyrl_train.algorithms import MetricSums


def _part(weight_sum: float, kept: float, tokens: float, worst: float) -> MetricSums:
    m = MetricSums()
    m.mean("off_policy/weight_mean", weight_sum, kept)
    m.total("off_policy/num_tokens", tokens)
    m.maximum("x/max_gap", worst)
    m.minimum("x/min_r", -worst)
    return m


def test_means_divide_their_summed_numerators_by_their_own_summed_denominators() -> None:
    # The case: rank 0 keeps 2 of its 10 tokens at weight 1.05, rank 1 keeps
    # none of its 10. The whole batch's weight mean is 1.05; weighting each rank's mean
    # by its loss tokens gave (10 x 1.05 + 10 x 0) / 20 = 0.525.
    rank0, rank1 = _part(2 * 1.05, 2, 10, 0.5), _part(0.0, 0, 10, 0.25)
    combined = MetricSums.combine([rank0, rank1])
    assert combined.result() == {
        "off_policy/num_tokens": 20.0,
        "off_policy/weight_mean": pytest.approx(1.05),
        "x/max_gap": 0.5,
        "x/min_r": -0.5,
    }
    assert list(combined) == sorted(combined)
    assert rank1["off_policy/weight_mean"] == 0.0  # an empty denominator reads its default


def test_recording_a_key_again_adds_to_it() -> None:
    m = MetricSums()
    m.mean("loss", 3.0, 3.0)
    m.mean("loss", 5.0, 1.0)
    m.total("n", 1)
    m.total("n", 2)
    assert dict(m) == {"loss": 2.0, "n": 3.0}
    assert m.parts("loss") == (8.0, 4.0)


def test_an_empty_mean_reads_its_empty_value_until_something_is_counted() -> None:
    m = MetricSums()
    m.mean("r3/router_agreement", 0.0, 0.0, empty=1.0)
    assert m["r3/router_agreement"] == 1.0
    m.mean("r3/router_agreement", 3.0, 4.0, empty=1.0)
    assert m["r3/router_agreement"] == 0.75


def test_it_survives_pickling_as_a_ray_reply_does() -> None:
    m = _part(3.0, 2.0, 4.0, 1.0)
    back = pickle.loads(pickle.dumps(m))
    assert dict(back) == dict(m) and back.parts("off_policy/weight_mean") == (3.0, 2.0)


def test_bad_values_and_mixed_kinds_are_refused_naming_the_key() -> None:
    m = MetricSums()
    with pytest.raises(ValueError, match=r"^metrics\['loss'\]: expected a finite"):
        m.mean("loss", float("nan"), 1.0)
    with pytest.raises(ValueError, match=r"^metrics\['loss'\]: expected a denominator >= 0"):
        m.mean("loss", 1.0, -1.0)
    m.total("n", 1.0)
    with pytest.raises(ValueError, match=r"^metrics\['n'\]: expected a sum as recorded before"):
        m.maximum("n", 2.0)
    with pytest.raises(ValueError, match=r"^metrics\['n'\]: expected a mean, got a sum"):
        m.parts("n")
