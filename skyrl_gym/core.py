"""The environment API, in SkyRL's shape: ``init(prompt) -> (observations, info)``,
``step(action) -> {observations, reward, done, metadata}``, ``close()``.

``Env`` is SkyRL's root class (``skyrl_gym.Env``); text environments subclass
``skyrl_gym.envs.base_text_env.BaseTextEnv``. An episode's prompt and observations are
chat messages (``{"role", "content"}``); the generator renders each observation once
and appends its tokens, so environments keep observations short (the tiny byte-level
model pays one token per byte).

Added here, on top of SkyRL's API: ``Task`` (one dataset row), and ``action_text`` /
``first_char`` for parsing replies a byte-level model may have made invalid UTF-8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

ObsType = TypeVar("ObsType")
ActType = TypeVar("ActType")
Message = dict[str, str]


class Env(Generic[ObsType, ActType]):
    """SkyRL's base environment: ``init`` before the first ``step``, ``close`` at the end.

    ``make`` accepts only instances of this class (SkyRL's rule), and sets ``spec``."""

    spec: Any = None
    """The ``EnvSpec`` ``make`` built this environment from (None when built directly)."""

    def step(self, action: ActType) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.step")

    def init(self, *args: Any) -> tuple[ObsType, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.init")

    def close(self) -> None:  # noqa: B027 - optional hook, SkyRL's default does nothing
        """Release resources (database connections, processes); idempotent."""

    def __str__(self) -> str:
        return f"Env({type(self).__name__})"

    def __enter__(self) -> Env[ObsType, ActType]:
        return self

    def __exit__(self, *args: Any) -> None:
        self.close()


@dataclass(frozen=True)
class Task:
    """One dataset row: the prompt, and what ``make(env_name, env_config=...,
    extras=env_extras)`` gets for it."""

    prompt: list[Message]
    env_name: str
    env_extras: dict[str, Any]
    """The row's fields other than ``prompt`` and ``env_class`` (SkyRL's ``extras``:
    ``reward_spec``, ``extra_info``, ``max_turns``, ...), or a generated task's own."""
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
