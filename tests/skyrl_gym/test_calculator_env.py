"""The calculator environment: the safe evaluator, its limits, and episodes of tool use."""

from __future__ import annotations

import inspect
import random
import re
import statistics
import time

import pytest

import skyrl_gym
from skyrl_gym import EnvError
from skyrl_gym.envs import calculator
from skyrl_gym.envs.calculator import HINT, TOOL_HELP, find_call, run_tool

SPEC = {"method": "rule", "ground_truth": "84"}
PROMPT = [{"role": "user", "content": "What is 12 * 7?"}]


@pytest.mark.parametrize(
    ("expr", "shown"),
    [
        ("12*7", "84"),
        (" 12 * 7 ", "84"),
        ("1+2*3", "7"),
        ("(1+2)*3", "9"),
        ("7/2", "3.5"),
        ("1/3", "0.3333333333"),
        ("2/3", "0.6666666667"),
        ("-1/3", "-0.3333333333"),
        ("0.1+0.2", "0.3"),  # exact fractions: no 0.30000000000000004
        ("7//2", "3"),
        ("-7//2", "-4"),
        ("-7%3", "2"),
        ("7.5%2", "1.5"),
        ("2**10", "1024"),
        ("2^10", "1024"),  # calculators' power
        ("2**3**2", "512"),  # right-associative
        ("-2**2", "-4"),  # ** binds tighter than a unary minus on its left
        ("2**-1", "0.5"),
        ("(-2)**3", "-8"),
        ("--3", "3"),
        ("+3", "3"),
        ("3.", "3"),
        (".5*4", "2"),
        ("10**99", "1" + "0" * 99),
        ("(-1)**(10**99)", "1"),
        ("0**0", "1"),
        ("1/10**20", "0"),  # shown to 10 decimal places
    ],
)
def test_evaluator_results(expr: str, shown: str) -> None:
    assert run_tool(expr) == (shown, False)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("", "empty expression"),
        ("1 2", "unexpected '2'"),
        ("(1+2", "missing '\\)'"),
        ("1+", "expected a number, got end of expression"),
        ("*3", "expected a number, got '\\*'"),
        ("()", "expected a number, got '\\)'"),
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("1%0", "division by zero"),
        ("0**-1", "division by zero"),
        ("2**0.5", "only whole-number exponents"),
        ("x+1", "names are not allowed: 'x'"),
        ("1e5", "names are not allowed: 'e5'"),
        ("abs(-1)", "names are not allowed: 'abs'"),
        ("'a'*3", "unexpected character"),
        ("1;2", "unexpected character ';'"),
        ("[1]", "unexpected character '\\['"),
        ("10**100", "out of range"),
        ("9" * 101, "out of range"),
        ("0." + "0" * 100 + "1", "out of range"),
        ("(1/3)**-300", "out of range"),
    ],
)
def test_evaluator_errors_are_messages(expr: str, message: str) -> None:
    shown, failed = run_tool(expr)
    assert failed and re.search(message, shown) and shown.startswith("error: ")


SAFETY_CASES = {
    "power tower": ("9**9**9", "out of range"),
    "power of a power": ("(10**99)**(10**99)", "out of range"),
    "huge exponent": ("2**(2**300)", "out of range"),
    "import": ("__import__('os')", "names are not allowed: '__import__'"),
    "attribute": ("(1).__class__", "unexpected character '\\.'"),
    "dunder chain": ("().__class__.__bases__[0].__subclasses__()", "unexpected character '\\.'"),
    "lambda": ("(lambda: 1)()", "names are not allowed: 'lambda'"),
    "1000-deep parens": ("(" * 1000 + "1" + ")" * 1000, "longer than 200"),
    "99-deep parens": ("(" * 99 + "1" + ")" * 99, "nested deeper than 32"),
    "unary chain": ("-" * 199 + "1", "nested deeper than 32"),
    "right-assoc chain": ("2**" * 60 + "1", "nested deeper than 32"),
    "1 MB expression": ("1+" * 500_000 + "1", "longer than 200"),
    "long product": ("*".join(["99999"] * 33), "out of range"),
}


@pytest.mark.parametrize("name", sorted(SAFETY_CASES))
def test_hostile_expressions_are_error_observations_in_under_10_ms(name: str) -> None:
    expr, message = SAFETY_CASES[name]
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        shown, failed = run_tool(expr)
        timings.append(time.perf_counter() - start)
    assert failed and re.search(message, shown), shown
    # The median: one run can be descheduled on a shared CI box.
    assert statistics.median(timings) < 0.010, (name, timings)


def test_the_evaluator_never_hands_model_text_to_python() -> None:
    source = inspect.getsource(calculator)
    assert not re.search(r"(?<![\w.])(eval|exec|compile|__import__)\(", source)
    assert not re.search(r"^\s*(import ast|from ast )", source, re.M)


def test_find_call_takes_the_first_complete_call() -> None:
    assert find_call("<calc>1+1</calc> and <calc>2+2</calc>") == "1+1"
    assert find_call("<calc>1+1") is None
    assert find_call("1+1</calc>") is None
    assert find_call("x</calc><calc>3</calc>") == "3"
    start = time.perf_counter()
    assert find_call("<calc>" * 200_000) is None  # linear, not one rescan per tag
    assert time.perf_counter() - start < 0.1


