"""What the ``VLLMClient`` tests share (``test_vllm_client_*.py``): a client on a fake
vLLM server on loopback (``fake_vllm``) with a fast retry policy, the paths a push
and a generate hit, and a reply carrying routes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from inference.client import RetryPolicy, RouteShape
from inference.vllm.client import VLLMClient
from tests.inference.vllm_engine.fake_vllm import FakeVLLM, choice_json, fake_vllm, reply_json

FAST = RetryPolicy(
    max_attempts=4,
    initial_backoff_s=0.01,
    max_backoff_s=0.02,
    attempt_timeout_s=5.0,
    deadline_s=20.0,
)
SHAPE = RouteShape(num_layers=3, top_k=2, num_experts=8)
PAUSE = "/pause?mode=keep&clear_cache=true"
PUSH = [PAUSE, "/start_weight_update"]
COMMIT = ["/finish_weight_update", "/resume"]
GEN = "/inference/v1/generate"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def serving(
    *, client: dict[str, Any] | None = None, **state: Any
) -> AsyncIterator[tuple[FakeVLLM, VLLMClient]]:
    async with fake_vllm(**state) as fake:
        options = {"retry": FAST, "seed": 0, "weight_timeout_s": 5.0, **(client or {})}
        async with VLLMClient(fake.url, **options) as vllm:
            yield fake, vllm


def override(choice: dict[str, Any]) -> Any:
    """A reply_override answering every generate with ``choice``."""
    return lambda body: reply_json(choice)


def routes_choice(routes: Any) -> dict[str, Any]:
    """A two-token reply of one choice carrying ``routes`` as its ``routed_experts``."""
    return choice_json(
        token_ids=[7, 8],
        finish_reason="length",
        logprobs=[(7, -1.0, 1), (8, -1.0, 1)],
        routed_experts=routes,
        weight_versions=[("default", 0, 2)],
    )


GOOD_ROUTES = np.zeros((3 - 0 + 2 - 1, 3, 2), np.uint8)  # P=3, s=0, G=2
