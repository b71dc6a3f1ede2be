"""Load ``configs/ppo_base_config.yaml`` (plus command-line overrides) into ``PPOConfig``.

Hydra composes the YAML and applies overrides; ``parse_config`` then converts the
result into the typed dataclasses of ``schema.py`` strictly: a key the schema does
not declare, or a value of the wrong type, raises ``ConfigValidationError`` whose
``.key`` is the dotted key. Nothing downstream reads a config with ``.get(default)``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from skyrl_train.config.schema import PPOConfig
from skyrl_train.errors import ConfigValidationError

CONFIG_NAME = "ppo_base_config"


def _config_dir() -> Path:
    # The checkout's configs/ (an editable install, as the README does it); a
    # non-editable install has no checkout beside the package, so fall back to the
    # configs/ of the folder the launch runs in.
    for candidate in (Path(__file__).resolve().parents[2] / "configs", Path.cwd() / "configs"):
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return candidate
    return Path(__file__).resolve().parents[2] / "configs"


CONFIG_DIR = _config_dir()
"""The Hydra config folder at the repository root."""

T = TypeVar("T")


def load_config(
    overrides: Sequence[str] | None = None,
    *,
    config_dir: str | Path = CONFIG_DIR,
    config_name: str = CONFIG_NAME,
) -> PPOConfig:
    """Compose the YAML with Hydra override strings (``a.b=1``, ``+a.c=2``) and parse it.

    Must not be called inside a running ``@hydra.main`` (Hydra allows one global
    instance); there use ``parse_config(cfg)`` on the config Hydra hands over.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    overrides = list(overrides or [])
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except HydraException as exc:
        raise ConfigValidationError(_override_key(exc, overrides), str(exc)) from exc
    return parse_config(OmegaConf.to_container(cfg, resolve=True))


def parse_config(cfg: Any) -> PPOConfig:
    """Convert a composed config (``DictConfig`` or plain mapping) into ``PPOConfig``."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a hard dependency
        pass
    return from_mapping(PPOConfig, cfg)


def from_mapping(cls: type[T], data: Any, *, key: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, refusing unknown keys and wrong types.

    Keys absent from ``data`` take the dataclass default. ``key`` is the dotted path
    of ``data`` inside the whole config, used in error messages.
    """
    if not isinstance(data, Mapping):
        raise ConfigValidationError(key or "<root>", f"expected a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise ConfigValidationError(
            _join(key, unknown[0]), f"unknown key; expected one of {sorted(fields)}"
        )
    hints = _type_hints(cls)  # type: ignore[arg-type]  # classes are hashable
    values = {name: _convert(hints[name], value, _join(key, name)) for name, value in data.items()}
    return cls(**values)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config dataclass (tuples as lists), e.g. to save it as YAML."""

    def plain(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(cfg))


# ------------------------------------------------------------------------------ helpers


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, key=key)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is used
        return _convert(inner, value, key)
    if origin is typing.Literal:
        # Compare with the type too: YAML's `true` must not pass as a Literal[1].
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise ConfigValidationError(key, f"expected one of {list(args)}, got {_show(value)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigValidationError(key, f"expected a list of {len(args)}, got {_show(value)}")
        return tuple(
            _convert(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigValidationError(key, f"expected a list, got {_show(value)}")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigValidationError(
                key, f"expected a mapping with str keys, got {_show(value)}"
            )
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigValidationError(key, f"expected true or false, got {_show(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigValidationError(key, f"expected an int, got {_show(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigValidationError(key, f"expected a number, got {_show(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigValidationError(key, f"expected a string, got {_show(value)}")
    raise TypeError(f"{key}: the config schema uses an unsupported type {tp!r}")


def _override_key(exc: BaseException, overrides: Sequence[str]) -> str:
    """The dotted key a Hydra composition error is about, as precisely as Hydra says."""
    cause: BaseException | None = exc
    while cause is not None:
        full_key = getattr(cause, "full_key", None)
        if full_key:
            return str(full_key)
        cause = cause.__cause__
    match = re.search(r"override '([^']+)'", str(exc))
    if match:
        return match.group(1)
    for item in overrides:
        if item.split("=", 1)[0].lstrip("+~") in str(exc):
            return item.split("=", 1)[0].lstrip("+~")
    return "<overrides>"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