def play(replies: list[str | bytes], **options):
    extras = {"reward_spec": SPEC, "extra_info": {"index": 3}}
    env = skyrl_gym.make("calculator", env_config=options or None, extras=extras)
    prompt, info = env.init(PROMPT)
    assert prompt == PROMPT and info == {}
    outs = []
    for reply in replies:
        outs.append(env.step(reply))
        if outs[-1]["done"]:
            break
    return env, outs


def test_call_then_answer_scores_one() -> None:
    env, outs = play(["Let me compute. <calc>12 * 7</calc>", "So the answer is\n#### 84"])
    assert outs[0]["observations"] == [{"role": "user", "content": "<result>84</result>"}]
    assert (outs[0]["reward"], outs[0]["done"]) == (0.0, False)
    assert (outs[1]["reward"], outs[1]["done"], outs[1]["observations"]) == (1.0, True, [])
    assert outs[1]["metadata"] == {
        "solved": True,
        "extracted": "84",
        "tool_calls": 1,
        "tool_errors": 0,
        "turn": 1,
    }


def test_errors_hints_and_wrong_answers() -> None:
    env, outs = play(["<calc>12 x 7</calc>", "I am not sure", "<calc>12*7</calc>", "#### 85"])
    assert (
        outs[0]["observations"][0]["content"]
        == "<result>error: names are not allowed: 'x'</result>"
    )
    assert outs[1]["observations"][0]["content"] == HINT
    assert outs[3]["done"] and outs[3]["reward"] == 0.0
    assert outs[3]["metadata"]["solved"] is False and outs[3]["metadata"]["extracted"] == "85"
    assert (outs[3]["metadata"]["tool_calls"], outs[3]["metadata"]["tool_errors"]) == (2, 1)


def test_an_answer_ends_the_episode_even_beside_a_call() -> None:
    env, outs = play(["<calc>12*7</calc> #### 84"])
    assert outs[0]["done"] and outs[0]["reward"] == 1.0 and outs[0]["metadata"]["tool_calls"] == 0
    env, outs = play(["\\boxed{84}"])
    assert outs[0]["done"] and outs[0]["reward"] == 1.0


def test_max_turns_ends_with_zero_unless_the_last_turn_answers() -> None:
    env, outs = play(["<calc>1</calc>"] * 10, max_turns=3)
    assert len(outs) == 3 and outs[-1]["done"] and outs[-1]["observations"] == []
    assert sum(o["reward"] for o in outs) == 0.0 and outs[-1]["metadata"]["tool_calls"] == 3
    env, outs = play(["<calc>12*7</calc>", "#### 84"], max_turns=2)
    assert outs[-1]["done"] and outs[-1]["reward"] == 1.0
    with pytest.raises(EnvError, match="after done"):
        env.step("#### 84")
    _, outs = play(["<calc>1/0</calc>"])
    assert outs[0]["metadata"]["tool_errors"] == 1


def test_bad_options_name_the_field() -> None:
    with pytest.raises(
        EnvError,
        match=r"^environment.skyrl_gym.calculator.max_turns: expected an int in \[1, 64\], got 0",
    ):
        skyrl_gym.make("calculator", env_config={"max_turns": 0}, extras={"reward_spec": SPEC})
    with pytest.raises(EnvError, match=r"^environment.skyrl_gym.calculator: expected settings"):
        skyrl_gym.make("calculator", env_config={"turns": 2}, extras={"reward_spec": SPEC})
    bad_method = {"reward_spec": {"method": "exact", "ground_truth": 1}}
    with pytest.raises(EnvError, match=r"calculator.reward_spec.method"):
        skyrl_gym.make("calculator", extras=bad_method)
    with pytest.raises(EnvError, match=r"calculator.reward_spec: expected a mapping"):
        skyrl_gym.make("calculator", extras={"reward_spec": None})


def test_sampled_tasks_explain_the_tool_and_a_tool_using_policy_solves_them() -> None:
    tasks = skyrl_gym.make_dataset("calculator", num_prompts=40, seed=0, difficulty=3)
    assert tasks == skyrl_gym.make_dataset("calculator", num_prompts=40, seed=0, difficulty=3)
    for task in tasks:
        assert task.prompt[0]["content"].endswith(TOOL_HELP)
        steps = task.env_extras["extra_info"]["solution"].splitlines()[:-1]
        env = skyrl_gym.make(
            task.env_name, env_config={"max_turns": len(steps) + 1}, extras=task.env_extras
        )
        env.init(task.prompt)
        for step in steps:  # compute each step with the tool, then answer with the result
            out = env.step(f"<calc>{step.split(' = ')[0]}</calc>")
            result = re.fullmatch(r"<result>(.*)</result>", out["observations"][0]["content"])
            assert result and result[1] == step.split(" = ")[1]
        out = env.step(f"#### {result[1]}")
        assert out["done"] and out["reward"] == 1.0 and out["metadata"]["tool_calls"] == len(steps)


def test_arbitrary_bytes_never_crash_and_rewards_stay_in_unit_range() -> None:
    rng = random.Random(0)
    alphabet = b"<calc>/</calc>####0123456789+-*/()%^. x\xff\n"
    for task in skyrl_gym.make_dataset("calculator", num_prompts=60, seed=1):
        env = skyrl_gym.make(task.env_name, extras=task.env_extras)
        env.init(task.prompt)
        done, total = False, 0.0
        while not done:
            if rng.random() < 0.5:
                reply = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
            else:
                reply = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
            out = env.step(b"<calc>" + reply + b"</calc>" if rng.random() < 0.3 else reply)
            total, done = total + out["reward"], out["done"]
            assert all(m["role"] == "user" for m in out["observations"])
        assert 0.0 <= total <= 1.0
