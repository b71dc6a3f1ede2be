"""The aime environment: where the ground truth comes from, Minerva-rule and strict-box
scoring, and replies that must never raise."""

from __future__ import annotations

import random
import time

import pytest
from omegaconf import DictConfig

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs.aime import AIMEEnv
from skyrl_gym.envs.aime.utils import (
    compute_score,
    last_boxed_only_string,
    normalize_final_answer,
    remove_boxed,
)


def play(reply: str | bytes, truth: str | int = "42", **config) -> tuple[float, dict]:
    """One turn of an env built as ``make`` builds it from an AIME row."""
    env = skyrl_gym.make(
        "aime",
        env_config=DictConfig({"env_class": "aime", **config}),
        extras={"reward_model": {"method": "rule", "ground_truth": truth}},
    )
    out = env.step(reply)
    assert out["done"] and out["observations"] == []
    return out["reward"], out["metadata"]


@pytest.mark.parametrize(
    ("reply", "truth", "expected", "pred"),
    [
        ("Answer: \\boxed{42}", "42", 1.0, "42"),
        ("Answer: 42", "42", 1.0, "42"),
        ("answer :  42 ", "42", 1.0, "42"),  # case and spacing do not matter
        ("Answer: 41\nOn reflection... Answer: 42", "42", 1.0, "42"),  # the last one counts
        ("Answer: \\boxed{43}", "42", -1.0, "43"),
        ("\\boxed{42}", "42", -1.0, None),  # SkyRL's rule: no "Answer:", no answer
        ("The result is 42.", "42", -1.0, None),
        ("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
        ("Answer: $\\frac12$", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),  # shorthand braced
        ("Answer: \\boxed{0.5}", "\\frac{1}{2}", -1.0, "0.5"),  # no numeric equivalence
        ("Answer: \\boxed{\\text{forty-two}}", "42", -1.0, "forty-two"),
        ("Answer: 1,000", "1000", 1.0, "1000"),
        ("Answer: x = 42", "42", 1.0, "42"),
        ("Answer: 90^\\circ", "90", 1.0, "90"),
        ("Answer: 5 square feet", "5", 1.0, "5"),
        ("Answer: 12\\text{ cm}^2", "12", 1.0, "12"),
        ("Answer: \\$30 dollars", "30", 1.0, "30"),
        ("Answer: 4 ways", "4", 1.0, "4"),
        ("Answer: 42", 42, 1.0, "42"),  # an int ground truth, as some datasets store it
        # End-of-sequence tokens: a "<" ends the answer, a mangled token stays in it.
        ("<|im_start|>Answer: \\boxed{42}<|im_end|>", "42", 1.0, "42"),
        ("<|im_start|>Answer: \\boxed{42}im_end|>", "42", -1.0, "42im_end|>"),
        ("Answer: \\boxed{42}<|eot_id|>", "42", 1.0, "42"),
        ("Answer: \\boxed{42}|eot_id|>", "42", -1.0, "42|eot_id|>"),
    ],
)
def test_minerva_rule(reply: str, truth: str | int, expected: float, pred: str | None) -> None:
    reward, metadata = play(reply, truth)
    assert reward == expected
    assert metadata["acc"] is metadata["solved"] is (expected == 1.0)
    assert metadata["pred"] == pred


def test_only_the_last_300_characters_are_read() -> None:
    assert play("Answer: 42" + " filler" * 50)[0] == -1.0  # the answer was cut off
    assert play("x" * 10_000 + "Answer: 42")[0] == 1.0


@pytest.mark.parametrize(
    ("reply", "truth", "acc", "pred"),
    [
        ("so the answer is \\boxed{42}", "42", True, "42"),
        ("\\boxed{41} no wait \\boxed{42}", "42", True, "42"),
        ("\\boxed{ 42}", "42", False, " 42"),  # verbatim: no normalization
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
        ("Answer: 42", "42", False, None),  # no box
        ("\\boxed{42}" + "." * 100, "42", False, None),  # box too far from the end
        ("\\boxed{42", "42", False, None),  # never closes
    ],
)
def test_strict_box_mode(reply: str, truth: str, acc: bool, pred: str | None) -> None:
    assert compute_score(reply, truth, strict_box_verify=True) == {
        "score": 1.0 if acc else -1.0,
        "acc": acc,
        "pred": pred,
    }
    assert play(reply, truth, strict_box_verify=True)[1]["acc"] is acc


def test_strict_box_window_ends_before_the_last_pause_token() -> None:
    reply = "\\boxed{42}" + "p" * 150
    assert compute_score(reply, "42", True)["acc"] is False
    assert compute_score(reply, "42", True, pause_tokens_index=[1, 2, 3, 100])["acc"] is True
    for bad in ([1, 2, 3], "1234", [1, 2, 3, "4"], [True, 2, 3, 4]):
        with pytest.raises(EnvError, match="aime.pause_tokens_index"):
            compute_score(reply, "42", True, pause_tokens_index=bad)


def test_ground_truth_sources() -> None:
    spec = {"method": "rule", "ground_truth": "7"}
    assert AIMEEnv(extras={"reward_spec": spec}).ground_truth == "7"
    both = {"reward_model": {"ground_truth": "3"}, "reward_spec": spec}
    assert AIMEEnv(extras=both).ground_truth == "3"  # SkyRL's field wins
    assert AIMEEnv(extras={"reward_model": {"ground_truth": 12}}).ground_truth == "12"


@pytest.mark.parametrize(
    ("extras", "field"),
    [
        ({}, "aime.extras.reward_model.ground_truth"),
        (None, "aime.extras.reward_model.ground_truth"),
        ({"reward_model": {"method": "rule"}}, "aime.extras.reward_model.ground_truth"),
        ({"reward_model": "42"}, "aime.extras.reward_model.ground_truth"),
        ({"reward_spec": {"ground_truth": None}}, "aime.extras.reward_spec.ground_truth"),
        ({"reward_spec": {"ground_truth": 4.5}}, "aime.extras.reward_spec.ground_truth"),
        ({"reward_spec": {"ground_truth": True}}, "aime.extras.reward_spec.ground_truth"),
        ({"reward_model": {"ground_truth": "  "}}, "aime.extras.reward_model.ground_truth"),
        ("not a mapping", "aime.extras"),
    ],
)
def test_missing_or_bad_ground_truth_names_the_field(extras, field: str) -> None:
    with pytest.raises(EnvError, match=field.replace(".", r"\.")):
        AIMEEnv(extras=extras)


def test_bad_setting_names_it() -> None:
    with pytest.raises(EnvError, match=r"environment\.skyrl_gym\.aime\.strict_box_verify"):
        play("Answer: 42", strict_box_verify="yes")


def test_one_step_per_episode() -> None:
    env = AIMEEnv(extras={"reward_model": {"ground_truth": "42"}})
    assert env.step("Answer: 42")["reward"] == 1.0
    with pytest.raises(EnvError, match="aime.step"):
        env.step("Answer: 42")


def test_helpers() -> None:
    assert last_boxed_only_string("\\boxed{1} and \\boxed{\\frac{2}{3}} end") == (
        "\\boxed{\\frac{2}{3}}"
    )
    assert last_boxed_only_string("\\boxed{1} \\boxed{{2}") is None
    assert last_boxed_only_string("no box") is None
    assert remove_boxed("\\boxed{x}") == "x"
    with pytest.raises(ValueError, match="remove_boxed"):
        remove_boxed("\\fbox{x}")
    assert normalize_final_answer("The total is $1,234.$") == "1234"
    assert normalize_final_answer("\\text{(B)}") == "(B)"
    assert normalize_final_answer("\\overline{AB}") == "AB"
    assert normalize_final_answer("\\sqrt2") == "\\sqrt{2}"


def _random_reply(rng: random.Random) -> str | bytes:
    pieces = ["Answer:", "\\boxed{", "{", "}", "$", "=", "<|im_end|>", "\n", "\\text{", "frac"]
    kind = rng.randrange(3)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
    if kind == 1:
        return "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randrange(200)))
    return "".join(rng.choice(pieces) for _ in range(rng.randrange(60)))


def test_fuzzed_replies_never_raise() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        reply = _random_reply(rng)
        for strict in (False, True):
            reward, metadata = play(reply, "\\frac{1}{2}", strict_box_verify=strict)
            assert reward in (1.0, -1.0)
            assert metadata["pred"] is None or isinstance(metadata["pred"], str)
    for odd in (None, 42, ["Answer: 42"], "\ud800", "Answer: \\boxed{" * 50, "}" * 400):
        assert play(odd)[0] == -1.0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text",
    ["\\text{" * 200_000, "$" + "x" * 1_000_000, "\\boxed{" * 150_000, "{" * 1_000_000],
    ids=["unclosed-text", "one-dollar", "unclosed-boxes", "open-braces"],
)
def test_megabyte_inputs_take_linear_time(text: str) -> None:
    start = time.perf_counter()
    assert play(text)[0] == -1.0
    normalize_final_answer(text)  # a ground truth is not cut, so this must be linear too
    last_boxed_only_string(text)
    assert time.perf_counter() - start < 2.0
