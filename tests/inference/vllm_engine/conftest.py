"""Real vLLM servers for the tests in this folder, skipped when vLLM is not installed.

vLLM runs from its own environment (``scripts/install_vllm.sh``), found at
``$SKYRL_R3_VLLM_PYTHON``, else the default venv of the cache the suite uses, else the
user's default cache (the suite points ``SKYRL_R3_CACHE`` at a temp folder, where the
install script, run before pytest, did not write). A server takes 33-58 s to start on
the 2-core CI machine, so one serves every test that leaves its weights as it found
them; the tests that need another server start their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from inference.models.tiny_checkpoint import write_tiny_checkpoint
from inference.vllm.process import VLLMServerProcess
from tests.inference.vllm_engine.harness import (
    VLLM_SIZES,
    find_vllm_python,
    group_members,
    start_server,
)


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = find_vllm_python()
    if python is None:
        pytest.skip(
            "vLLM is not installed: run scripts/install_vllm.sh (or set SKYRL_R3_VLLM_PYTHON)"
        )
    return python


@pytest.fixture(scope="session")
def vllm_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two tiny qwen3_moe folders vLLM serves: the same sizes, weights seeds 0 and 1."""
    root = tmp_path_factory.mktemp("vllm_checkpoints")
    return tuple(  # type: ignore[return-value]
        write_tiny_checkpoint("qwen3_moe", root / f"seed{seed}", seed=seed, sizes=VLLM_SIZES)
        for seed in (0, 1)
    )


@dataclass(frozen=True)
class RunningServer:
    url: str
    api_key: str
    checkpoint: Path
    process: VLLMServerProcess


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: str, vllm_checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """Serves the seed-0 checkpoint. A test that pushes other weights pushes these back."""
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    server = start_server(vllm_python, vllm_checkpoints[0], log_file=log)
    pgid = server.pid
    assert pgid is not None
    try:
        yield RunningServer(server.url, server.api_key, vllm_checkpoints[0], server)
    finally:
        server.stop()
    # stop() ends the whole group: the API server, EngineCore and its worker.
    assert group_members(pgid) == [], "vLLM processes outlived stop()"
