"""Rollout generation: the gym generator, its renderer and the per-token traces.

The engine client is passed in; what it must do is ``inference.client.protocol``'s
``GenerateClient``, the one generate contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from skyrl_train.lazy import lazy_exports

if TYPE_CHECKING:  # the real types for mypy; at run time each name loads on first use
    from skyrl_train.generators.base import GeneratorInput, GeneratorOutput
    from skyrl_train.generators.gym_generator import GymGenerator
    from skyrl_train.generators.rendering import ChatTemplateRenderer, ObservationRenderer
    from skyrl_train.generators.traces import (
        RoutedExpertTrace,
        RouteTraceResult,
        TokenMetadataTrace,
    )

# Resolved on first use: ``skyrl_train/__init__.py`` imports ``generators.traces`` on
# every trainer rank, and an eager ``gym_generator`` import here brought the launch
# validator (``config/validate.py``) and skyrl_gym along with it.
_HOMES = {
    "GeneratorInput": "base",
    "GeneratorOutput": "base",
    "GymGenerator": "gym_generator",
    "ChatTemplateRenderer": "rendering",
    "ObservationRenderer": "rendering",
    "RoutedExpertTrace": "traces",
    "RouteTraceResult": "traces",
    "TokenMetadataTrace": "traces",
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
__all__ = sorted(_HOMES)
