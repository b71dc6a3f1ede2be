"""The gym's exception tree has one root, ``EnvError``."""

from __future__ import annotations

import skyrl_gym
from skyrl_gym.envs.calculator import CalcError, run_tool
from tests.error_tree import exception_classes


def test_every_exception_derives_from_env_error() -> None:
    classes = exception_classes("skyrl_gym")
    assert {skyrl_gym.EnvError, CalcError} <= set(classes)
    assert [c for c in classes if not issubclass(c, skyrl_gym.EnvError)] == []


def test_a_calculator_error_still_never_leaves_the_tool() -> None:
    # A CalcError is an observation for the model, not an exception for the caller.
    assert run_tool("1/0") == ("error: division by zero", True)
