"""Answer extraction, number normalisation and reward_spec checks."""

from __future__ import annotations

import time

import pytest

from skyrl_gym import EnvError
from skyrl_gym.envs.answers import (
    answers_match,
    check_extra_info,
    check_reward_spec,
    extract_answer,
    normalize_number,
)

# (text, lenient answer, strict answer)
EXTRACTION_CASES = [
    # The GSM8K format.
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", "7"),
    ("#### 42", "42", "42"),
    ("####42", "42", "42"),
    ("so 5 left\n####\n5", "5", "5"),
    ("#### 1,000", "1000", "1000"),
    ("#### $18.", "18", "18"),
    ("#### 3.50", "3.5", "3.5"),
    ("#### -12", "-12", "-12"),
    ("#### \u22127", "-7", "-7"),  # unicode minus
    ("#### \u20133", "-3", "-3"),  # en dash
    ("#### +5", "5", "5"),
    ("#### 42 apples", "42", "42"),
    # Several markers: the last one that holds a number is the answer.
    ("#### 5\nwait, no.\n#### 6", "6", "6"),
    ("#### 5\n#### oops", "5", "5"),
    ("#### 5 #### 6 ####", "6", "6"),
    ("##### 9", "9", "9"),
    # A marker with no number falls through to \boxed, then (lenient) the last number.
    ("I think 12.\n####", "12", None),
    ("#### x\n\\boxed{4}", "4", "4"),
    ("#### 42kg", None, None),  # glued to a word: not a number
    # \boxed{}.
    ("\\boxed{17}", "17", "17"),
    ("\\boxed{ 17 }", "17", "17"),
    ("\\boxed{-2.50}", "-2.5", "-2.5"),
    ("\\boxed{\\$1,200}", "1200", "1200"),
    ("\\boxed{3} then \\boxed{4}", "4", "4"),
    ("#### 8 and \\boxed{9}", "8", "8"),  # #### outranks \boxed
    ("\\boxed{\\frac{1}{2}}", "2", None),  # not a number; lenient takes the last one
    ("\\boxed{}", None, None),
    # The last number in the text (lenient only).
    ("The answer is 25.", "25", None),
    ("It costs $1,234.50 in total", "1234.5", None),
    ("2 + 3 = 5, so five", "5", None),
    ("10-2", "2", None),  # a subtraction, not a negative number
    ("the result is -4", "-4", None),
    ("the result is (-4)", "-4", None),
    ("the result is \u22124", "-4", None),
    ("it is -$5", "-5", None),
    ("x = .5", "0.5", None),
    ("temperatures 3, 4", "4", None),
    ("abc123def", None, None),  # numbers inside words are not numbers
    ("mp3 player for 40 dollars B12", "40", None),
    ("version 1.2.3", None, None),
    ("3,4", None, None),  # neither 34 nor a well-formed thousands group
    ("1,00", None, None),
    ("no numbers here", None, None),
    ("", None, None),
    ("\ufffd\ufffd", None, None),
    ("007 agents", "7", None),
]


@pytest.mark.parametrize(("text", "lenient", "strict"), EXTRACTION_CASES)
def test_extract_answer(text: str, lenient: str | None, strict: str | None) -> None:
    assert extract_answer(text) == lenient
    assert extract_answer(text, strict=True) == strict


def test_there_are_at_least_thirty_extraction_cases() -> None:
    assert len(EXTRACTION_CASES) >= 30


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("42", "42"),
        (" 42 ", "42"),
        ("1,234,567", "1234567"),
        ("$5", "5"),
        ("-$5", "-5"),
        ("$-5", "-5"),
        ("+5", "5"),
        ("\u22125", "-5"),
        ("\u20145", "-5"),
        ("\uff0d5", "-5"),
        ("3.50", "3.5"),
        ("3.0", "3"),
        ("3.00", "3"),
        ("3.", "3"),
        (".5", "0.5"),
        ("0.50", "0.5"),
        ("007", "7"),
        ("-0", "0"),
        ("-0.00", "0"),
        (7, "7"),
        (-3, "-3"),
        (2.5, "2.5"),
        (1e20, "100000000000000000000"),
        ("1,00", None),
        ("12,34", None),
        ("1 000", None),
        ("1/2", None),
        ("1e5", None),
        ("--5", None),
        ("+-5", None),
        ("5-", None),
        ("", None),
        (".", None),
        ("$", None),
        ("-", None),
        ("five", None),
        (True, None),
        (float("nan"), None),
        (float("inf"), None),
        (None, None),
    ],
)
def test_normalize_number(raw, canonical) -> None:
    assert normalize_number(raw) == canonical


