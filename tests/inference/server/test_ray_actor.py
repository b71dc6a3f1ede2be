"""The server as a Ray actor: starts, serves, and shuts down with nothing left running."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from inference.client import RemoteGenerateClient
from inference.server import EngineSpec, ServerConfig, create_server_actor

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow


@pytest.fixture
def local_ray() -> Iterator[None]:
    # The launch's own start-up: loopback only, Ray's token authentication on.
    from skyrl_train.utils.ray_session import start_ray

    session = start_ray(address=None, num_cpus=2, runtime_env={})
    try:
        yield
    finally:
        session.shutdown()


def port_accepts(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, int(port))) == 0


def test_actor_starts_serves_and_stops(local_ray) -> None:
    handle, url = create_server_actor(
        EngineSpec(seed=0), ServerConfig(api_key="actor-token"), num_cpus=1
    )
    try:
        assert url.startswith("http://127.0.0.1:") and port_accepts(url)
        assert ray.get(handle.url.remote()) == url

        async def main():
            async with RemoteGenerateClient(url, api_key="actor-token") as client:
                result = await client.generate(
                    prompt_token_ids=[1, 2, 3, 4, 5],
                    sampling_params={"max_tokens": 3, "temperature": 0.0},
                    return_routed_experts=True,
                    routed_experts_prompt_start=2,
                )
                return result, await client.health()

        result, health = asyncio.run(main())
        assert result.routed_experts.shape[0] == 5 - 2 + len(result.response_ids) - 1
        assert health["status"] == "ok" and health["model"] == "tiny-moe"
    finally:
        ray.get(handle.stop.remote())
    assert not port_accepts(url)  # the server socket is closed, not just idle
    with pytest.raises(ray.exceptions.RayTaskError, match="expected a started actor"):
        ray.get(handle.url.remote())
    ray.kill(handle)
