"""Sampling params as a plain dict, from a mapping or an engine ``SamplingParams``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any


def sampling_dict(sampling_params: Any) -> dict[str, Any]:
    """A fresh dict of wire sampling params; a mapping or ``SamplingParams`` dataclass."""
    if is_dataclass(sampling_params) and not isinstance(sampling_params, type):
        params = asdict(sampling_params)
        params["stop_token_ids"] = list(params.get("stop_token_ids", ()))
        return params
    if isinstance(sampling_params, Mapping):
        return dict(sampling_params)
    raise TypeError(
        f"sampling_params: expected a mapping or SamplingParams, got {type(sampling_params).__name__}"
    )


def positive_int(value: Any) -> int | None:
    """``value`` when it is an int > 0 (not a bool), else None."""
    return value if type(value) is int and value > 0 else None
