"""One trajectory as the gym generator builds it, turn by turn: the tokens, their loss
mask and logprobs, and what travels with them (routes, the sampler's kept sets).

Why a trajectory stopped (``GeneratorOutput.stop_reasons``): the environment said done,
the turn limit, or the response token budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from skyrl_train.generators.traces import RoutedExpertTrace

STOP_DONE = "done"
STOP_MAX_TURNS = "max_turns"
STOP_BUDGET = "budget"


@dataclass
class Trajectory:
    index: int
    prompt_ids: list[int]
    call_key: tuple[int, int] = (0, 0)
    """(seed, generate call) its request seeds derive from, with its index and turn."""
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    reward: float = 0.0
    turn_rewards: dict[int, float] = field(default_factory=dict)
    """Each turn's environment reward at its reply's last token (a response position)."""
    turns: int = 0
    stop_reason: str = STOP_MAX_TURNS
    length_finishes: int = 0
    solved: bool | None = None
    """None until a step's metadata reports ``solved``; then True once any step did."""
    trace: RoutedExpertTrace | None = None
    routes: np.ndarray | None = None
    support: list[np.ndarray] | None = None
    """Per turn ``[n, k]`` kept-set rows aligned with the response tokens appended;
    None unless the run replays a top-k / top-p sampler."""
    postprocessed_turns: int = 0
    """Turns whose reply the environment replaced (``postprocessed_action``)."""
    versions: list[tuple[int, ...] | None] = field(default_factory=list)
    """Per turn, every policy version its reply's tokens came from (two or more when
    the reply spanned a weight push); None: the server sent none."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(
        self,
        ids: Sequence[int],
        *,
        mask: int,
        logprobs: Sequence[float] | None,
        support: np.ndarray | None = None,
    ) -> None:
        """``support``: the sampler's kept-set rows of generated ``ids`` (``[n, k]``);
        observation tokens get rows of -1."""
        if self.support is not None:
            width = self.support[0].shape[1] if self.support else 0
            if support is None:
                support = np.full((len(ids), width), -1, dtype=np.int32)
            self.support.append(support)
        self.response_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        if self.logprobs is not None:
            if logprobs is None:
                self.logprobs = None  # the engine sent none: the whole output has none
            else:
                self.logprobs.extend(logprobs)

    def score_turn(self, reward: float, *, at: int | None = None) -> None:
        """Add the reward of the reply just appended: to the total, and at its last token
        (``at``: another response position, the last sampled token of a replaced
        reply), so a per-turn estimator can credit each reply with its own outcome."""
        self.reward += reward
        at = len(self.response_ids) - 1 if at is None else at
        self.turn_rewards[at] = self.turn_rewards.get(at, 0.0) + reward

    def token_rewards(self) -> list[float]:
        """``[R]``: each turn's reward on its reply's last token, 0 elsewhere; they sum
        to ``reward``."""
        row = [0.0] * len(self.response_ids)
        for at, reward in self.turn_rewards.items():
            row[at] += reward
        return row

    def truncate(self, budget: int) -> None:
        """Cut ids, mask and logprobs to ``budget``; routes are cut in ``finalize``."""
        del self.response_ids[budget:], self.loss_mask[budget:]
        if self.logprobs is not None:
            del self.logprobs[budget:]
        if self.support is not None:
            self.support = [self.support_rows()[:budget]]

    def support_rows(self) -> np.ndarray:
        """``[R, k]``: every turn's kept-set rows, narrower turns padded with -1."""
        assert self.support is not None
        if not self.support:
            return np.full((len(self.response_ids), 0), -1, dtype=np.int32)
        width = max(rows.shape[1] for rows in self.support)
        return np.concatenate(
            [np.pad(r, ((0, 0), (0, width - r.shape[1])), constant_values=-1) for r in self.support]
        )
