"""A real inference server (tiny fp32 MoE engine, HTTP on 127.0.0.1) per test."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from inference.client import RemoteGenerateClient, RetryPolicy
from inference.engine.hf_engine import HFMoEEngine
from inference.models.tokenizer import build_byte_tokenizer
from inference.server import ServerConfig, start_server


@contextlib.asynccontextmanager
async def serving(
    wrap_engine: Callable[[Any], Any] | None = None,
) -> AsyncIterator[RemoteGenerateClient]:
    """A started server and a client; fp32 so stitched routes can be compared exactly."""
    engine = HFMoEEngine.from_config(seed=0, dtype="float32")
    server = await start_server(
        engine if wrap_engine is None else wrap_engine(engine), ServerConfig()
    )
    try:
        retry = RetryPolicy(max_attempts=1, attempt_timeout_s=60.0, deadline_s=60.0)
        async with RemoteGenerateClient(server.url, retry=retry) as client:
            yield client
    finally:
        await server.stop()


class IgnoringPromptStartEngine:
    """Fault injection: an engine that computes routes for the whole prefix regardless."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def info(self) -> Any:
        return self.inner.info

    async def generate(self, requests: Any) -> Any:
        reqs = [dataclasses.replace(r, routed_experts_prompt_start=0) for r in requests]
        return await self.inner.generate(reqs)

    def load_weights(self, named_tensors: Any) -> int:
        return self.inner.load_weights(named_tensors)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_byte_tokenizer()
