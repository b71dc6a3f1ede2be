"""Keyword-argument checks shared by the built-in environments."""

from __future__ import annotations

from typing import Any

from skyrl_gym.errors import EnvError


def check_int(env: str, name: str, value: Any, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EnvError(f"{env}.{name}: expected an int in [{low}, {high}], got {value!r}")
    return value


def check_fraction(env: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise EnvError(f"{env}.{name}: expected a number in [0, 1], got {value!r}")
    return float(value)
