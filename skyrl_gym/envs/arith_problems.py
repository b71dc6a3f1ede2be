"""Small arithmetic word problems with integer answers, GSM8K-shaped, generated locally.

``sample_problem(rng, difficulty=d)`` reads the generator only through ``randint`` and
``choice``, so the same ``random.Random`` state gives the same problem on every
platform and Python version. Difficulty 1 is one operation on small numbers, 2 adds a
second step, 3 uses larger numbers (big enough that a calculator tool pays off).
The solution reads like a GSM8K one: a line per step, then ``#### <answer>``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skyrl_gym.envs._checks import check_int

__all__ = ["DIFFICULTIES", "ArithProblem", "sample_problem"]

DIFFICULTIES = (1, 2, 3)
NAMES = ("Ava", "Ben", "Chen", "Dana", "Eli", "Farah", "Gus", "Hana", "Ivan", "Jo")
ITEMS = ("pencils", "stickers", "marbles", "cards")
FOODS = ("apples", "cookies", "plums", "muffins")


@dataclass(frozen=True)
class ArithProblem:
    question: str
    answer: int
    solution: str
    """Worked steps, one per line; the last line is ``#### <answer>``."""


def _scale(difficulty: int) -> int:
    """Upper bound of the operands: 10, 20, 400 (three-digit products at level 3)."""
    return {1: 10, 2: 20, 3: 400}[difficulty]


def _solution(steps: list[str], answer: int) -> str:
    return "\n".join([*steps, f"#### {answer}"])


def _bought_and_eaten(rng: random.Random, d: int) -> ArithProblem:
    name, food, top = rng.choice(NAMES), rng.choice(FOODS), _scale(d)
    if d == 1:
        bought = rng.randint(2, top)
        eaten = rng.randint(1, bought - 1)
        left = bought - eaten
        q = f"{name} buys {bought} {food} and eats {eaten} of them. How many {food} are left?"
        return ArithProblem(q, left, _solution([f"{bought} - {eaten} = {left}"], left))
    bags, per = rng.randint(2, 9), rng.randint(2, top)
    total = bags * per
    eaten = rng.randint(1, total - 1)
    q = (
        f"{name} buys {bags} bags with {per} {food} in each bag and eats {eaten} "
        f"{food}. How many {food} are left?"
    )
    steps = [f"{bags} * {per} = {total}", f"{total} - {eaten} = {total - eaten}"]
    return ArithProblem(q, total - eaten, _solution(steps, total - eaten))


def _price_times_quantity(rng: random.Random, d: int) -> ArithProblem:
    name, item, top = rng.choice(NAMES), rng.choice(ITEMS), _scale(d)
    price, count = rng.randint(1, top), rng.randint(2, 9 if d < 3 else 40)
    cost = price * count
    each = f"Each {item[:-1]} costs ${price}."
    q = f"{each} {name} buys {count} {item}. How many dollars does {name} spend?"
    steps = [f"{price} * {count} = {cost}"]
    if d == 1:
        return ArithProblem(q, cost, _solution(steps, cost))
    # Pays the smallest power of ten above the cost, so the change is never negative.
    bill = 10 ** len(str(cost))
    q = (
        f"{each} {name} buys {count} {item} and pays ${bill}. "
        f"How many dollars of change does {name} get?"
    )
    steps.append(f"{bill} - {cost} = {bill - cost}")
    return ArithProblem(q, bill - cost, _solution(steps, bill - cost))


def _share_equally(rng: random.Random, d: int) -> ArithProblem:
    name, item, top = rng.choice(NAMES), rng.choice(ITEMS), _scale(d)
    friends, each = rng.randint(2, 9), rng.randint(1, top)
    total = friends * each  # drawn as a product so the division is exact
    if d == 1:
        q = (
            f"{name} shares {total} {item} equally among {friends} friends. "
            f"How many {item} does each friend get?"
        )
        return ArithProblem(q, each, _solution([f"{total} / {friends} = {each}"], each))
    kept = rng.randint(1, top)
    q = (
        f"{name} has {total + kept} {item}, keeps {kept} and shares the rest equally "
        f"among {friends} friends. How many {item} does each friend get?"
    )
    steps = [f"{total + kept} - {kept} = {total}", f"{total} / {friends} = {each}"]
    return ArithProblem(q, each, _solution(steps, each))


def _weekly_savings(rng: random.Random, d: int) -> ArithProblem:
    name, top = rng.choice(NAMES), _scale(d)
    per_week, weeks = rng.randint(2, top), rng.randint(2, 12)
    saved = per_week * weeks
    if d == 1:
        q = f"{name} saves ${per_week} every week for {weeks} weeks. How many dollars does {name} save?"
        return ArithProblem(q, saved, _solution([f"{per_week} * {weeks} = {saved}"], saved))
    spent = rng.randint(1, saved - 1)
    q = (
        f"{name} saves ${per_week} every week for {weeks} weeks, then spends ${spent} on a "
        f"gift. How many dollars does {name} have left?"
    )
    steps = [f"{per_week} * {weeks} = {saved}", f"{saved} - {spent} = {saved - spent}"]
    return ArithProblem(q, saved - spent, _solution(steps, saved - spent))


TEMPLATES: tuple[Callable[[random.Random, int], ArithProblem], ...] = (
    _bought_and_eaten,
    _price_times_quantity,
    _share_equally,
    _weekly_savings,
)


def sample_problem(rng: random.Random, *, difficulty: int = 1) -> ArithProblem:
    """One problem drawn from ``rng``; the same generator state gives the same problem."""
    check_int("arith_problems.difficulty", difficulty, low=1, high=len(DIFFICULTIES))
    return rng.choice(TEMPLATES)(rng, difficulty)


def sample_graded(
    rng: random.Random, *, difficulty: int = 1
) -> tuple[ArithProblem, dict[str, Any]]:
    """A problem and the ``env_extras`` that grade it (``reward_spec``, ``extra_info``):
    what the gsm8k and calculator environments' ``sample_task`` return as extras."""
    problem = sample_problem(rng, difficulty=difficulty)
    extras = {
        "reward_spec": {"method": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"difficulty": difficulty, "solution": problem.solution},
    }
    return problem, extras
