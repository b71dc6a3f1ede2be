"""Multi-turn: guess a hidden digit; each wrong guess is answered "higher" or "lower".

Reward (sums to at most 1 per episode):
- format: each turn whose reply starts with a digit earns ``0.5 / max_turns``;
- correctness: the right digit earns 0.5 plus the format credit of the turns it saved,
  so solving on any turn with well-formed replies scores exactly 1.0.

Why this shape: a random byte-level model (264 tokens) starts a reply with a digit
about 10/264 = 3.8% of the time per turn, so a GRPO group of 8 three-turn episodes
usually holds a nonzero reward; the format credit is then learnable within a few
steps, and correctness follows from guessing digits at all (a 1/10 chance per turn).
"""

from __future__ import annotations

import random
from typing import Any

from skyrl_gym.core import Env, Message, StepOutput, first_char
from skyrl_gym.envs._checks import check_int

PROMPT = "Guess my digit (0-9)."
NOT_A_DIGIT = "digit?"


class GuessNumberEnv(Env):
    name = "guess_number"

    def __init__(self, *, target: int, max_turns: int = 3) -> None:
        super().__init__()
        self.target = check_int(self.name, "target", target, low=0, high=9)
        self.max_turns = check_int(self.name, "max_turns", max_turns, low=1, high=64)

    def _step(self, action: str, turn: int) -> StepOutput:
        credit = 0.5 / self.max_turns
        c = first_char(action)
        if not (len(c) == 1 and "0" <= c <= "9"):
            return StepOutput(
                [{"role": "user", "content": NOT_A_DIGIT}],
                0.0,
                False,
                # Every step says whether the episode is solved, so an episode of only
                # bad replies still counts (as unsolved) in the success rate.
                {"valid": False, "solved": False},
            )
        guess = int(c)
        if guess == self.target:
            saved = self.max_turns - turn - 1
            return StepOutput(
                [], credit + 0.5 + saved * credit, True, {"valid": True, "solved": True}
            )
        hint = "higher" if guess < self.target else "lower"
        return StepOutput(
            [{"role": "user", "content": hint}], credit, False, {"valid": True, "solved": False}
        )

    @classmethod
    def sample_task(cls, rng: random.Random) -> tuple[list[Message], dict[str, Any]]:
        return [{"role": "user", "content": PROMPT}], {"target": rng.randrange(10)}
