"""Async HTTP clients of inference servers, with a bounded retry policy; the generate
contract they share is ``inference.client.protocol``."""

from inference.client.client import RemoteGenerateClient
from inference.client.limits import ReplyTooLarge, RouteShape
from inference.client.protocol import (
    GenerateClient,
    GenerateRequest,
    GenerateResult,
    VersionSpan,
    WeightUpdateClient,
)
from inference.client.replies import parse_retry_after
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
