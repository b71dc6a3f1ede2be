"""Rollout generation: the gym generator, its renderer and the per-token traces.

The engine client is passed in; what it must do is ``inference.client.protocol``'s
``GenerateClient``, the one generate contract.
"""

from skyrl_train.generators.base import GeneratorInput, GeneratorOutput
from skyrl_train.generators.gym_generator import GymGenerator
from skyrl_train.generators.rendering import ChatTemplateRenderer, ObservationRenderer
from skyrl_train.generators.traces import (
    RoutedExpertTrace,
    RouteTraceResult,
    TokenMetadataTrace,
)

__all__ = [
    "ChatTemplateRenderer",
    "GeneratorInput",
    "GeneratorOutput",
    "GymGenerator",
    "ObservationRenderer",
    "RouteTraceResult",
    "RoutedExpertTrace",
    "TokenMetadataTrace",
]
