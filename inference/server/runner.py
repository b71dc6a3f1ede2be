"""Running the application: in the caller's event loop, or on a background thread.

The background form is what the Ray actor and synchronous callers use: the actor's
methods are plain calls, so the server gets its own thread and event loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future

from aiohttp import web

from inference.engine.base import InferenceEngine
from inference.server.app import ServerConfig, build_app, refuse_malformed_request
from inference.server.connections import ConnectionGuard, GuardedTCPSite

# Long enough for an in-flight CPU batch to finish, short enough not to hang a shutdown.
_SHUTDOWN_GRACE_S = 5.0
# After a reply to a request whose body was not read (a 401, 413 or 415 on a large
# upload), aiohttp drains the rest for this long so the client sees the reply rather
# than a reset; its default of 10 s would read a refused upload's garbage (or hold a
# 408'd trickling client) ten times as long.
_LINGER_S = 1.0


class RunningServer:
    """A started server in the current event loop; ``url`` is what it bound."""

    def __init__(self, runner: web.AppRunner, url: str, guard: ConnectionGuard) -> None:
        self._runner = runner
        self.url = url
        self.guard = guard
        """Its connection cap and header clock; ``guard.open_connections`` counts."""

    async def stop(self) -> None:
        """Stop listening, finish in-flight requests (bounded), close the engine."""
        await self._runner.cleanup()


async def start_server(engine: InferenceEngine, config: ServerConfig) -> RunningServer:
    """Serve ``engine`` on ``config.host:config.port`` (port 0: the OS picks one)."""
    runner = web.AppRunner(
        build_app(engine, config),
        access_log=None,
        shutdown_timeout=_SHUTDOWN_GRACE_S,
        keepalive_timeout=config.keepalive_timeout_s,
        lingering_time=_LINGER_S,
    )
    await runner.setup()
    try:
        site = GuardedTCPSite(
            runner,
            config.host,
            config.port,
            max_connections=config.max_connections,
            read_timeout_s=config.request_read_timeout_s,
            retry_after_s=config.retry_after_s,
            refuse_malformed=functools.partial(
                refuse_malformed_request, needs_token=config.api_key is not None
            ),
        )
        await site.start()
        host, port = runner.addresses[0][:2]
    except BaseException:
        await runner.cleanup()
        raise
    # An IPv6 literal needs brackets in a URL.
    shown = f"[{host}]" if ":" in host else host
    return RunningServer(runner, f"http://{shown}:{port}", site.guard)


class ServerThread:
    """A server on its own thread and event loop; ``start()`` returns the URL.

    ``engine_factory`` runs on the server thread, so an engine that binds itself to
    the loop it was built in (an asyncio engine, say) gets the right one.
    """

    def __init__(self, engine_factory: Callable[[], InferenceEngine], config: ServerConfig) -> None:
        self._engine_factory = engine_factory
        self._config = config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: RunningServer | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("ServerThread.url: expected a started server, got none")
        return self._server.url

    @property
    def alive(self) -> bool:
        """Whether the server's thread runs: False before ``start`` and once it ended."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, *, timeout_s: float = 120.0) -> str:
        if self._thread is not None:
            raise RuntimeError(
                "ServerThread.start: expected a fresh ServerThread, got a started one"
            )
        started: Future[str] = Future()
        self._thread = threading.Thread(
            target=self._serve, args=(started,), name="inference-server", daemon=True
        )
        self._thread.start()
        try:
            return started.result(timeout=timeout_s)
        except BaseException:
            self._thread.join(timeout=_SHUTDOWN_GRACE_S)
            self._thread = None
            raise

    def _serve(self, started: Future[str]) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopped = asyncio.Event()
            try:
                engine = self._engine_factory()
                self._server = await start_server(engine, self._config)
            except BaseException as exc:
                started.set_exception(exc)
                return
            started.set_result(self._server.url)
            await self._stopped.wait()
            await self._server.stop()

        asyncio.run(main())

    def stop(self, *, timeout_s: float = 30.0) -> None:
        """Stop the server and join its thread; a no-op when not running."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._loop is not None and self._stopped is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stopped.set)
            except RuntimeError:  # the loop closed between the check and the call
                pass
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            raise RuntimeError(f"ServerThread.stop: the server thread outlived {timeout_s} s")
