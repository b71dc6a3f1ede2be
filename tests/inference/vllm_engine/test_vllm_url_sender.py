"""``URLBucketSender`` on its own: a real HTTP server on loopback serves a bucket to one
pull per worker that announced itself at the handshake (every worker of a
tensor-parallel server pulls every bucket), each carrying its token, only while its
``/update_weights`` is in flight, and answers any other ``Authorization`` value with
401, never a 500. (A real vLLM pulling from it: test_vllm_client_real.py; two worker
extensions announcing and pulling: test_vllm_worker_extension.py.)"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load

from inference.vllm.senders import URLBucketSender
from inference.vllm.transport import announce_worker, pull_bucket
from tests.raw_http import random_authorization_values, send_each

BUCKET = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}


async def fetch(url: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as reply:
        return reply.status, await reply.read()


async def announce(info: dict[str, str], worker: str, *, key: str | None = None) -> None:
    """What a worker extension does in ``init_transfer_engine`` (real HTTP)."""
    await asyncio.to_thread(
        announce_worker,
        info["bucket_origin"],
        api_key=key if key is not None else info["announce_key"],
        worker=worker,
        timeout_s=30,
    )


async def pull(info: dict[str, str], origin: str) -> bytes | ValueError:
    """What a worker extension does for one bucket (real HTTP)."""
    try:
        return await asyncio.to_thread(
            pull_bucket,
            info["url"],
            api_key=info["api_key"],
            origin=origin,
            max_bytes=1 << 20,
            timeout_s=30,
        )
    except ValueError as exc:
        return exc


def test_a_bucket_is_served_once_to_its_token_only_while_the_update_runs() -> None:
    seen: dict[str, Any] = {}

    async def main() -> None:
        sender = URLBucketSender("127.0.0.1")

        async def post_init(info: dict[str, str]) -> None:
            seen["init"] = dict(info)
            await announce(info, "only-worker")

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
    assert seen["init"]["announce_key"] != info["api_key"]
    status, body = seen["ok"]
    assert status == 200
    tensors = load(body)
    assert sorted(tensors) == sorted(BUCKET)
    assert all(torch.equal(tensors[k], BUCKET[k]) for k in BUCKET)
    assert seen["no_token"][0] == 401 and seen["wrong_token"][0] == 401
    assert seen["other_path"][0] == 404
    assert seen["again"][0] == 404  # served once
    assert seen["after"][0] == 404  # gone once the server answered


def test_every_announced_worker_pulls_the_bucket_and_no_one_more() -> None:
    """A tensor-parallel server: two workers announce themselves at the handshake and
    both pull each bucket; a third pull, and any pull after the server answered, get
    the 404 a pulled bucket gets."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        sender = URLBucketSender("127.0.0.1")

        async def post_init(info: dict[str, str]) -> None:
            seen["origin"] = info["bucket_origin"]
            await announce(info, "worker-0")
            await announce(info, "worker-1")
            await announce(info, "worker-1")  # a repeated handshake counts a worker once
            wrong = info["announce_key"][:-1] + ("x" if info["announce_key"][-1] != "x" else "y")
            seen["wrong_key"] = await _capture(announce(info, "intruder", key=wrong))
            seen["bad_id"] = await _capture(announce(info, "a.b"))

        async def two_workers(info: dict[str, str]) -> None:
            seen["info"] = dict(info)
            seen["pulls"] = await asyncio.gather(*(pull(info, seen["origin"]) for _ in range(2)))
            seen["third"] = await pull(info, seen["origin"])

        async def one_worker_then_answer(info: dict[str, str]) -> None:
            seen["late"] = dict(info)
            seen["only"] = await pull(info, seen["origin"])

        await sender.connect(post_init)
        seen["workers"] = sender.workers
        try:
            await sender.send(BUCKET, two_workers)
            await sender.send(BUCKET, one_worker_then_answer)
            seen["after"] = await pull(seen["late"], seen["origin"])
        finally:
            await sender.close()

    asyncio.run(main())
    assert seen["workers"] == 2
    for body in [*seen["pulls"], seen["only"]]:
        assert isinstance(body, bytes), body
        tensors = load(body)
        assert sorted(tensors) == sorted(BUCKET)
        assert all(torch.equal(tensors[k], BUCKET[k]) for k in BUCKET)
    for refused in (seen["third"], seen["after"]):
        assert str(refused) == "update_info.url: expected a 200 reply, got HTTP 404"
    assert str(seen["wrong_key"]) == (
        f"init_info.announce_key: expected the trainer's sender at {seen['origin']} to take "
        "this worker's announcement, got HTTP 401"
    )
    assert str(seen["bad_id"]).endswith("got HTTP 400")


def test_a_handshake_no_worker_answers_is_refused_naming_the_key() -> None:
    async def main() -> BaseException | None:
        sender = URLBucketSender("127.0.0.1")

        async def silent(info: dict[str, str]) -> None:
            pass

        try:
            return await _capture(sender.connect(silent))
        finally:
            await sender.close()

    error = asyncio.run(main())
    assert isinstance(error, ValueError)
    assert str(error).startswith(
        "init_info.announce_key: expected each worker of the vLLM server to announce itself"
    ) and str(error).endswith(
        "got no announcement (is its worker extension this project's version?)"
    )


async def _capture(call: Any) -> BaseException | None:
    try:
        await call
    except Exception as exc:
        return exc
    return None


def _get(path: str, *, method: str = "GET") -> Any:
    def request(authorization: bytes, close: bool) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
        if method == "POST":
            head += b"Content-Length: 0\r\n"
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

        async def post_init(info: dict[str, str]) -> None:
            await announce(info, "worker-0")
            key = info["announce_key"]
            values = random_authorization_values(200, seed=49, token=key.encode())
            seen["announce_values"] = values
            post = _get("/workers/intruder", method="POST")
            seen["announce_replies"] = await send_each(sender.port, values, post)
            seen["announce_key"] = key

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
            await sender.connect(post_init)
            seen["workers"] = sender.workers
            await sender.send(BUCKET, post_update)
        finally:
            await sender.close()

    asyncio.run(main())
    assert len(seen["replies"]) == len(seen["values"]) == 1000
    for value, (status, _, _) in zip(seen["values"], seen["replies"], strict=True):
        assert status == 401, value[:80]
    assert len(seen["announce_replies"]) == len(seen["announce_values"]) == 200
    for value, (status, _, _) in zip(
        seen["announce_values"], seen["announce_replies"], strict=True
    ):
        assert status == 401, value[:80]
    assert seen["workers"] == 1  # no refused announcement counted
    assert seen["announce_key"] not in caplog.text
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
