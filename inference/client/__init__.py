"""Async HTTP client of the inference server, with a bounded retry policy."""

from inference.client.client import RemoteGenerateClient
from inference.client.replies import parse_retry_after
from inference.client.results import GenerateRequest, GenerateResult
from inference.client.retry import RetryPolicy

__all__ = [
    "GenerateRequest",
    "GenerateResult",
    "RemoteGenerateClient",
    "RetryPolicy",
    "parse_retry_after",
]
