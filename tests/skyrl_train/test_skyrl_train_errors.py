"""The training exception tree: one root, and every config-key error led by ``path``."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyrl_train.dataset.prompts import read_rows
from skyrl_train.errors import (
    CheckpointError,
    ConfigValidationError,
    DatasetError,
    SkyRLTrainError,
)
from skyrl_train.runs.checkpoint import verify_checkpoint
from skyrl_train.utils.tracking import check_trackers
from tests.error_tree import exception_classes


def test_every_exception_derives_from_the_root_and_stays_a_value_error() -> None:
    classes = exception_classes("skyrl_train")
    assert {ConfigValidationError, DatasetError, CheckpointError} <= set(classes)
    assert [c for c in classes if not issubclass(c, SkyRLTrainError)] == []
    # Every refusal is bad data or configuration: ``except ValueError`` callers keep working.
    assert [c for c in classes if c is not SkyRLTrainError and not issubclass(c, ValueError)] == []


def test_config_errors_read_path_expected_got() -> None:
    err = ConfigValidationError("trainer.epochs", expected="an int >= 1", got="0")
    assert (err.path, err.reason) == ("trainer.epochs", "expected an int >= 1, got 0")
    assert str(err) == "trainer.epochs: expected an int >= 1, got 0"
    with pytest.raises(ConfigValidationError) as info:
        check_trackers(["jsonl", "no_such_tracker"])
    assert info.value.path == "logging.trackers[1]"
    assert str(info.value).startswith("logging.trackers[1]: expected ")
    assert not hasattr(err, "key")


def test_file_errors_name_the_key_then_the_file(tmp_path: Path) -> None:
    # ``path`` is the config key, ``file`` the file it points at: path: file: expected.
    rows = tmp_path / "rows.jsonl"
    rows.write_text("[1]\n")
    with pytest.raises(DatasetError) as data:
        read_rows(rows, key="data.train_data[0]")
    assert (data.value.path, data.value.file, data.value.row) == ("data.train_data[0]", rows, 0)
    assert str(data.value) == f"data.train_data[0]: {rows} row 0: expected a JSON object, got list"
    with pytest.raises(CheckpointError) as ckpt:
        verify_checkpoint(tmp_path / "absent")
    assert (ckpt.value.path, ckpt.value.file) == ("trainer.resume_from", tmp_path / "absent")
    assert str(ckpt.value).startswith(f"trainer.resume_from: {tmp_path / 'absent'}: expected ")
