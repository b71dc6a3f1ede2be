"""The inference exception tree: one root, and every path error in one shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.client.limits import ReplyTooLarge
from inference.client.retry import RetryLater
from inference.engine.base import check_temperature
from inference.errors import (
    CheckpointFormatError,
    EngineStartError,
    GenerateError,
    GenerateProtocolError,
    InferenceError,
    RequestValidationError,
    WireError,
)
from inference.models.checkpoint import inspect_checkpoint
from inference.server.app import Overloaded
from inference.wire import pack_ndarray, unpack_ndarray
from tests.error_tree import exception_classes

PATH_ERRORS = (WireError, GenerateProtocolError, RequestValidationError, CheckpointFormatError)


def test_every_exception_derives_from_the_root() -> None:
    classes = exception_classes("inference")
    # The scan reaches the classes defined outside errors.py too.
    assert {ReplyTooLarge, RetryLater, Overloaded, WireError, GenerateError} <= set(classes)
    assert EngineStartError in classes
    assert [c for c in classes if not issubclass(c, InferenceError)] == []


def test_retry_semantics_are_kept_under_the_root() -> None:
    # Deterministic errors stay ValueErrors (never retried); transport ones do not.
    for cls in PATH_ERRORS + (ReplyTooLarge,):
        assert issubclass(cls, ValueError)
    for cls in (GenerateError, RetryLater, Overloaded, EngineStartError):
        assert not issubclass(cls, ValueError)


@pytest.mark.parametrize("cls", PATH_ERRORS)
def test_path_errors_read_path_expected_got(cls: type[WireError]) -> None:
    path = "$.choices[3].routed_experts.shape"
    err = cls(path, "2 dims", [1, 2, 3])
    assert (err.path, err.expected, err.got) == (path, "2 dims", [1, 2, 3])
    assert str(err) == f"{path}: expected 2 dims, got [1, 2, 3]"
    assert not hasattr(err, "field")


def _raised(tmp_path: Path) -> list[Any]:
    errors: list[Any] = [ReplyTooLarge(10, 20, declared=True)]
    env = pack_ndarray(np.zeros((2, 3), dtype=np.int32), allowed_dtypes=["int32"])
    for call in (
        lambda: unpack_ndarray(env, allowed_dtypes=["int32"], ndim=3, path="$.x"),
        lambda: check_temperature(-1.0, field="$.sampling_params.temperature"),
        lambda: inspect_checkpoint(tmp_path / "absent"),
    ):
        with pytest.raises(InferenceError) as info:
            call()
        errors.append(info.value)
    return errors


def test_raised_path_errors_lead_with_their_path(tmp_path: Path) -> None:
    errors = _raised(tmp_path)
    paths = ["$", "$.x.shape", "$.sampling_params.temperature", "folder"]
    assert [e.path for e in errors] == paths
    for err in errors:
        assert str(err).startswith(f"{err.path}: expected "), err


def test_engine_start_errors_carry_the_server_log() -> None:
    err = EngineStartError("vLLM server: expected /health", log_tail="a\nb", log_path="/l")
    assert (err.log_tail, err.log_path) == ("a\nb", "/l")
    assert str(err) == "vLLM server: expected /health\n--- last log lines (/l) ---\na\nb"
    assert str(EngineStartError("no log")) == "no log"