def test_answers_match_is_exact_on_canonical_decimals() -> None:
    assert answers_match("0.5", ".5")
    assert answers_match("3.50", 3.5)
    assert answers_match("1,000", 1000)
    assert answers_match("\u22127", "-7")
    assert not answers_match("1/2", "0.5")  # fractions are not numbers here (module doc)
    assert not answers_match("0.5", "0.50001")
    assert not answers_match(None, "5")
    assert not answers_match("five", "five")  # not a number on either side


ONE_MB = 1 << 20
LINEAR_BUDGET_S = 1.0
"""Measured 1-220 ms per MB on an idle core; the bound leaves room for a loaded CI box
while still catching a quadratic scan (which takes minutes on 1 MB)."""


@pytest.mark.parametrize(
    "name",
    ["digits", "thousands", "dotted", "glued", "markers", "boxes", "spaces", "dashes"],
)
def test_extraction_is_linear_on_one_megabyte_of_adversarial_text(name: str) -> None:
    unit = {
        "digits": "9",
        "thousands": "1,000",
        "dotted": "1.",
        "glued": "a1",
        "markers": "#### ",
        "boxes": "\\boxed{",
        "spaces": " ",
        "dashes": "-",
    }[name]
    text = (unit * (ONE_MB // len(unit) + 1))[:ONE_MB] + "x"
    for strict in (False, True):
        start = time.perf_counter()
        extract_answer(text, strict=strict)
        assert time.perf_counter() - start < LINEAR_BUDGET_S, (name, strict)


def test_a_long_reply_still_finds_its_answer_at_the_end() -> None:
    text = "Let me think. " * 80_000 + "#### 314"
    start = time.perf_counter()
    assert extract_answer(text, strict=True) == "314"
    assert time.perf_counter() - start < LINEAR_BUDGET_S


def test_check_reward_spec_names_the_field() -> None:
    assert check_reward_spec("e", {"method": "rule", "ground_truth": "1,000"}) == "1000"
    assert check_reward_spec("e", {"method": "rule", "ground_truth": 72}) == "72"
    with pytest.raises(EnvError, match=r"e.reward_spec: expected a mapping"):
        check_reward_spec("e", "72")
    with pytest.raises(
        EnvError, match=r"e.reward_spec.method: expected one of \['rule'\], got 'llm'"
    ):
        check_reward_spec("e", {"method": "llm", "ground_truth": "1"})
    with pytest.raises(EnvError, match=r"e.reward_spec.method: .*got None"):
        check_reward_spec("e", {"ground_truth": "1"})
    with pytest.raises(
        EnvError, match=r"e.reward_spec.ground_truth: expected a number, got nothing"
    ):
        check_reward_spec("e", {"method": "rule"})
    with pytest.raises(EnvError, match=r"e.reward_spec.ground_truth: .*got 'seven'"):
        check_reward_spec("e", {"method": "rule", "ground_truth": "seven"})
    with pytest.raises(EnvError, match=r"e.reward_spec: expected only .*got \['extra'\]"):
        check_reward_spec("e", {"method": "rule", "ground_truth": "1", "extra": 1})
    assert check_extra_info("e", None) == {}
    assert check_extra_info("e", {"index": 3}) == {"index": 3}
    with pytest.raises(EnvError, match=r"e.extra_info: expected a mapping or None"):
        check_extra_info("e", [1])
