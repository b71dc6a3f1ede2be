"""``URLBucketSender`` on its own: a real HTTP server on loopback serves a bucket to
exactly one pull that carries its token, only while its ``/update_weights`` is in
flight, and answers any other ``Authorization`` value with 401, never a 500. (A real
vLLM pulling from it: test_vllm_client_real.py.)"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load

from inference.vllm.senders import URLBucketSender
from tests.raw_http import random_authorization_values, send_each

BUCKET = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}


async def fetch(url: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as reply:
        return reply.status, await reply.read()


def test_a_bucket_is_served_once_to_its_token_only_while_the_update_runs() -> None:
    seen: dict[str, Any] = {}

    async def main() -> None:
        sender = URLBucketSender("127.0.0.1")

        async def post_init(info: dict[str, str]) -> None:
            seen["init"] = dict(info)

        async def post_update(info: dict[str, str]) -> None:
            seen["info"] = dict(info)
            url, token = info["url"], info["api_key"]
            seen["no_token"] = await fetch(url, None)
            seen["wrong_token"] = await fetch(url, token[:-1] + ("x" if token[-1] != "x" else "y"))
            seen["other_path"] = await fetch(url.rsplit("/", 1)[0] + "/guess", token)
            seen["ok"] = await fetch(url, token)
            seen["again"] = await fetch(url, token)

        await sender.connect(post_init)
        try:
            await sender.send(BUCKET, post_update)
            seen["after"] = await fetch(seen["info"]["url"], seen["info"]["api_key"])
        finally:
            await sender.close()

    asyncio.run(main())
    info = seen["info"]
    assert set(info) == {"url", "api_key"} and info["url"].startswith("http://127.0.0.1:")
    # The handshake names the sender's origin: the worker pulls from nowhere else.
    assert info["url"].startswith(seen["init"]["bucket_origin"] + "/buckets/")
    status, body = seen["ok"]
    assert status == 200
    tensors = load(body)
    assert sorted(tensors) == sorted(BUCKET)
    assert all(torch.equal(tensors[k], BUCKET[k]) for k in BUCKET)
    assert seen["no_token"][0] == 401 and seen["wrong_token"][0] == 401
    assert seen["other_path"][0] == 404
    assert seen["again"][0] == 404  # served once
    assert seen["after"][0] == 404  # gone once the server answered


def _get(path: str) -> Any:
    def request(authorization: bytes, close: bool) -> bytes:
        head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        if close:
            head += b"Connection: close\r\n"
        return head + b"Authorization: " + authorization + b"\r\n\r\n"

    return request


def test_any_malformed_authorization_is_a_401_and_never_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: dict[str, Any] = {}

    async def main() -> None:
        sender = URLBucketSender("127.0.0.1")

        async def post_update(info: dict[str, str]) -> None:
            url, token = info["url"], info["api_key"]
            path = "/" + url.split("/", 3)[3]
            values = random_authorization_values(1000, seed=38, token=token.encode())
            seen["values"] = values
            seen["replies"] = await send_each(sender.port, values, _get(path))
            seen["token"] = token
            seen["ok"] = await fetch(url, token)  # the bucket was still there
            seen["again"] = await fetch(url, token)

        try:
            await sender.send(BUCKET, post_update)
        finally:
            await sender.close()

    asyncio.run(main())
    assert len(seen["replies"]) == len(seen["values"]) == 1000
    for value, (status, _, _) in zip(seen["values"], seen["replies"], strict=True):
        assert status == 401, value[:80]
    assert seen["ok"][0] == 200 and seen["again"][0] == 404
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert seen["token"] not in caplog.text


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


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "[::]", "0"])
def test_an_empty_or_wildcard_host_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="^host: expected an address the server can reach"):
        URLBucketSender(host)
