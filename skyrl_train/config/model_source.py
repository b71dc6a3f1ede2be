"""Where a run's model comes from: ``model.path``, or the built-in tiny model.

Either way the run trains a checkpoint folder. ``model.path`` names one; without it
the built-in model (``model.builtin``, ``model.seed``) is written once as
a real folder under the cache (``inference.models.checkpoint.builtin_checkpoint``)
and then loaded exactly like any other checkpoint.
"""

from __future__ import annotations

import functools
from pathlib import Path

from inference.errors import CheckpointFormatError
from inference.models.architecture import MoEArchitecture
from inference.models.checkpoint import (
    CheckpointInfo,
    builtin_checkpoint,
    inspect_checkpoint,
    read_config,
)
from inference.models.tiny_moe import TinyMoEConfig
from inference.models.tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE
from skyrl_train.config.schema import ModelConfig
from skyrl_train.errors import ConfigValidationError
from skyrl_train.runs.export import TEMP_DIR

__all__ = ["inspect_folder", "model_architecture", "model_checkpoint", "model_checkpoint_info"]


def inspect_folder(folder: str | Path) -> CheckpointInfo:
    """``inspect_checkpoint``, once per process for a folder whose files are unchanged:
    a launch reads the checkpoint to validate it and again to start from it, and with a
    Hugging Face tokenizer each read costs a tokenizer load. A file rewritten in
    between (size or mtime) is read again."""
    path = Path(folder).resolve()
    if not path.is_dir():
        return inspect_checkpoint(path)  # raises, naming what is missing
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in path.iterdir()))
    return _inspected(str(path), stamp)


@functools.lru_cache(maxsize=8)
def _inspected(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> CheckpointInfo:
    return inspect_checkpoint(folder)


def _refuse_builtin_keys_with_path(model: ModelConfig) -> None:
    default = TinyMoEConfig()
    for key in TinyMoEConfig.__dataclass_fields__:
        if getattr(model.builtin, key) != getattr(default, key):
            raise ConfigValidationError(
                f"model.builtin.{key}",
                expected=f"the default {getattr(default, key)!r} with model.path (it describes "
                f"the built-in model only; the architecture comes from {model.path}/config.json)",
                got=repr(getattr(model.builtin, key)),
            )


def _builtin_architecture(model: ModelConfig) -> MoEArchitecture:
    tiny = model.builtin
    if tiny.vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigValidationError(
            "model.builtin.vocab_size",
            expected=f">= {BYTE_VOCAB_SIZE} (the built-in byte tokenizer's size)",
            got=str(tiny.vocab_size),
        )
    return tiny.architecture()


def model_checkpoint_info(model: ModelConfig) -> CheckpointInfo | None:
    """``model.path`` inspected (config, tokenizer, EOS), or None for the built-in model.

    Raises ``ConfigValidationError`` on ``model.path`` naming the file and field.
    """
    if model.path is None:
        return None
    _check_path_keys(model)
    try:
        return inspect_folder(model.path)
    except CheckpointFormatError as exc:
        raise ConfigValidationError("model.path", f"{model.path}: {exc}") from exc


def _check_path_keys(model: ModelConfig) -> None:
    _refuse_builtin_keys_with_path(model)
    if TEMP_DIR.fullmatch(Path(str(model.path)).name):
        # Checked by name: a temp folder may hold every file of an export and still be
        # one a crash cut short, or an old one set aside (runs/export.py).
        raise ConfigValidationError(
            "model.path",
            expected="a model folder (a finished export is global_step_N)",
            got=f"{model.path!r}, the temp folder of an export or a save that never finished",
        )


def model_architecture(model: ModelConfig, *, config_only: bool = False) -> MoEArchitecture:
    """The architecture the run trains, without writing anything. ``config_only``:
    ``model.path`` needs only its ``config.json`` (``entrypoints.check_config`` checks a
    launch for a model whose weights are elsewhere); its tokenizer, EOS ids and weights
    are then not checked, which the launch itself still does."""
    if config_only and model.path is not None:
        _check_path_keys(model)
        try:
            return read_config(model.path)[2]
        except CheckpointFormatError as exc:
            raise ConfigValidationError("model.path", f"{model.path}: {exc}") from exc
    info = model_checkpoint_info(model)
    return info.architecture if info is not None else _builtin_architecture(model)


def model_checkpoint(model: ModelConfig) -> Path:
    """The checkpoint folder the run trains: ``model.path``, or the built-in model
    written into ``model.cache_dir`` (null: ``$SKYRL_R3_CACHE`` or ``~/.cache/skyrl_r3``)."""
    if model.path is not None:
        return Path(model.path)
    return builtin_checkpoint(model.builtin, seed=model.seed, cache_dir=model.cache_dir)
