"""The environment API: ``init(prompt) -> (observation, info)`` then ``step`` until done.

An episode's prompt and observations are chat messages (``{"role", "content"}``); the
generator renders each observation once and appends its tokens, so environments keep
observations to a few bytes (the tiny byte-level model pays one token per byte).
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any

from skyrl_gym.errors import EnvError

Message = dict[str, str]


@dataclass
class StepOutput:
    """What one ``step`` returns.

    ``observations`` are the messages to append (empty when ``done``); ``reward`` is
    this step's reward, the trajectory reward is the sum over steps.
    """

    observations: list[Message]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One dataset row: the prompt, and the keyword arguments for ``make(env_name, ...)``."""

    prompt: list[Message]
    env_name: str
    env_extras: dict[str, Any]
    data_source: str = ""
    """Where the row came from (a dataset row's ``data_source``; generated rows: the
    environment's name); metrics are also reported per source."""


def action_text(action: str | bytes) -> str:
    """The reply as text, whatever bytes a model produced.

    A byte-level model emits invalid UTF-8 freely; bytes decode with replacement so a
    reward parser never sees an exception, only U+FFFD characters that match nothing.
    """
    if isinstance(action, (bytes, bytearray, memoryview)):
        return bytes(action).decode("utf-8", errors="replace")
    if isinstance(action, str):
        return action
    return ""


def first_char(action: str | bytes) -> str:
    """The first non-whitespace character of the reply, or "" for an empty reply."""
    stripped = action_text(action).strip()
    return stripped[:1]


class Env(abc.ABC):
    """Base class: counts turns, refuses stepping a finished episode, clamps rewards.

    Subclasses implement ``_step(action, turn)``; ``turn`` counts from 0. They never
    raise on a bad action: it earns its reward (usually 0) and a short message.
    """

    name: str = "env"
    max_turns: int = 1

    def __init__(self) -> None:
        self.turn = 0
        self.done = False
        self.initialized = False

    def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
        """Start an episode from the dataset's prompt; returns the messages to render."""
        if not isinstance(prompt, list) or not all(
            isinstance(m, dict)
            and isinstance(m.get("content"), str)
            and isinstance(m.get("role"), str)
            for m in prompt
        ):
            raise EnvError(
                f"{self.name}.init(prompt): expected a list of {{'role', 'content'}} str "
                f"messages, got {prompt!r:.120}"
            )
        self.turn = 0
        self.done = False
        self.initialized = True
        return list(prompt), {"max_turns": self.max_turns}

    def step(self, action: str | bytes) -> StepOutput:
        if not self.initialized:
            raise EnvError(f"{self.name}.step: expected init() first, got a step before init")
        if self.done:
            raise EnvError(
                f"{self.name}.step: expected an unfinished episode, got step {self.turn} after done"
            )
        out = self._step(action_text(action), self.turn)
        self.turn += 1
        if self.turn >= self.max_turns:
            out.done = True
        if out.done:
            out.observations = []
            self.done = True
        out.metadata.setdefault("turn", self.turn - 1)
        return out

    @abc.abstractmethod
    def _step(self, action: str, turn: int) -> StepOutput: ...

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources; text environments hold none."""

    @classmethod
    def sample_task(cls, rng: random.Random) -> tuple[list[Message], dict[str, Any]]:
        """One seeded prompt and its ``env_extras``; used by ``skyrl_gym.make_dataset``."""
        raise EnvError(f"{cls.__name__}.sample_task: expected an implementation, got none")
