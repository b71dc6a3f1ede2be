"""One real server (real CPU engine, tiny MoE, bf16) on loopback for the module tests.

Built once per session: importing transformers and building the model is most of the
cost (~7 s here); every request after that takes milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from inference.server import EngineSpec, ServerConfig, ServerThread

API_KEY = "test-token"
MAX_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class LiveServer:
    url: str
    api_key: str
    spec: EngineSpec
    config: ServerConfig


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    spec = EngineSpec(seed=0, dtype="bfloat16")
    config = ServerConfig(api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES, max_new_tokens=32)
    thread = ServerThread(spec.build, config)
    url = thread.start()
    try:
        yield LiveServer(url=url, api_key=API_KEY, spec=spec, config=config)
    finally:
        thread.stop()
