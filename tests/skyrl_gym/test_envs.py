"""Environments: rewards, robustness to arbitrary bytes, the registry and datasets."""

from __future__ import annotations

import random

import pytest

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs.base_text_env import BaseTextEnvStepOutput

PROMPT = [{"role": "user", "content": "x"}]


def run(
    env_name: str, replies: list[str | bytes], *, config: dict | None = None, **extras
) -> tuple[float, list[BaseTextEnvStepOutput]]:
    env = skyrl_gym.make(env_name, env_config=config, extras=extras)
    env.init(PROMPT)
    outs = []
    for reply in replies:
        outs.append(env.step(reply))
        if outs[-1]["done"]:
            break
    return sum(o["reward"] for o in outs), outs


def test_builtin_envs_refuse_bad_extras_naming_the_field():
    assert {"guess_number", "repeat_letter", "single_digit_sum"} <= set(skyrl_gym.registered())
    with pytest.raises(EnvError, match=r"^guess_number.extras.target: expected an int in"):
        skyrl_gym.make("guess_number", extras={"target": 12})
    with pytest.raises(EnvError, match=r"^guess_number.extras.target: expected a value"):
        skyrl_gym.make("guess_number", extras={})
    with pytest.raises(EnvError, match=r"^single_digit_sum.extras.a\+b: expected a one-digit"):
        skyrl_gym.make("single_digit_sum", extras={"a": 5, "b": 7})
    with pytest.raises(EnvError, match=r"^environment.skyrl_gym.guess_number.max_turns"):
        skyrl_gym.make("guess_number", env_config={"max_turns": 0}, extras={"target": 1})
    with pytest.raises(EnvError, match=r"^repeat_letter.extras.letters: expected 1-64"):
        skyrl_gym.make("repeat_letter", extras={"letters": "ABC"})


def test_guess_number_rewards_format_and_solving():
    # Solving on turn 0 with a digit: the full 1.0.
    total, outs = run("guess_number", ["7"], target=7)
    assert total == pytest.approx(1.0) and outs[-1]["done"] and outs[-1]["observations"] == []
    # Solving on turn 2 after two well-formed wrong guesses: still 1.0.
    total, outs = run("guess_number", ["2", "9", "7 is it"], target=7)
    assert [o["observations"][0]["content"] for o in outs[:2]] == ["higher", "lower"]
    assert total == pytest.approx(1.0)
    # A bad reply earns 0 and a message; solving after it loses that turn's credit.
    total, outs = run("guess_number", ["hello", "7"], target=7)
    assert outs[0]["observations"] == [{"role": "user", "content": "digit?"}]
    assert total == pytest.approx(1.0 - 0.5 / 3)
    # Every step reports `solved` (the success rate counts bad-reply episodes too).
    assert [(o["metadata"]["valid"], o["metadata"]["solved"]) for o in outs] == [
        (False, False),
        (True, True),
    ]
    # Never solving, all well formed: format credit only, done at max_turns.
    total, outs = run("guess_number", ["0", "0", "0", "0"], target=7, config={"max_turns": 4})
    assert total == pytest.approx(0.5) and outs[-1]["done"] and len(outs) == 4


def test_repeat_letter_rewards_per_turn_and_feedback():
    total, outs = run("repeat_letter", ["a", "b!", "c"], letters="abc")
    assert total == pytest.approx(1.0)
    assert [o["observations"] for o in outs[:2]] == [
        [{"role": "user", "content": "b"}],
        [{"role": "user", "content": "c"}],
    ]
    total, outs = run("repeat_letter", ["z", "9", "c"], letters="abc")
    assert total == pytest.approx(1 / 3)  # a wrong letter earns nothing, only the right one
    assert [o["reward"] for o in outs] == [0.0, 0.0, pytest.approx(1 / 3)]
    assert [o["metadata"]["valid"] for o in outs] == [True, False, True]
    assert outs[0]["observations"][0]["content"] == "no. b" and outs[-1]["done"]
    assert [o["metadata"]["solved"] for o in outs] == [False, False, False]


def test_repeat_letter_format_credit_pays_any_letter_and_keeps_the_total_at_one():
    total, outs = run(
        "repeat_letter", ["z", "9", "c"], letters="abc", config={"format_credit": 0.5}
    )
    assert [o["reward"] for o in outs] == [
        pytest.approx(0.5 / 3),  # a letter, the wrong one
        0.0,  # not a letter
        pytest.approx(1 / 3),  # the right letter: format and correctness
    ]
    assert run("repeat_letter", ["a", "b", "c"], letters="abc", config={"format_credit": 0.3})[
        0
    ] == (pytest.approx(1.0))
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(
            EnvError,
            match=r"^environment.skyrl_gym.repeat_letter.format_credit: expected a number in "
            r"\[0, 1\], got",
        ):
            skyrl_gym.make(
                "repeat_letter", env_config={"format_credit": bad}, extras={"letters": "abc"}
            )


