"""The inference server as a Ray actor: builds the engine, serves HTTP, reports its URL.

``ray`` is imported only by ``create_server_actor``, so the plain server runs
without it. Ray 2.60 measured here: ``ray.init(num_cpus=2)`` ≈ 4 s, an actor serving
aiohttp ≈ 0.3 s more.

With ``log_file`` the server's own log (the ``inference`` loggers at INFO: its start,
every failed request's traceback, its stop) goes to that file, which the actor never
deletes: a launch keeps it under its run folder and quotes its tail when the engine
stops mid-run (``skyrl_train.trainer.engines``). Each start appends to it, after a
``LAUNCH_MARKER`` line, so that report quotes this start's first error, not an earlier
launch's (``inference.errors.read_first_error``).
"""

from __future__ import annotations

import logging
from typing import Any

from inference.errors import log_excerpt, mark_launch, read_log_tail
from inference.server.app import ServerConfig
from inference.server.launch import EngineSpec
from inference.server.runner import ServerThread

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class InferenceServerActor:
    """Wrap with ``ray.remote`` (``create_server_actor`` does): ``start()`` builds the
    engine and returns the URL, ``stop()`` shuts the server down and closes the engine."""

    def __init__(
        self,
        engine: EngineSpec,
        server: ServerConfig | None = None,
        *,
        log_file: str | None = None,
    ) -> None:
        self._engine = engine
        self._config = server if server is not None else ServerConfig()
        self._thread: ServerThread | None = None
        self._url: str | None = None
        self._log_file = log_file
        self._log_handler: logging.Handler | None = None

    def _open_log(self) -> None:
        if self._log_file is None or self._log_handler is not None:
            return
        mark_launch(self._log_file)
        handler = logging.FileHandler(self._log_file, encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        package = logging.getLogger("inference")
        package.setLevel(logging.INFO)  # this actor's process serves nothing else
        package.addHandler(handler)
        self._log_handler = handler

    def _close_log(self) -> None:
        handler, self._log_handler = self._log_handler, None
        if handler is not None:
            logging.getLogger("inference").removeHandler(handler)
            handler.close()

    def start(self) -> str:
        if self._thread is not None:
            raise RuntimeError(
                "InferenceServerActor.start: expected a stopped actor, got a running one"
            )
        self._open_log()
        log = logging.getLogger(__name__)
        log.info("starting the engine on %s", self._engine.checkpoint)
        thread = ServerThread(self._engine.build, self._config)
        try:
            url = thread.start()
        except BaseException:
            log.exception("the server did not start")
            self._close_log()
            raise
        log.info("serving %s at %s", self._engine.checkpoint, url)
        self._thread = thread
        if self._config.host in _WILDCARD_HOSTS:
            # Bound to every interface: report an address other nodes can reach.
            import ray
            import yarl

            url = f"http://{ray.util.get_node_ip_address()}:{yarl.URL(url).port}"
        self._url = url
        return url

    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("InferenceServerActor.url: expected a started actor, got none")
        return self._url

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of ``log_file`` ("" without one)."""
        return "" if self._log_file is None else read_log_tail(self._log_file, n)

    def log_excerpt(self, n: int = 40) -> str:
        """The log's first error and last ``n`` lines (``inference.errors.log_excerpt``)."""
        return "" if self._log_file is None else log_excerpt(self._log_file, n)

    def failure(self) -> str | None:
        """Why the server no longer serves (its thread ended), or None while it does:
        the launch asks after a failed step."""
        if self._thread is None or self._thread.alive:
            return None
        return "its server thread ended"

    def stop(self) -> None:
        thread, self._thread, self._url = self._thread, None, None
        if thread is not None:
            thread.stop()
            logging.getLogger(__name__).info("stopped")
        self._close_log()


def create_server_actor(
    engine: EngineSpec,
    server: ServerConfig | None = None,
    *,
    num_cpus: float = 1,
    name: str | None = None,
    log_file: str | None = None,
) -> tuple[Any, str]:
    """Start an ``InferenceServerActor`` in the current Ray cluster; returns
    ``(actor_handle, url)``. Call ``ray.get(handle.stop.remote())`` before killing it."""
    import ray

    options: dict[str, Any] = {"num_cpus": num_cpus}
    if name is not None:
        options["name"] = name
    actor_class: Any = ray.remote(InferenceServerActor)  # ray's stubs type this loosely
    handle = actor_class.options(**options).remote(engine, server, log_file=log_file)
    url: str = ray.get(handle.start.remote())
    return handle, url
