"""Multi-turn: the environment shows a letter, the reply should start with it; N turns.

Reward per turn (sums to at most 1 per episode): ``0.5 / N`` when the reply starts with
a lowercase ASCII letter, another ``0.5 / N`` when that letter is the one shown.
A random byte-level model starts with a lowercase letter about 26/264 = 10% of the
time, so the format credit appears in almost every GRPO group from step 0; copying the
letter just shown is a one-token lookback a tiny attention model can learn.

Observations: the next letter ("b") after a right reply, "no. b" after a wrong one.
"""

from __future__ import annotations

import random
import string
from typing import Any

from skyrl_gym.core import Env, Message, StepOutput, first_char
from skyrl_gym.errors import EnvError

ALPHABET = "abcdefgh"
"""Letters drawn for tasks; replies are judged against all 26 lowercase letters."""


class RepeatLetterEnv(Env):
    name = "repeat_letter"

    def __init__(self, *, letters: str) -> None:
        super().__init__()
        if (
            not isinstance(letters, str)
            or not 1 <= len(letters) <= 64
            or any(c not in string.ascii_lowercase for c in letters)
        ):
            raise EnvError(
                f"{self.name}.letters: expected 1-64 lowercase ASCII letters, got {letters!r}"
            )
        self.letters = letters
        self.max_turns = len(letters)
        self.all_correct = True

    def _step(self, action: str, turn: int) -> StepOutput:
        share = 1.0 / self.max_turns
        c = first_char(action)
        valid = len(c) == 1 and c in string.ascii_lowercase
        correct = valid and c == self.letters[turn]
        reward = (0.5 * share if valid else 0.0) + (0.5 * share if correct else 0.0)
        nxt = self.letters[turn + 1] if turn + 1 < self.max_turns else ""
        message = nxt if correct else f"no. {nxt}"
        self.all_correct = (turn == 0 or self.all_correct) and correct  # a new episode at turn 0
        # Solved: every letter repeated. Reported on every step (False until the last
        # one), so episodes cut short by the token budget count as unsolved.
        solved = self.all_correct and turn == self.max_turns - 1
        return StepOutput(
            [{"role": "user", "content": message}],
            reward,
            False,
            {"valid": valid, "correct": correct, "solved": solved},
        )

    @classmethod
    def sample_task(
        cls, rng: random.Random, *, turns: int = 3
    ) -> tuple[list[Message], dict[str, Any]]:
        letters = "".join(rng.choice(ALPHABET) for _ in range(turns))
        return [{"role": "user", "content": f"Repeat: {letters[0]}"}], {"letters": letters}
