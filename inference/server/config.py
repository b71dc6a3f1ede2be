"""``ServerConfig``: everything the server enforces, checked when it is built."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; wildcards ('', 0.0.0.0, ::) are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server enforces; all limits are explicit and bounded."""

    host: str = "127.0.0.1"
    """Loopback by default: the server has no TLS, so exposing it is a deliberate act,
    and any other host needs an ``api_key``."""
    port: int = 0
    """0 lets the OS pick a free port; the bound URL is reported on start."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token for every route but ``/health``; required off loopback. Out of the
    repr, so a logged or printed config never shows it."""
    max_request_bytes: int = 16 * 1024 * 1024
    """Generate request bodies; at about 7 bytes per token id, 16 MiB holds prompts of
    over 2M tokens, so only abuse hits it. Weight uploads are capped by the model's own
    size instead (see ``inference.server.weights_upload``)."""
    max_new_tokens: int = 4096
    max_model_len: int = 2048
    max_sample_support_k: int = 64
    default_sample_support_k: int = 8
    max_pending_requests: int = 4096
    """Beyond this many generate requests in flight the server answers 503 with
    Retry-After instead of queueing without bound."""
    retry_after_s: int = 1
    keepalive_timeout_s: float = 30.0
    """An idle connection is closed after this. Longer than aiohttp's client pool
    keep-alive (15 s), so the client retires a connection before the server does: a
    server-side close racing a reused connection costs the client a failed attempt."""
    request_read_timeout_s: float = 30.0
    """A request's headers and body must arrive within this of its first byte, or the
    connection is answered 408 / closed: 3,000 half-sent requests were once held open
    for 90 s. A 16 MiB generate body needs 0.2 s at 100 MB/s."""
    weight_read_timeout_s: float = 600.0
    """A weight upload's tensor data must arrive within this of the upload taking the
    weight lock: a 16 GB bf16 model at 1 Gbit/s needs ~130 s."""
    max_connections: int = 1024
    """Connections beyond this are answered 503 and closed at once, before aiohttp
    allocates a parser for them. 16 clients at their default 64 connections each."""

    def __post_init__(self) -> None:
        for name in (
            "max_request_bytes",
            "max_new_tokens",
            "max_model_len",
            "max_sample_support_k",
            "max_pending_requests",
            "max_connections",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServerConfig.{name}: expected an int >= 1, got {value!r}")
        for name in ("keepalive_timeout_s", "request_read_timeout_s", "weight_read_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(
                    f"ServerConfig.{name}: expected a finite number > 0, got {value!r}"
                )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port: expected an int in [0, 65535], got {self.port!r}")
        if not 1 <= self.default_sample_support_k <= self.max_sample_support_k:
            raise ValueError(
                f"ServerConfig.default_sample_support_k: expected an int in "
                f"[1, {self.max_sample_support_k}], got {self.default_sample_support_k!r}"
            )
        if self.retry_after_s < 0:
            raise ValueError(
                f"ServerConfig.retry_after_s: expected >= 0, got {self.retry_after_s!r}"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key: expected None or a non-empty token, got ''")
        if self.api_key is None and not is_loopback(self.host):
            # Without TLS or a token, anyone who can reach the port could replace the
            # model's weights; on loopback that is only this machine's users.
            raise ValueError(
                f"ServerConfig.api_key: expected a token for host {self.host!r} (not "
                f"loopback: 127.0.0.0/8, ::1, localhost), got None"
            )
