"""A vLLM server as a Ray actor: the actor owns the server's process group on its node.

``ray`` is imported only by ``create_vllm_server_actor``, so the process side runs
without it. The actor reports the URL and API key; ``stop()`` ends every vLLM process
(the actor's interpreter exit does too, through ``VLLMServerProcess``'s atexit hook).
"""

from __future__ import annotations

from typing import Any

from inference.vllm.process import VLLMServerProcess, VLLMServerSpec

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class VLLMServerActor:
    """Wrap with ``ray.remote`` (``create_vllm_server_actor`` does): ``start()`` launches
    the server, waits for ``/health`` and returns the URL, ``stop()`` ends it."""

    def __init__(self, spec: VLLMServerSpec) -> None:
        self._server = VLLMServerProcess(spec)
        self._url: str | None = None

    def start(self) -> str:
        url = self._server.start()
        if self._server.spec.host in _WILDCARD_HOSTS:
            # Bound to every interface: report an address other nodes can reach.
            import ray

            url = f"http://{ray.util.get_node_ip_address()}:{url.rsplit(':', 1)[1]}"
        self._url = url
        return url

    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("VLLMServerActor.url: expected a started actor, got none")
        return self._url

    def api_key(self) -> str:
        return self._server.api_key

    def log_tail(self, n: int = 40) -> str:
        return self._server.log_tail(n)

    def log_excerpt(self, n: int = 40) -> str:
        return self._server.log_excerpt(n)

    def failure(self) -> str | None:
        """Why the server no longer serves (its exit, or ``/health`` not 200), or None:
        the launch asks after a failed step."""
        return self._server.failure()

    def stop(self) -> None:
        self._url = None
        self._server.stop()


def create_vllm_server_actor(
    spec: VLLMServerSpec, *, num_cpus: float = 1, name: str | None = None
) -> tuple[Any, str, str]:
    """Start a ``VLLMServerActor`` in the current Ray cluster; returns ``(actor_handle,
    url, api_key)``. Call ``ray.get(handle.stop.remote())`` before killing it."""
    import ray

    options: dict[str, Any] = {"num_cpus": num_cpus}
    if name is not None:
        options["name"] = name
    actor_class: Any = ray.remote(VLLMServerActor)  # ray's stubs type this loosely
    handle = actor_class.options(**options).remote(spec)
    url: str = ray.get(handle.start.remote())
    api_key: str = ray.get(handle.api_key.remote())
    return handle, url, api_key
