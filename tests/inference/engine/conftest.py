"""Shared tiny engines: building one takes milliseconds, but reuse keeps tests lean."""

from __future__ import annotations

import pytest

from inference.engine.hf_engine import HFMoEEngine


@pytest.fixture(scope="module")
def fp32_engine():
    engine = HFMoEEngine.from_config(seed=0, dtype="float32")
    yield engine
    engine._executor.shutdown(wait=True)
    engine.capture.remove()
