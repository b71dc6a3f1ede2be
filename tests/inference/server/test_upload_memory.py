"""A 1 GiB garbage upload does not grow the server: it is refused from its declared size
or its header, and a valid header followed by garbage costs the validated payload only.

The server runs in its own process so its RSS can be read from /proc (it once grew
from 388 MiB to 2.5 GiB on such an upload). The client streams the garbage from one
reused 1 MiB chunk, so the test itself allocates almost nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import save

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30
CHUNK = os.urandom(1 << 20)
GROWTH_LIMIT_MIB = 64
UPLOAD = "/skyrl/v1/update_weights"
OCTETS = {"Content-Type": "application/octet-stream"}

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads RSS from /proc"
)


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak since start) of ``pid`` in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # reported in kB
    return fields


@pytest.fixture(scope="module")
def server_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "inference.server", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        first = process.stdout.readline().strip()
        assert first.startswith("serving "), process.stderr.read() if process.stderr else first
        yield process, first.removeprefix("serving ")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


async def garbage(prefix: bytes = b"", total: int = GIB) -> AsyncIterator[bytes]:
    yield prefix
    for _ in range(total // len(CHUNK)):
        yield CHUNK


async def send(session: aiohttp.ClientSession, url: str, body: object, headers: dict) -> int:
    """The reply's status, or 0 when the server closed the connection instead."""
    try:
        async with session.post(url + UPLOAD, data=body, headers=headers) as response:
            await response.read()
            return response.status
    except aiohttp.ClientError:
        return 0


def valid_body() -> bytes:
    return save({"model.norm.weight": torch.ones(64), "lm_head.weight": torch.zeros(264, 64)})


def test_one_gib_garbage_upload_does_not_grow_the_server(server_process) -> None:
    process, url = server_process

    async def main() -> list[tuple[str, int, dict[str, float]]]:
        async with aiohttp.ClientSession() as session:
            # Warm up every path first (a generate, a valid upload), so the baseline
            # already holds what a first request allocates once.
            warm = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
            async with session.post(url + "/skyrl/v1/generate", json=warm) as r:
                assert r.status == 200
            assert await send(session, url, valid_body(), OCTETS) == 200
            results = [("baseline", 200, memory_mib(process.pid))]
            valid = valid_body()
            cases = [
                ("declared 1 GiB", garbage(), {**OCTETS, "Content-Length": str(GIB)}),
                ("chunked 1 GiB", garbage(), OCTETS),
                ("valid header + 1 GiB", garbage(valid), OCTETS),
                (
                    "valid header + 1 GiB, declared",
                    garbage(valid),
                    {**OCTETS, "Content-Length": str(GIB + len(valid))},
                ),
            ]
            for name, body, headers in cases:
                status = await send(session, url, body, headers)
                results.append((name, status, memory_mib(process.pid)))
            async with session.get(url + "/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            assert await send(session, url, valid_body(), OCTETS) == 200  # still loads
            return results

    results = asyncio.run(main())
    base = results[0][2]
    for name, status, memory in results:
        grew = memory["VmHWM"] - base["VmHWM"]
        print(f"{name}: status {status}, RSS {memory['VmRSS']:.1f} MiB, peak +{grew:.1f} MiB")
    for name, status, memory in results[1:]:
        assert status in (0, 400, 413), (name, status)
        assert memory["VmHWM"] - base["VmHWM"] < GROWTH_LIMIT_MIB, (name, memory, base)
    assert [status for _, status, _ in results[1:]] != [0] * 4  # answered, not just closed
