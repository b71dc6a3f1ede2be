"""The HTTP inference server (aiohttp): generate with packed side channels, weight
updates, health; runnable standalone (``python -m inference.server``) or as a Ray
actor (``create_server_actor``). Routes and wire format: ``inference.server.app``."""

from inference.server.actor import InferenceServerActor, create_server_actor
from inference.server.app import ServerConfig, ServerCounters, build_app
from inference.server.launch import EngineSpec
from inference.server.runner import RunningServer, ServerThread, start_server
from inference.server.validation import RequestLimits, parse_generate_request

__all__ = [
    "EngineSpec",
    "InferenceServerActor",
    "RequestLimits",
    "RunningServer",
    "ServerConfig",
    "ServerCounters",
    "ServerThread",
    "build_app",
    "create_server_actor",
    "parse_generate_request",
    "start_server",
]
