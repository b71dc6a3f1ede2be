"""Single-turn: "3+4=" — reply with the one-digit sum.

Reward: 0.5 when the reply starts with a digit, another 0.5 when it is the sum.
Operands are drawn so the sum stays below 10; a random byte-level model starts with a
digit about 3.8% of the time and is then right 1 time in 10.
"""

from __future__ import annotations

import random
from typing import Any

from skyrl_gym.core import Env, Message, StepOutput, first_char
from skyrl_gym.envs._checks import check_int
from skyrl_gym.errors import EnvError


class SingleDigitSumEnv(Env):
    name = "single_digit_sum"
    max_turns = 1

    def __init__(self, *, a: int, b: int) -> None:
        super().__init__()
        self.a = check_int(self.name, "a", a, low=0, high=9)
        self.b = check_int(self.name, "b", b, low=0, high=9)
        if a + b > 9:
            raise EnvError(f"{self.name}.a+b: expected a one-digit sum (<= 9), got {a + b}")

    def _step(self, action: str, turn: int) -> StepOutput:
        c = first_char(action)
        valid = len(c) == 1 and "0" <= c <= "9"
        correct = valid and int(c) == self.a + self.b
        reward = (0.5 if valid else 0.0) + (0.5 if correct else 0.0)
        return StepOutput([], reward, True, {"valid": valid, "correct": correct})

    @classmethod
    def sample_task(cls, rng: random.Random) -> tuple[list[Message], dict[str, Any]]:
        a = rng.randrange(10)
        b = rng.randrange(10 - a)
        return [{"role": "user", "content": f"{a}+{b}="}], {"a": a, "b": b}
