"""Reading an environment's settings (``env_config``) and a row's fields (``extras``)
with errors that name where the value came from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym.error import EnvError

_MISSING = object()


def config_value(env_config: Any, env: str, key: str, default: Any) -> Any:
    """``env_config[key]`` (a mapping, an OmegaConf node or an object with the
    attribute), ``default`` when absent or when ``env_config`` is None."""
    if env_config is None:
        return default
    if isinstance(env_config, Mapping) or hasattr(env_config, "get"):
        value = env_config.get(key, _MISSING)
    else:
        value = getattr(env_config, key, _MISSING)
    return default if value is _MISSING or value is None else value


def check_settings(env_config: Any, env: str, known: tuple[str, ...]) -> None:
    """Refuse a setting the environment does not read: a misspelt key would otherwise
    be silently ignored."""
    if env_config is None:
        return
    keys = list(env_config.keys()) if hasattr(env_config, "keys") else []
    # SkyRL's own tests pass {"env_class": id} as the config: a name, not a setting.
    unknown = sorted(str(k) for k in keys if k not in known and k != "env_class")
    if unknown:
        raise EnvError(
            f"environment.skyrl_gym.{env}: expected settings among {sorted(known)}, got {unknown}"
        )


def extra(extras: Mapping[str, Any] | None, env: str, key: str) -> Any:
    """The row field ``extras[key]``; refused when missing."""
    if extras is None or not isinstance(extras, Mapping):
        raise EnvError(f"{env}.extras: expected a mapping of the row's fields, got {extras!r:.80}")
    if extras.get(key) is None:
        raise EnvError(f"{env}.extras.{key}: expected a value, got none (keys: {sorted(extras)})")
    return extras[key]


def setting_path(env: str, key: str) -> str:
    return f"environment.skyrl_gym.{env}.{key}"


def int_setting(env_config: Any, env: str, key: str, default: int, *, low: int, high: int) -> int:
    """Setting ``key`` (``default`` when unset), an int in ``[low, high]``."""
    return check_int(
        setting_path(env, key), config_value(env_config, env, key, default), low=low, high=high
    )


def number_setting(
    env_config: Any, env: str, key: str, default: float, *, low: float, high: float
) -> float:
    """Setting ``key`` (``default`` when unset), a number in ``[low, high]``."""
    value = config_value(env_config, env, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise EnvError(
            f"{setting_path(env, key)}: expected a number in [{low}, {high}], got {value!r}"
        )
    return float(value)


def bool_setting(env_config: Any, env: str, key: str, default: bool) -> bool:
    value = config_value(env_config, env, key, default)
    if not isinstance(value, bool):
        raise EnvError(f"{setting_path(env, key)}: expected a bool, got {value!r}")
    return value


def check_int(field: str, value: Any, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise EnvError(f"{field}: expected an int in [{low}, {high}], got {value!r}")
    return value
