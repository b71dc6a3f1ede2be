"""The gym's exception tree has one root, SkyRL's ``skyrl_gym.error.Error``."""

from __future__ import annotations

import skyrl_gym
from skyrl_gym.envs.calculator import CalcError, run_tool
from tests.error_tree import exception_classes


def test_every_exception_derives_from_the_root() -> None:
    classes = exception_classes("skyrl_gym")
    assert {skyrl_gym.error.Error, skyrl_gym.EnvError, CalcError} <= set(classes)
    assert [c for c in classes if not issubclass(c, skyrl_gym.error.Error)] == []
    # Caller mistakes are ValueErrors (and make's kwargs TypeErrors), as SkyRL raises.
    assert issubclass(skyrl_gym.EnvError, ValueError)
    assert issubclass(skyrl_gym.error.EnvTypeError, TypeError)
    assert issubclass(skyrl_gym.error.RegistrationError, skyrl_gym.EnvError)


def test_a_calculator_error_still_never_leaves_the_tool() -> None:
    # A CalcError is an observation for the model, not an exception for the caller.
    assert run_tool("1/0") == ("error: division by zero", True)
