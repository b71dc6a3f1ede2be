"""Async HTTP client of the inference server, with a bounded retry policy."""

from inference.client.client import RemoteGenerateClient
from inference.client.limits import ReplyTooLarge, RouteShape
from inference.client.protocol import GenerateClient, WeightUpdateClient
from inference.client.replies import parse_retry_after
from inference.client.results import GenerateRequest, GenerateResult, VersionSpan
from inference.client.retry import RetryPolicy

__all__ = [
    "GenerateClient",
    "GenerateRequest",
    "GenerateResult",
    "RemoteGenerateClient",
    "ReplyTooLarge",
    "RetryPolicy",
    "RouteShape",
    "VersionSpan",
    "WeightUpdateClient",
    "parse_retry_after",
]
