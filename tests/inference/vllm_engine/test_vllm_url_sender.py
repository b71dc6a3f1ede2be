"""``URLBucketSender`` on its own: a real HTTP server on loopback serves a bucket only
while its ``/update_weights`` is in flight, only to the bearer of its token. (A real
vLLM pulling from it: test_vllm_client_real.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load

from inference.vllm.senders import URLBucketSender

BUCKET = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}


async def fetch(url: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as reply:
        return reply.status, await reply.read()


def test_a_bucket_is_served_to_its_token_only_while_the_update_runs() -> None:
    seen: dict[str, Any] = {}

    async def main() -> None:
        sender = URLBucketSender("127.0.0.1")

        async def post_update(info: dict[str, str]) -> None:
            seen["info"] = dict(info)
            url, token = info["url"], info["api_key"]
            seen["ok"] = await fetch(url, token)
            seen["no_token"] = await fetch(url, None)
            seen["wrong_token"] = await fetch(url, token[:-1] + ("x" if token[-1] != "x" else "y"))
            seen["other_path"] = await fetch(url.rsplit("/", 1)[0] + "/guess", token)

        await sender.connect(post_update)
        try:
            await sender.send(BUCKET, post_update)
            seen["after"] = await fetch(seen["info"]["url"], seen["info"]["api_key"])
        finally:
            await sender.close()

    asyncio.run(main())
    info = seen["info"]
    assert set(info) == {"url", "api_key"} and info["url"].startswith("http://127.0.0.1:")
    status, body = seen["ok"]
    assert status == 200
    tensors = load(body)
    assert sorted(tensors) == sorted(BUCKET)
    assert all(torch.equal(tensors[k], BUCKET[k]) for k in BUCKET)
    assert seen["no_token"][0] == 401 and seen["wrong_token"][0] == 401
    assert seen["other_path"][0] == 404
    assert seen["after"][0] == 404  # gone once the server answered


def test_a_failed_update_still_removes_the_bucket_and_close_stops_the_server() -> None:
    urls: list[str] = []

    async def main() -> tuple[int, bool]:
        sender = URLBucketSender("127.0.0.1")

        async def failing(info: dict[str, str]) -> None:
            urls.append(info["url"])
            raise RuntimeError("update refused")

        with pytest.raises(RuntimeError, match="update refused"):
            await sender.send(BUCKET, failing)
        status, _ = await fetch(urls[0], None)
        await sender.close()
        try:
            await fetch(urls[0], None)
        except aiohttp.ClientConnectionError:
            return status, True
        return status, False

    status, refused = asyncio.run(main())
    assert status == 404 and refused


def test_an_empty_host_is_refused() -> None:
    with pytest.raises(ValueError, match="^host: expected an address"):
        URLBucketSender("")
