"""Where a run's model comes from: ``model.path``, or the built-in tiny model.

Either way the run trains a checkpoint folder. ``model.path`` names one; without it
the built-in model (``model.*`` architecture keys, ``model.seed``) is written once as
a real folder under the cache (``inference.models.checkpoint.builtin_checkpoint``)
and then loaded exactly like any other checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from inference.errors import CheckpointFormatError
from inference.models.architecture import MoEArchitecture
from inference.models.checkpoint import CheckpointInfo, builtin_checkpoint, inspect_checkpoint
from inference.models.tokenizer import VOCAB_SIZE as BYTE_VOCAB_SIZE
from skyrl_train.config.schema import ModelConfig
from skyrl_train.errors import ConfigValidationError

__all__ = ["BUILTIN_KEYS", "model_architecture", "model_checkpoint", "model_checkpoint_info"]

BUILTIN_KEYS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("seed", "path", "cache_dir")
)
"""The ``model.*`` keys that describe the built-in model's architecture."""


def _refuse_builtin_keys_with_path(model: ModelConfig) -> None:
    default = ModelConfig()
    for key in BUILTIN_KEYS:
        if getattr(model, key) != getattr(default, key):
            raise ConfigValidationError(
                f"model.{key}",
                f"describes the built-in model only; with model.path the architecture comes "
                f"from {model.path}/config.json, so leave it at {getattr(default, key)!r}, "
                f"got {getattr(model, key)!r}",
            )


def _builtin_architecture(model: ModelConfig) -> MoEArchitecture:
    import re

    try:
        tiny = model.tiny_moe()
    except ValueError as exc:
        # TinyMoEConfig owns these checks; its messages start "TinyMoEConfig.<field>:".
        match = re.match(r"TinyMoEConfig\.(\w+): (.*)", str(exc), re.S)
        key, reason = ("model." + match.group(1), match.group(2)) if match else ("model", str(exc))
        raise ConfigValidationError(key, reason) from exc
    if tiny.vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigValidationError(
            "model.vocab_size",
            f"expected >= {BYTE_VOCAB_SIZE} (the built-in byte tokenizer's size), "
            f"got {tiny.vocab_size}",
        )
    return tiny.architecture()


def model_checkpoint_info(model: ModelConfig) -> CheckpointInfo | None:
    """``model.path`` inspected (config, tokenizer, EOS), or None for the built-in model.

    Raises ``ConfigValidationError`` on ``model.path`` naming the file and field.
    """
    if model.path is None:
        return None
    _refuse_builtin_keys_with_path(model)
    try:
        return inspect_checkpoint(model.path)
    except CheckpointFormatError as exc:
        raise ConfigValidationError("model.path", f"{model.path}: {exc}") from exc


def model_architecture(model: ModelConfig) -> MoEArchitecture:
    """The architecture the run trains, without writing anything."""
    info = model_checkpoint_info(model)
    return info.architecture if info is not None else _builtin_architecture(model)


def model_checkpoint(model: ModelConfig) -> Path:
    """The checkpoint folder the run trains: ``model.path``, or the built-in model
    written into ``model.cache_dir`` (null: ``$SKYRL_R3_CACHE`` or ``~/.cache/skyrl_r3``)."""
    if model.path is not None:
        return Path(model.path)
    return builtin_checkpoint(model.tiny_moe(), seed=model.seed, cache_dir=model.cache_dir)
