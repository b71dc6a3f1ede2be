"""The family registry: which Hugging Face MoE checkpoints the engine and trainer take.

One module per family holds how its ``config.json`` maps onto ``MoEArchitecture`` and
its weight-name tables; ``family_for`` picks the module from ``architectures``.
"""

from __future__ import annotations

from typing import Any

from inference.errors import CheckpointFormatError
from inference.models.architecture import Family, MoEArchitecture
from inference.models.families import mixtral, olmoe, qwen2_moe, qwen3_moe

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "describe", "family_for", "family_named"]

FAMILIES: dict[str, Family] = {
    f.name: f for f in (qwen3_moe.FAMILY, qwen2_moe.FAMILY, olmoe.FAMILY, mixtral.FAMILY)
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    arch for f in FAMILIES.values() for arch in f.architectures
)


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_for(hf_config: Any) -> Family:
    """The family of a transformers config, by its ``architectures`` list."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for family in FAMILIES.values():
        if any(a in family.architectures for a in architectures):
            return family
    raise CheckpointFormatError(
        "config.json:architectures",
        f"one of {list(SUPPORTED_ARCHITECTURES)}",
        architectures or None,
    )


def describe(hf_config: Any) -> MoEArchitecture:
    """``MoEArchitecture`` of a transformers config of any supported family."""
    return family_for(hf_config).describe(hf_config)
