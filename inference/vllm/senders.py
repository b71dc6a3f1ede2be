"""How one bucket of weights reaches a vLLM server's workers: the trainer-side half of a
vLLM weight-transfer backend, behind one small interface (:class:`BucketSender`).

- :class:`FileBucketSender` (backend ``transport.BACKEND``, the CPU path measured here):
  one safetensors file per bucket in the transport's own folder
  (``transport.bucket_dir``, the only folder the worker extension reads), named in
  ``/update_weights``; the file is removed once the server answered, also on failure.
- :class:`URLBucketSender` (the same backend, for a server on another host): the
  trainer serves each bucket to one pull per worker of the server, at an unguessable
  URL with a bearer token of its own, and each worker pulls it; the URL is gone after
  the last of those pulls or once the server answered. Its origin goes to the server in
  ``/init_weight_transfer_engine``, where each worker announces itself to it (the
  count), and the worker extension pulls from nowhere else.
- :class:`NCCLBucketSender` (vLLM's ``nccl`` backend, the GPU path): the worker learns
  names, dtypes and shapes from ``/update_weights`` and receives the tensors by an NCCL
  broadcast from the trainer, which must run *while* that request is in flight (both
  sides meet inside the same collective). The broadcast itself sits behind
  :class:`TrainerBroadcast`; this module only orders the calls. Not run on a GPU here:
  its control flow is tested with the broadcast faked.

The push around the buckets (pause, start, finish, resume) is ``inference.vllm.push``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from inference.vllm.transport import (
    ANNOUNCE_PATH,
    file_update_info,
    is_wildcard_host,
    prepare_bucket_dir,
    url_init_info,
    url_update_info,
)

PostJSON = Callable[[Mapping[str, Any]], Awaitable[None]]
"""Sends one RL API request with this JSON payload (``init_info`` or ``update_info``)."""


class BucketSender(Protocol):
    async def connect(self, post_init: PostJSON) -> None:
        """Once, before the first push: the backend's ``/init_weight_transfer_engine``
        handshake, if it has one (``post_init(init_info)``)."""
        ...

    async def send(self, bucket: Mapping[str, Any], post_update: PostJSON) -> None:
        """Deliver one bucket of engine-layout tensors; ``post_update(update_info)``
        asks the server to receive it and returns once it has loaded it."""
        ...

    async def close(self) -> None: ...


class FileBucketSender:
    """One safetensors file per bucket in ``transport.bucket_dir()``, which the server
    must be able to read: same host, same user."""

    def __init__(self) -> None:
        self.directory: str | None = None
        """Set by the first send (``transport.prepare_bucket_dir``)."""

    async def connect(self, post_init: PostJSON) -> None:
        """The file backend needs no handshake: each update names its file."""

    async def send(self, bucket: Mapping[str, Any], post_update: PostJSON) -> None:
        if self.directory is None:
            self.directory = prepare_bucket_dir()
        # mkstemp: a unique name (several clients and pushes share the folder) and a
        # 0600 file, so no other user reads the weights.
        fd, path = tempfile.mkstemp(
            prefix="skyrl-vllm-bucket-", suffix=".safetensors", dir=self.directory
        )
        os.close(fd)
        try:
            await asyncio.to_thread(_save, bucket, path)
            await post_update(file_update_info(path))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def close(self) -> None:
        pass


_SENDER_MAX_CONNECTIONS = 64
"""A server's workers pull one bucket at a time each; the rest is a flood."""
_SENDER_READ_TIMEOUT_S = 30.0
"""A pull's request head and body must arrive within this (``connections``)."""
_MAX_WORKERS = 4096
"""Announced workers kept (each pulls every bucket; a real server has a handful)."""
_WORKER_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


