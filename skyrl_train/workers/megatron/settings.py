"""The worker's Megatron settings, read from ``trainer.policy.megatron_config`` (or ``ref``).

Key names follow SkyRL so launch scripts carry over. Config validation refuses bad
combinations up front; the worker checks replay compatibility again on the *resolved*
TransformerConfig, because a passthrough kwarg or a pipeline layout can set
``virtual_pipeline_model_parallel_size`` after validation ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from skyrl_train.errors import ConfigValidationError

DEFAULT_KEY = "trainer.policy.megatron_config"


@dataclass(frozen=True)
class MegatronSettings:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    context_parallel_size: int = 1
    moe_enable_routing_replay: bool = False
    transformer_config_kwargs: Mapping[str, Any] = field(default_factory=dict)
    key: str = DEFAULT_KEY
    """Config path these settings came from; every error message starts with it."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, key: str = DEFAULT_KEY) -> MegatronSettings:
        """Read a plain mapping or an OmegaConf node; unknown keys are refused."""
        values = _to_plain(values)
        if not isinstance(values, Mapping):
            raise ConfigValidationError(key, f"expected a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"key"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigValidationError(
                f"{key}.{unknown[0]}", f"unknown key; expected one of {sorted(known)}"
            )
        kwargs = _to_plain(values.get("transformer_config_kwargs") or {})
        if not isinstance(kwargs, Mapping):
            raise ConfigValidationError(
                f"{key}.transformer_config_kwargs", f"expected a mapping, got {kwargs!r}"
            )
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "context_parallel_size",
        ):
            value = values.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigValidationError(
                    f"{key}.{name}", f"expected a positive int, got {value!r}"
                )
        rest = {k: v for k, v in values.items() if k != "transformer_config_kwargs"}
        return cls(**rest, transformer_config_kwargs=dict(kwargs), key=key)


def _to_plain(values: Any) -> Any:
    try:
        from omegaconf import OmegaConf
    except ImportError:  # pragma: no cover - hydra-core is a dependency
        return values
    if OmegaConf.is_config(values):
        return OmegaConf.to_container(values, resolve=True)
    return values


def refuse_replay_incompatible(settings: MegatronSettings, resolved: Any) -> None:
    """Raise ConfigValidationError if replay is on and the resolved config defeats it.

    ``resolved`` is the built TransformerConfig (or the kwargs about to build it). The
    rules live in ``validate_cfg``'s check; this applies them to resolved values,
    naming the key the offending value came from.
    """
    from skyrl_train.config.validate import refuse_replay_incompatible as refuse

    if not settings.moe_enable_routing_replay:
        return
    kw_key = f"{settings.key}.transformer_config_kwargs"
    vpp_from_top_level = bool(settings.virtual_pipeline_model_parallel_size) and not (
        settings.transformer_config_kwargs.get("virtual_pipeline_model_parallel_size")
    )
    refuse(
        {
            "virtual_pipeline_model_parallel_size": getattr(
                resolved, "virtual_pipeline_model_parallel_size", None
            )
        },
        key_prefix=settings.key if vpp_from_top_level else kw_key,
    )
    refuse(
        {
            "moe_router_fusion": getattr(resolved, "moe_router_fusion", False),
            "moe_router_load_balancing_type": getattr(
                resolved, "moe_router_load_balancing_type", None
            ),
        },
        key_prefix=kw_key,
    )
