"""Every exception of both trees survives pickling with its message and attributes.

Ray sends an exception raised in an actor (a trainer rank, an engine actor) to the
caller pickled; exceptions pickle as ``cls(*args)`` by default, which a constructor
with several arguments or keyword-only options cannot take, so a rank's
``ConfigValidationError`` reached the driver as Ray's ``UnserializableException`` and
``except SkyRLTrainError`` missed it. A real actor's raise is checked in
``tests/skyrl_train/utils/test_ray_session.py`` (on the Ray that test starts anyway).
"""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from inference.errors import GenerateHTTPError
from tests.error_tree import exception_classes

_VALUES: dict[str, Any] = {
    "file": Path("/tmp/a.bin"),
    "row": 3,
    "step": 7,
    "policy_version": 2,
    "status": 422,
    "cap": 10,
    "received": 20,
    "declared": True,
    "stopped": [("engine 0", "exit 1", "tail", None)],
    "retry_after_s": 1.5,
}


def _instance(cls: type[BaseException]) -> BaseException:
    """``cls`` built through its own constructor, every argument given a value."""
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not params:
        return cls("a message")
    if "final" in {p.name for p in params}:
        return cls(GenerateHTTPError(503, "busy"), 1.5)  # type: ignore[call-arg]
    args, kwargs = [], {}
    for p in params:
        value = _VALUES.get(p.name, f"<{p.name}>")
        if p.name in ("reason",) and "expected" in {q.name for q in params}:
            continue  # one of the two forms: expected/got given below
        if p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = value
        else:
            args.append(value)
    return cls(*args, **kwargs)


CLASSES = exception_classes("skyrl_train") + exception_classes("inference")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__name__}")
@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps], ids=["pickle", "cloudpickle"])
def test_every_exception_round_trips_through_pickle(cls: type[BaseException], dumps: Any) -> None:
    err = _instance(cls)
    back = pickle.loads(dumps(err))
    assert type(back) is cls
    assert str(back) == str(err) and back.args == err.args
    assert vars(back).keys() == vars(err).keys()
    for name, value in vars(err).items():
        if isinstance(value, BaseException):
            assert type(getattr(back, name)) is type(value) and str(getattr(back, name)) == str(
                value
            )
        else:
            assert getattr(back, name) == value, name