class URLBucketSender:
    """Serves each bucket over HTTP for a server on another host to pull.

    ``host`` is bound and put in the URLs: the trainer's address as the server's host
    reaches it (loopback by default, which only a server on this host can use); a
    wildcard (``0.0.0.0``, ``::``) is refused, since it is no address to connect to.
    ``port`` 0 lets the OS pick one. ``connect`` names the sender's origin to the server
    (``/init_weight_transfer_engine``); the worker extension pulls from no other. During
    that call each of the server's workers announces itself (``transport.ANNOUNCE_PATH``,
    with the handshake's own bearer token), since every worker of a tensor-parallel
    server pulls every bucket. Each bucket gets a fresh random path and bearer token and
    is served to the first ``workers`` pulls that carry the token (one before any worker
    announced), and never after the server answered its ``/update_weights``. Any other
    pull gets 404 (unknown or already pulled as often as there are workers) or 401
    (wrong or malformed ``Authorization``, a head the parser refuses) and nothing else,
    never a 500 (``inference.server.auth``, shared with the builtin server); an
    announcement 204, 401 alike, or 400 for a worker id that is not 1-64 URL-safe
    characters.
    """

    def __init__(self, host: str = "127.0.0.1", *, port: int = 0) -> None:
        if not host or is_wildcard_host(host):
            raise ValueError(
                f"host: expected an address the server can reach, got {host!r}"
                + (" (a wildcard, which binds every interface but names none)" if host else "")
            )
        self.host = host
        self.port = port
        self._buckets: dict[str, _Bucket] = {}
        self._announce_token: Any = None
        self._workers: set[str] = set()
        self._runner: Any = None
        self._url_host = f"[{host}]" if ":" in host else host

    @property
    def origin(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self._url_host}:{self.port}"

    @property
    def workers(self) -> int:
        """Pulls each bucket is served to: the workers announced so far, at least one."""
        return max(1, len(self._workers))

    async def connect(self, post_init: PostJSON) -> None:
        """Starts the HTTP server and names its origin to the vLLM server, whose workers
        each announce themselves while ``post_init`` runs; raises ``ValueError`` if none
        did (a worker extension of another version: its workers' pull count unknown)."""
        from inference.server.auth import BearerToken

        await self._start()
        key = secrets.token_urlsafe(32)
        # A new handshake counts afresh: the server may have restarted with new workers.
        self._announce_token, self._workers = BearerToken(key), set()
        await post_init(url_init_info(self.origin, announce_key=key))
        if not self._workers:
            raise ValueError(
                "init_info.announce_key: expected each worker of the vLLM server to announce "
                f"itself at {self.origin}{ANNOUNCE_PATH} during /init_weight_transfer_engine, "
                "got no announcement (is its worker extension this project's version?)"
            )

    async def _start(self) -> None:
        from aiohttp import web

        from inference.server.connections import GuardedTCPSite

        if self._runner is not None:
            return
        app = web.Application()
        app.router.add_get("/buckets/{name}", self._serve)
        app.router.add_post(ANNOUNCE_PATH, self._announce)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = GuardedTCPSite(
                runner,
                self.host,
                self.port,
                max_connections=_SENDER_MAX_CONNECTIONS,
                read_timeout_s=_SENDER_READ_TIMEOUT_S,
                retry_after_s=1,
                # A head the parser refused cannot carry a valid token.
                refuse_malformed=lambda parse_error: web.Response(status=401),
            )
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])

    async def _serve(self, request: Any) -> Any:
        from aiohttp import hdrs, web

        name = request.match_info["name"]
        entry = self._buckets.get(name)
        if entry is None:
            return web.Response(status=404)
        if not entry.token.accepts(request.headers.get(hdrs.AUTHORIZATION)):
            return web.Response(status=401)
        # No await between the lookup and here: two pulls cannot both take the last one.
        entry.pulls_left -= 1
        if entry.pulls_left <= 0:
            del self._buckets[name]
        return web.Response(body=entry.body, content_type="application/octet-stream")

    async def _announce(self, request: Any) -> Any:
        from aiohttp import hdrs, web

        token = self._announce_token
        if token is None or not token.accepts(request.headers.get(hdrs.AUTHORIZATION)):
            return web.Response(status=401)
        worker = request.match_info["worker"]
        if not _WORKER_ID.fullmatch(worker) or (
            worker not in self._workers and len(self._workers) >= _MAX_WORKERS
        ):
            return web.Response(status=400)
        self._workers.add(worker)
        return web.Response(status=204)

    async def send(self, bucket: Mapping[str, Any], post_update: PostJSON) -> None:
        from inference.server.auth import BearerToken

        await self._start()
        name, token = secrets.token_urlsafe(16), secrets.token_urlsafe(32)
        body = await asyncio.to_thread(_serialize, bucket)
        self._buckets[name] = _Bucket(BearerToken(token), body, pulls_left=self.workers)
        try:
            url = f"{self.origin}/buckets/{name}"
            await post_update(url_update_info(url, api_key=token))
        finally:
            self._buckets.pop(name, None)

    async def close(self) -> None:
        self._buckets.clear()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()


@dataclass
class _Bucket:
    token: Any
    """Its ``inference.server.auth.BearerToken``."""
    body: bytes
    pulls_left: int


def _serialize(bucket: Mapping[str, Any]) -> bytes:
    from safetensors.torch import save

    return save({name: t.detach().contiguous().cpu() for name, t in bucket.items()})


def _save(bucket: Mapping[str, Any], path: str) -> None:
    # Imported here: the generate path of the client stays torch-free.
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous().cpu() for name, t in bucket.items()}, path)


class TrainerBroadcast(Protocol):
    """The trainer's end of vLLM's NCCL weight-transfer group (rank 0, the sender).

    A real one wraps vLLM's trainer-side helpers (its TCPStore rendezvous and packed
    broadcast); it is given to :class:`NCCLBucketSender` by whoever owns the GPU.
    """

    def worker_init_info(self) -> dict[str, Any]:
        """``init_info`` of ``/init_weight_transfer_engine`` for the server's workers
        (vLLM's NCCL init info: master address and port, ``rank_offset``, ``world_size``,
        packing)."""
        ...

    async def open(self) -> None:
        """Join the group as rank 0; runs while the workers join it."""
        ...

    async def broadcast(self, tensors: Sequence[tuple[str, Any]]) -> None:
        """Broadcast the tensors in this order; runs while the workers receive them."""
        ...

    async def close(self) -> None: ...


class NCCLBucketSender:
    """vLLM's ``nccl`` backend: the HTTP request and the trainer's collective together."""

    def __init__(self, broadcast: TrainerBroadcast) -> None:
        self.broadcast = broadcast

    async def connect(self, post_init: PostJSON) -> None:
        await _together(post_init(self.broadcast.worker_init_info()), self.broadcast.open())

    async def send(self, bucket: Mapping[str, Any], post_update: PostJSON) -> None:
        items = list(bucket.items())
        update_info = {
            "names": [name for name, _ in items],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
        }
        await _together(post_update(update_info), self.broadcast.broadcast(items))

    async def close(self) -> None:
        await self.broadcast.close()


async def _together(request: Awaitable[None], collective: Awaitable[None]) -> None:
    """Run an RL API request and the trainer's side of its collective concurrently.

    Whichever fails first is raised and the other cancelled: a request refused before
    any NCCL call would otherwise leave the broadcast waiting for peers that never
    come (vLLM's own trainer client checks for exactly that), and a failed broadcast
    leaves the workers blocked in theirs. The group is unusable after either.
    """
    tasks = [asyncio.ensure_future(request), asyncio.ensure_future(collective)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task in done else None
            if error is not None:
                raise error
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