def test_repeat_letter_is_solved_only_when_every_letter_was_repeated():
    _, outs = run("repeat_letter", ["a", "b", "c"], letters="abc")
    assert [o["metadata"]["solved"] for o in outs] == [False, False, True]
    _, outs = run("repeat_letter", ["x", "b", "c"], letters="abc")
    assert [o["metadata"]["solved"] for o in outs] == [False, False, False]


def test_single_digit_sum_is_single_turn():
    assert run("single_digit_sum", ["7"], a=3, b=4)[0] == 1.0
    assert run("single_digit_sum", ["8"], a=3, b=4)[0] == 0.5
    total, outs = run("single_digit_sum", ["x7"], a=3, b=4)
    assert total == 0.0 and outs[0]["done"] and outs[0]["observations"] == []


@pytest.mark.parametrize("name", ["guess_number", "repeat_letter", "single_digit_sum"])
def test_arbitrary_bytes_never_crash_and_rewards_stay_in_unit_range(name):
    rng = random.Random(0)
    tasks = skyrl_gym.make_dataset(name, num_prompts=40, seed=3)
    totals = []
    for task in tasks:
        env = skyrl_gym.make(task.env_name, extras=task.env_extras)
        env.init(task.prompt)
        total, done = 0.0, False
        while not done:
            reply = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 6)))
            out = env.step(reply)
            total, done = total + out["reward"], out["done"]
        totals.append(total)
        with pytest.raises(EnvError, match="after done"):
            env.step("1")
    assert all(0.0 <= t <= 1.0 + 1e-9 for t in totals)
    for reply in (b"", b"\xff\xfe", b"\x00", "\ufffd", "   ", None):
        env = skyrl_gym.make(tasks[0].env_name, extras=tasks[0].env_extras)
        env.init(tasks[0].prompt)
        assert env.step(reply)["reward"] == 0.0


@pytest.mark.parametrize("name", ["guess_number", "repeat_letter", "single_digit_sum"])
def test_a_random_byte_policy_scores_sometimes_and_a_perfect_one_scores_one(name):
    """The learnable-signal check: random replies score > 0 on average, the right ones 1."""
    tasks = skyrl_gym.make_dataset(name, num_prompts=200, seed=0)
    rng = random.Random(1)
    random_total = perfect_total = 0.0
    for task in tasks:
        for policy in ("random", "perfect"):
            env = skyrl_gym.make(task.env_name, extras=task.env_extras)
            env.init(task.prompt)
            done, total = False, 0.0
            while not done:
                if policy == "random":
                    reply = bytes([rng.randrange(264) % 256])  # a 264-token byte model
                elif name == "guess_number":
                    reply = str(env.target)
                elif name == "repeat_letter":
                    reply = env.letters[env.turns]
                else:
                    reply = str(env.a + env.b)
                out = env.step(reply)
                total, done = total + out["reward"], out["done"]
            if policy == "random":
                random_total += total
            else:
                perfect_total += total
    assert perfect_total == pytest.approx(len(tasks))
    # repeat_letter's floor: a random byte hits the shown letter 1/264 of the time.
    assert 0.002 < random_total / len(tasks) < 0.3


def test_datasets_are_seeded_and_prompts_match_extras():
    a = skyrl_gym.make_dataset("single_digit_sum", num_prompts=20, seed=5)
    assert a == skyrl_gym.make_dataset("single_digit_sum", num_prompts=20, seed=5)
    assert a != skyrl_gym.make_dataset("single_digit_sum", num_prompts=20, seed=6)
    for task in a:
        assert task.prompt[0]["content"] == f"{task.env_extras['a']}+{task.env_extras['b']}="
    letters = skyrl_gym.make_dataset("repeat_letter", num_prompts=5, seed=0, turns=4)
    assert all(len(t.env_extras["letters"]) == 4 for t in letters)
    assert all(t.prompt[0]["content"].endswith(t.env_extras["letters"][0]) for t in letters)
    with pytest.raises(EnvError, match="num_prompts: expected an int >= 0, got -1"):
        skyrl_gym.make_dataset("guess_number", num_prompts=-1, seed=0)


def test_a_step_after_the_episode_ended_raises_and_init_returns_the_prompt():
    env = skyrl_gym.make("guess_number", extras={"target": 1})
    prompt, info = env.init(PROMPT)
    assert prompt == PROMPT and info == {}
    assert env.step("1")["done"]
    with pytest.raises(EnvError, match=r"^guess_number.step: expected an unfinished episode"):
        env.step("1")
    # SkyRL's tests step without init(): the built-ins allow it too.
    assert skyrl_gym.make("single_digit_sum", extras={"a": 1, "b": 2}).step("3")["reward"] == 1.0
