"""A launch inspects its checkpoint folder once per process (``model_source.inspect_folder``),
and again only when a file of it changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from skyrl_train.config import load_config, model_source, validate_cfg


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = model_source.inspect_checkpoint

    def counting(folder):  # type: ignore[no-untyped-def]
        calls.append(str(folder))
        return real(folder)

    model_source._inspected.cache_clear()
    monkeypatch.setattr(model_source, "inspect_checkpoint", counting)
    yield calls
    model_source._inspected.cache_clear()


def test_validation_and_launch_share_one_inspection(tmp_path: Path, counted: list[str]) -> None:
    folder = write_tiny_checkpoint("olmoe", tmp_path / "ckpt")
    cfg = load_config([f"model.path={folder}", f"trainer.run_dir={tmp_path / 'run'}"])
    validate_cfg(cfg)
    info = model_source.inspect_folder(model_source.model_checkpoint(cfg.model))
    assert info.architecture == model_source.model_architecture(cfg.model)
    assert len(counted) == 1

    config = folder / "config.json"
    config.write_text(config.read_text() + "\n")  # a changed file is read again
    os.utime(config, ns=(0, config.stat().st_mtime_ns + 1))
    model_source.inspect_folder(folder)
    assert len(counted) == 2
