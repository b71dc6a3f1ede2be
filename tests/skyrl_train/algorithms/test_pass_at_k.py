"""pass@k against values worked out by hand, the edges (c = 0, c = n, k = n), exactness
at large n, refusals of bad input, and the per-source summary."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from skyrl_train.algorithms.pass_at_k import (
    RowSamples,
    is_correct,
    pass_at_k,
    pass_at_k_levels,
    summarize,
)

# (n, c, k, value): 1 - C(n - c, k) / C(n, k), each worked out by hand.
HAND = [
    (5, 2, 2, Fraction(7, 10)),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 1, 1, Fraction(1, 5)),  # pass@1 is c / n
    (4, 1, 2, Fraction(1, 2)),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 2, Fraction(5, 6)),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (10, 3, 4, Fraction(5, 6)),  # 1 - C(7,4)/C(10,4) = 1 - 35/210
    (6, 0, 3, Fraction(0)),  # c = 0: never
    (6, 6, 3, Fraction(1)),  # c = n: always
    (6, 1, 6, Fraction(1)),  # k = n: any correct sample passes
    (6, 0, 6, Fraction(0)),  # k = n, none correct
    (8, 5, 4, Fraction(1)),  # n - c < k: every draw of 4 holds a correct one
    (1, 1, 1, Fraction(1)),
    (1, 0, 1, Fraction(0)),
]


@pytest.mark.parametrize(("n", "c", "k", "value"), HAND)
def test_pass_at_k_equals_hand_computed_values(n: int, c: int, k: int, value: Fraction) -> None:
    assert pass_at_k(n, c, k) == float(value)


def test_pass_at_k_is_the_exact_value_rounded_once_at_large_n() -> None:
    # Factorials of 2000 overflow a float; the exact fraction is the reference.
    for n, c, k in [(2000, 3, 500), (2000, 1999, 1), (1000, 1, 1), (300, 150, 150)]:
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == float(exact), (n, c, k)
    # A tiny pass rate keeps its relative precision (no 1 - 0.999... cancellation).
    assert pass_at_k(10_000, 1, 1) == 1e-4


def test_pass_at_k_rises_with_k_and_with_c() -> None:
    n = 16
    for c in range(n + 1):
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert values == sorted(values)
    for k in range(1, n + 1):
        values = [pass_at_k(n, c, k) for c in range(n + 1)]
        assert values == sorted(values)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 0, 1), ValueError, r"^pass_at_k\.n: expected at least 1 sample, got 0$"),
        ((4, 5, 1), ValueError, r"^pass_at_k\.c: expected 0 <= c <= n = 4, got 5$"),
        ((4, -1, 1), ValueError, r"^pass_at_k\.c: expected 0 <= c <= n = 4, got -1$"),
        ((4, 1, 0), ValueError, r"^pass_at_k\.k: expected 1 <= k <= n = 4, got 0$"),
        ((4, 1, 5), ValueError, r"^pass_at_k\.k: expected 1 <= k <= n = 4, got 5$"),
        ((4.0, 1, 1), TypeError, r"^pass_at_k\.n: expected an int, got 4\.0$"),
        ((4, True, 1), TypeError, r"^pass_at_k\.c: expected an int, got True$"),
        ((4, 1, "2"), TypeError, r"^pass_at_k\.k: expected an int, got '2'$"),
    ],
)
def test_bad_input_fails_loudly(args: tuple, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        pass_at_k(*args)


def test_levels_are_the_powers_of_two_and_n() -> None:
    assert pass_at_k_levels(1) == [1]
    assert pass_at_k_levels(4) == [1, 2, 4]
    assert pass_at_k_levels(5) == [1, 2, 4, 5]
    assert pass_at_k_levels(16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError):
        pass_at_k_levels(0)


def row(source: str, rewards: list[float], solved: list[bool | None]) -> RowSamples:
    n = len(rewards)
    return RowSamples(source, tuple(rewards), tuple(solved), (3,) * n, (2,) * n)


def test_correct_is_solved_when_reported_else_a_positive_reward() -> None:
    assert is_correct(0.0, True) and not is_correct(1.0, False)
    assert is_correct(0.5, None) and not is_correct(0.0, None)


def test_summary_per_source_and_pooled() -> None:
    rows = [
        row("a", [1.0, 0.0], [True, False]),  # c = 1
        row("a", [1.0, 1.0], [True, True]),  # c = 2
        row("b", [0.5, 0.0], [None, None]),  # no solved: reward > 0 counts, c = 1
    ]
    out = summarize(rows, ks=[1, 2], failed_rows={"b": 1, "c": 2})
    a, b, c = (out["by_data_source"][s] for s in "abc")
    assert (a["rows"], a["failed_rows"], a["samples"]) == (2, 0, 4)
    assert a["pass@1"] == 0.75 and a["pass@2"] == 1.0  # rows: 1/2, 1 and 1, 1
    assert a["reward_mean"] == 0.75 and a["success_rate"] == 0.75
    assert a["reward_std"] == pytest.approx(math.sqrt(3) / 4)
    assert a["correct_if"] == "solved"
    assert (b["pass@1"], b["pass@2"], b["success_rate"]) == (0.5, 1.0, None)
    assert b["correct_if"] == "reward > 0" and b["failed_rows"] == 1
    # A source whose rows all failed is listed with no figures.
    assert c["rows"] == 0 and c["failed_rows"] == 2 and c["pass@1"] is None
    assert c["reward_mean"] is None and c["correct_if"] is None
    pooled = out["overall"]
    assert (pooled["rows"], pooled["failed_rows"], pooled["samples"]) == (3, 3, 6)
    assert pooled["pass@1"] == pytest.approx((0.5 + 1.0 + 0.5) / 3)
    assert pooled["success_rate"] == 0.75  # only the samples that reported solved
    assert pooled["correct_if"] == "solved, else reward > 0"
    assert pooled["response_length_mean"] == 3 and pooled["generated_tokens_mean"] == 2


def test_summary_refuses_mixed_sample_counts_and_k_above_n() -> None:
    with pytest.raises(ValueError, match="one sample count"):
        summarize([row("a", [1.0], [True]), row("a", [1.0, 0.0], [True, False])], ks=[1])
    with pytest.raises(ValueError, match=r"1 <= k <= 2"):
        summarize([row("a", [1.0, 0.0], [True, False])], ks=[1, 4])
    with pytest.raises(ValueError, match="every field of that length"):
        RowSamples("a", (1.0, 0.0), (True,), (1, 1), (1, 1))
